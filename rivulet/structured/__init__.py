"""Structured output: grammars compiled with xgrammar off the engine loop, a matcher per request, the
token bitmask of each step (`StructuredOutputManager`, used by `EngineCore`); `check` validates a
request's grammar up front. xgrammar (and with it torch) is imported on first use only."""

from rivulet.structured.grammar import check, compile_grammar
from rivulet.structured.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager", "check", "compile_grammar"]
