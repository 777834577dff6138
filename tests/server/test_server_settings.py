"""`rivulet serve`'s own flags out of range: one-line errors before anything starts."""

from __future__ import annotations

import pytest

from rivulet.config import RivuletError
from rivulet.entrypoints.cli import build_parser
from rivulet.entrypoints.openai.launch import settings_from_args


@pytest.mark.parametrize("flags, words", [
    (["--port", "70000"], "--port must be in 0..65535, got 70000"),  # once served on some other port
    (["--port", "-1"], "--port must be in 0..65535"),
    (["--served-model-name", ""], "a name cannot be empty"),  # once served a model named ""
    (["--served-model-name", "a", " "], "a name cannot be empty"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
    (["--max-engine-restarts", "-1"], "--max-engine-restarts must be >= 0"),
    (["--engine-watchdog-s", "0"], "--engine-watchdog-s must be > 0"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--log-request-text"], "--log-request-text needs --log-requests"),
])
def test_serve_flags_out_of_range(flags, words):
    with pytest.raises(RivuletError, match=words):
        settings_from_args(build_parser().parse_args(["serve", *flags]))


def test_serve_flags_in_range_are_taken():
    s = settings_from_args(build_parser().parse_args(["serve", "--port", "0", "--served-model-name", "a", "b"]))
    assert s.served_model_names == ["a", "b"]
