"""Request bodies: unknown fields are ignored but named in the log (a misspelt field is not silent)."""

from __future__ import annotations

import logging

from rivulet.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


def test_unknown_fields_are_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="rivulet.entrypoints.openai.protocol"):
        body = CompletionRequest.model_validate({"prompt": "hi", "max_token": 5, "temprature": 0.1})
        assert body.max_tokens == 16 and body.temperature is None  # the misspelt ones did nothing
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                              "user": "u", "seed": 1})
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["CompletionRequest: ignored the unknown field(s) max_token, temprature"]
