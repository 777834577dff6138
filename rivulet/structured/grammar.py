"""One grammar of a request (`StructuredOutputsParams.key`: json schema, regex or EBNF) through xgrammar:
checked without a tokenizer, compiled with one."""

from __future__ import annotations

import re
from typing import Any

from rivulet.config import RivuletError
from rivulet.sampling_params import StructuredOutputsParams

# JSON: at most this many whitespace characters in a row (pretty-printing fits; a model that would
# otherwise pad forever, e.g. one with random weights, cannot)
MAX_JSON_WHITESPACE = 24
_KINDS = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar"}
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message


def _message(e: Exception) -> str:
    return _LOG_PREFIX.sub("", str(e).strip()).strip()


def check(params: StructuredOutputsParams) -> None:
    """RivuletError naming what is wrong if the grammar does not parse (or uses a JSON-schema feature
    xgrammar does not support)."""
    import xgrammar as xgr

    kind, text = params.key
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own errors
        what = "choice list" if params.choice is not None else _KINDS[kind]
        raise RivuletError(f"structured output: invalid {what}: {_message(e)}") from None


def compile_grammar(compiler: Any, params: StructuredOutputsParams) -> Any:
    """The xgrammar CompiledGrammar of `params` (compiler: an `xgrammar.GrammarCompiler`)."""
    kind, text = params.key
    try:
        if kind == "json":
            return compiler.compile_json_schema(text, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)
    except Exception as e:  # noqa: BLE001
        raise RivuletError(f"structured output: cannot compile the {_KINDS[kind]}: {_message(e)}") from None
