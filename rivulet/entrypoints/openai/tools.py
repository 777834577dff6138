"""Tool calling for chat completions: which tools reach the chat template, the grammar that enforces
`tool_choice` "required" or a named function, and the parsers that find tool calls in free output
(`--tool-call-parser`, for `tool_choice` "auto" with `--enable-auto-tool-choice`).

    none      tools are not rendered; plain text
    auto      tools rendered; the parser splits the answer into content and tool calls
    required  tools rendered; the answer is a JSON array of {"name", "parameters"} (a grammar: always
              valid, at least one call, each call's parameters following its function's schema)
    {"type": "function", "function": {"name": N}}
              tools rendered; the answer is the arguments of N (its parameters schema as the grammar)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from rivulet.config import RivuletError
from rivulet.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolPlan:
    """What a request's `tools` and `tool_choice` make of it."""

    render: list[dict[str, Any]] | None  # tools for the chat template (None: none)
    structured: StructuredOutputsParams | None  # the grammar of "required" / a named function
    mode: str  # "none", "auto", "required", "named"
    name: str | None = None  # the named function

    def calls(self, text: str, parser: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished answer."""
        if self.mode == "named":
            return None, [ToolCall(self.name or "", _compact(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:  # cut by max_tokens: what was said is content
                return text, []
            return None, [ToolCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]
        if self.mode == "auto" and parser is not None:
            return parse_tool_calls(parser, text)
        return text, []


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, auto_enabled: bool) -> ToolPlan:
    """The plan of a request (RivuletError, a 400, for a choice that cannot be served)."""
    functions = {}
    for t in tools or []:
        fn = t.get("function") or {}
        if t.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
            raise RivuletError("tools: each tool is {\"type\": \"function\", \"function\": {\"name\", ...}}")
        functions[fn["name"]] = fn
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none" or not functions and tool_choice == "auto":
        return ToolPlan(None, None, "none")
    if not functions:
        raise RivuletError(f"tool_choice {json.dumps(tool_choice)} needs tools")
    if tool_choice == "auto":
        if not auto_enabled:
            raise RivuletError("tool_choice \"auto\" needs the server started with --enable-auto-tool-choice and "
                               "--tool-call-parser (or send tool_choice \"none\", \"required\" or a named function)")
        return ToolPlan(list(tools or []), None, "auto")
    if tool_choice == "required":
        variants = [{"type": "object", "properties": {"name": {"const": n}, "parameters": _params(f)},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for n, f in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        return ToolPlan(list(tools or []), StructuredOutputsParams(json=schema), "required")
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise RivuletError(f"tool_choice names function {name!r}, which is not in tools "
                               f"({', '.join(functions)})")
        return ToolPlan(list(tools or []), StructuredOutputsParams(json=_params(functions[name])), "named", name)
    raise RivuletError("tool_choice is \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def _params(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text


# ---- parsers of free output ----

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of `text` in `parser`'s format; text that does not parse stays content."""
    if parser == "hermes":  # Qwen2.5/Qwen3, Hermes: <tool_call>{"name", "arguments"}</tool_call> ...
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = _objects([m.group(1) for m in _HERMES.finditer(text, start)], "arguments")
        if calls is None:
            return text, []
        return (text[:start].strip() or None), calls
    if parser == "llama3_json":  # Llama 3.x: {"name", "parameters"} (several joined by ';')
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = _objects([p for p in body.split(";") if p.strip()], "parameters")
        return (None, calls) if calls is not None else (text, [])
    if parser == "mistral":  # [TOOL_CALLS][{"name", "arguments"}, ...]
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len("[TOOL_CALLS]"):].strip())
        except json.JSONDecodeError:
            return text, []
        calls = _objects([json.dumps(i) for i in (items if isinstance(items, list) else [items])], "arguments")
        return ((text[:start].strip() or None), calls) if calls is not None else (text, [])
    raise RivuletError(f"unknown tool call parser {parser!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")


def _objects(texts: list[str], args_key: str) -> list[ToolCall] | None:
    calls = []
    for t in texts:
        try:
            obj = json.loads(t)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
        calls.append(ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return calls


_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def streamable_prefix(parser: str | None, text: str) -> int:
    """While streaming with tool_choice "auto": how many characters of `text` (the answer so far) are
    surely content. The rest may be going into a tool call: held back, and parsed at the end."""
    marker = _MARKERS.get(parser or "")
    if marker is not None:
        at = text.find(marker)
        if at >= 0:
            return at
        for k in range(min(len(marker) - 1, len(text)), 0, -1):  # the text may end inside the marker
            if text.endswith(marker[:k]):
                return len(text) - k
        return len(text)
    if parser == "llama3_json":  # a call is the whole answer: hold while it may be one
        body = text.lstrip()
        if not body or body.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(body):
            return 0
    return len(text)
