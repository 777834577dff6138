"""Pipeline stages: what a stage is, the built-in ones, and plugins (Python entry points in the
``rivulet.plugins`` group). A stage may change the request before the generation (`on_input`) and filter
each choice's text after it (`output_filter`); both are optional. Stages are built from their deployment
entries here, without the web app, so a bad file fails before anything starts.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Callable

import jinja2
import jinja2.sandbox
import regex

from rivulet.entrypoints.pipelines.filters import Blocker, Redactor, TextFilter, compile_patterns

PLUGIN_GROUP = "rivulet.plugins"
COMMON_KEYS = {"type", "timeout", "on_error", "name"}


class StageRejected(Exception):
    """An input stage refused the request: an OpenAI-style 400 with this message."""

    def __init__(self, message: str, code: str = "content_blocked") -> None:
        super().__init__(message)
        self.code = code


class StageAnswered(Exception):
    """An input stage answered the request itself (a refusal): no generation, this text is the reply."""

    def __init__(self, text: str, finish_reason: str = "content_filter") -> None:
        super().__init__(text)
        self.text, self.finish_reason = text, finish_reason


@dataclass
class PipelineRequest:
    """What the stages see and change: the request body (a chat or completion request of the OpenAI API), the
    model that will generate, and values stages leave for later ones (`context`, e.g. retrieved passages)."""

    kind: str  # "chat" | "completion"
    body: Any
    model: str | None = None
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The user's text: the last user message (chat) or the prompt (completion)."""
        if self.kind == "chat":
            msg = self._last_user()
            return msg.content if isinstance(msg.content, str) else ""
        prompt = self.body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise StageRejected("a pipeline takes one text prompt (not token ids or a list)", "invalid_prompt")
        return prompt

    @text.setter
    def text(self, value: str) -> None:
        if self.kind == "chat":
            self._last_user().content = value
        else:
            self.body.prompt = value

    def all_texts(self) -> list[str]:
        """Every text the user sent: each message's string content, or the prompt."""
        if self.kind == "chat":
            return [m.content for m in self.body.messages if isinstance(m.content, str)]
        return [self.text]

    def map_texts(self, fn: Callable[[str], str]) -> None:
        if self.kind == "chat":
            for m in self.body.messages:
                if isinstance(m.content, str):
                    m.content = fn(m.content)
        else:
            self.text = fn(self.text)

    def _last_user(self) -> Any:
        users = [m for m in self.body.messages if m.role == "user"]
        if not users:
            raise StageRejected("a pipeline needs a user message", "invalid_messages")
        return users[-1]


class Stage:
    """Base of the built-in stages (a plugin need not inherit it: the two methods are looked up)."""

    kind = ""
    keys: set[str] = set()  # this type's own keys

    def __init__(self, d: dict[str, Any], where: str) -> None:
        self.where = where
        self.timeout: float | None = d.get("timeout")
        self.on_error: str = d.get("on_error", "fail")
        self.label: str = d.get("name") or self.kind
        if self.timeout is not None and (not isinstance(self.timeout, (int, float)) or self.timeout <= 0):
            raise ValueError(f"{where}: timeout must be a number of seconds > 0")
        if self.on_error not in ("fail", "skip"):
            raise ValueError(f"{where}: on_error must be 'fail' or 'skip'")
        if unknown := sorted(set(d) - COMMON_KEYS - self.keys):
            known = ", ".join(sorted(COMMON_KEYS | self.keys))
            raise ValueError(f"{where}: unknown key {unknown[0]!r} for a {self.kind} stage (known: {known})")

    def models(self) -> list[str]:
        """Models of the deployment this stage names (checked when the deployment is read)."""
        return []

    async def on_input(self, req: PipelineRequest) -> None:
        return None

    def output_filter(self, req: PipelineRequest) -> TextFilter | None:
        return None


def _sides(d: dict[str, Any], where: str, default: list[str]) -> set[str]:
    on = d.get("on", default)
    if not isinstance(on, list) or not on or not set(on) <= {"input", "output"}:
        raise ValueError(f"{where}: 'on' must list input and/or output")
    return set(on)


class TemplateStage(Stage):
    """The user's text rendered into a Jinja template: `{{ input }}`, and what earlier stages left (e.g.
    `{{ passages }}` from a retrieve stage)."""

    kind, keys = "template", {"template"}

    def __init__(self, d: dict[str, Any], where: str) -> None:
        super().__init__(d, where)
        text = d.get("template")
        if not isinstance(text, str) or not text:
            raise ValueError(f"{where}: 'template' must be a Jinja template string")
        try:
            self.template = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined).from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{where}: bad template: {e}") from None

    async def on_input(self, req: PipelineRequest) -> None:
        req.text = self.template.render(input=req.text, **req.context)


class RedactStage(Stage):
    """Regex matches replaced in the input (every user text) and/or the output (streamed: a match split over
    chunks is held back until it is whole)."""

    kind, keys = "redact", {"patterns", "replacement", "on"}

    def __init__(self, d: dict[str, Any], where: str) -> None:
        super().__init__(d, where)
        self.rx = compile_patterns(d.get("patterns"), where)
        self.replacement = d.get("replacement", "[redacted]")
        if not isinstance(self.replacement, str):
            raise ValueError(f"{where}: 'replacement' must be a string")
        self.on = _sides(d, where, ["input", "output"])

    async def on_input(self, req: PipelineRequest) -> None:
        if "input" in self.on:
            req.map_texts(lambda t: self.rx.sub(self.replacement.replace("\\", "\\\\"), t))

    def output_filter(self, req: PipelineRequest) -> TextFilter | None:
        return Redactor(self.rx, self.replacement) if "output" in self.on else None


class GuardStage(Stage):
    """Block lists. Input: a match is a 400 (`action: reject`) or an answer of `message` without generating
    (`refuse`). Output: the choice ends before the match (with `message` when refusing), finish_reason
    content_filter."""

    kind, keys = "guard", {"patterns", "words", "on", "action", "message"}

    def __init__(self, d: dict[str, Any], where: str) -> None:
        super().__init__(d, where)
        words = d.get("words") or []
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            raise ValueError(f"{where}: 'words' must be a list of strings")
        patterns = list(d.get("patterns") or []) + [rf"(?i)\b{regex.escape(w)}\b" for w in words]
        self.rx = compile_patterns(patterns, where)
        self.on = _sides(d, where, ["input"])
        self.action = d.get("action", "reject")
        if self.action not in ("reject", "refuse"):
            raise ValueError(f"{where}: action must be 'reject' or 'refuse'")
        self.message = d.get("message", "I can't help with that.")

    async def on_input(self, req: PipelineRequest) -> None:
        if "input" not in self.on:
            return
        if any(self.rx.search(t) for t in req.all_texts()):
            if self.action == "refuse":
                raise StageAnswered(self.message)
            raise StageRejected(f"the request was blocked by the {self.label} stage")

    def output_filter(self, req: PipelineRequest) -> TextFilter | None:
        if "output" not in self.on:
            return None
        return Blocker(self.rx, self.message if self.action == "refuse" else None)


class RouteStage(Stage):
    """The model that generates, by the first rule whose pattern the user's text matches, else `default`."""

    kind, keys = "route", {"rules", "default"}

    def __init__(self, d: dict[str, Any], where: str) -> None:
        super().__init__(d, where)
        rules = d.get("rules")
        if not isinstance(rules, list) or not rules:
            raise ValueError(f"{where}: 'rules' must be a list of {{pattern, model}}")
        self.rules = []
        for i, r in enumerate(rules):
            if not isinstance(r, dict) or set(r) != {"pattern", "model"}:
                raise ValueError(f"{where}: rules[{i}] must be {{pattern: REGEX, model: NAME}}")
            self.rules.append((compile_patterns([r["pattern"]], f"{where}: rules[{i}]"), r["model"]))
        self.default = d.get("default")

    def models(self) -> list[str]:
        return [m for _, m in self.rules] + ([self.default] if self.default else [])

    async def on_input(self, req: PipelineRequest) -> None:
        text = req.text
        req.model = next((m for rx, m in self.rules if rx.search(text)), self.default or req.model)


class GenerateStage(Stage):
    """Where the generation happens, and on which model (unless a route stage chose one)."""

    kind, keys = "generate", {"model"}

    def __init__(self, d: dict[str, Any], where: str) -> None:
        super().__init__(d, where)
        self.model = d.get("model")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"{where}: 'model' must name a model of the deployment")

    def models(self) -> list[str]:
        return [self.model]


class RetrieveStage(Stage):
    """The user's text embedded by an embedding model of the deployment, the `top_k` nearest passages of a
    folder of documents found in a vector index (faiss, persisted in `index`), and put into the prompt
    (`template`, with `{passages}` and `{input}`) and into `context["passages"]` for later stages."""

    kind, keys = "retrieve", {"embed_model", "documents", "index", "top_k", "template", "chunk_chars"}
    DEFAULT_TEMPLATE = "Use the context to answer.\n\nContext:\n{passages}\n\nQuestion: {input}"

    def __init__(self, d: dict[str, Any], where: str) -> None:
        super().__init__(d, where)
        self.embed_model = d.get("embed_model")
        self.documents = d.get("documents")
        self.index_dir = d.get("index")
        for key in ("embed_model", "documents", "index"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise ValueError(f"{where}: {key!r} is required (a model name, a folder of documents, an index folder)")
        self.top_k = d.get("top_k", 3)
        self.chunk_chars = d.get("chunk_chars", 800)
        for key, v in (("top_k", self.top_k), ("chunk_chars", self.chunk_chars)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}: {key} must be an integer >= 1")
        self.template = d.get("template", self.DEFAULT_TEMPLATE)
        if not isinstance(self.template, str) or "{input}" not in self.template:
            raise ValueError(f"{where}: 'template' must be a string with {{input}} (and {{passages}})")
        self.index: Any = None  # a retrieval.DocumentIndex, set when the server builds or loads it
        self.embed: Callable[[list[str]], Any] | None = None  # async: texts -> vectors, set by the server

    def models(self) -> list[str]:
        return [self.embed_model]

    async def on_input(self, req: PipelineRequest) -> None:
        assert self.index is not None and self.embed is not None, "the server prepares the index first"
        query = req.text
        [vector] = await self.embed([query])
        passages = self.index.search(vector, self.top_k)
        req.context["passages"] = passages
        req.text = self.template.replace("{passages}", "\n\n".join(passages)).replace("{input}", query)


class PluginStage(Stage):
    """A stage from an entry point of the `rivulet.plugins` group: `factory(options)` returns an object with
    `on_input(request)` (async) and/or `output_filter(request)`, as the built-in stages have."""

    kind, keys = "plugin", {"plugin", "options"}

    def __init__(self, d: dict[str, Any], where: str) -> None:
        super().__init__(d, where)
        name = d.get("plugin")
        self.label = d.get("name") or name
        found = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.name == name]
        if not found:
            have = sorted(ep.name for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP))
            raise ValueError(f"{where}: no plugin {name!r} in the {PLUGIN_GROUP} entry points "
                             f"(installed: {', '.join(have) or 'none'})")
        try:
            self.impl = found[0].load()(dict(d.get("options") or {}))
        except Exception as e:  # noqa: BLE001 - a plugin's own failure, named
            raise ValueError(f"{where}: plugin {name!r} failed to start: {type(e).__name__}: {e}") from None

    async def on_input(self, req: PipelineRequest) -> None:
        fn = getattr(self.impl, "on_input", None)
        if fn is not None:
            await fn(req)

    def output_filter(self, req: PipelineRequest) -> TextFilter | None:
        fn = getattr(self.impl, "output_filter", None)
        return fn(req) if fn is not None else None


STAGES: dict[str, type] = {s.kind: s for s in (TemplateStage, RedactStage, GuardStage, RouteStage, GenerateStage,
                                               RetrieveStage, PluginStage)}


def build_stage(d: Any, where: str) -> Any:
    if not isinstance(d, dict) or d.get("type") not in STAGES:
        raise ValueError(f"{where}: a stage is a mapping with 'type' one of {', '.join(STAGES)}")
    return STAGES[d["type"]](d, where)
