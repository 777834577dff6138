"""Mid-stream failover: resume a stream whose worker died on another worker, in the same SSE stream.

The router asks every streamed request for ``return_token_ids`` (vLLM's field, which Rivulet also
serves), so it knows the prompt's token ids and every token already sent. When the worker fails
after the first byte, the rest is asked of another worker as a completion of *prompt + tokens
sent* with the remaining ``max_tokens`` (and ``min_tokens``) and the same sampling fields and
seed; its chunks are rewritten into the original stream (its id, its object kind, a chat delta
for a chat request, usage counted from the original prompt). At temperature 0 the client gets the
tokens an unbroken run gives (as exact as the engines' own batch invariance).

What cannot be resumed gets an error event and ``[DONE]`` instead, never a hang: ``n > 1`` or
several prompts, logprobs, echo, structured output or tools (their state lives in the dead
worker), or a worker that did not return token ids. Stop strings are checked by the new worker
from the resume point on only, and frequency/presence penalties see the sent tokens as prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# Request fields that carry over unchanged to the resumed completion.
_CARRIED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "skip_special_tokens",
            "include_stop_str_in_output", "priority", "cache_salt", "user", "stream_options")
_STATEFUL = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "tools")


def resumable(kind: str, body: dict[str, Any]) -> str | None:
    """Why a stream of this request cannot be resumed on another worker; None when it can."""
    if body.get("n", 1) not in (1, None):
        return "n > 1"
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                return "several prompts"
        if body.get("echo") or body.get("logprobs") is not None or body.get("suffix"):
            return "echo or logprobs"
    elif body.get("logprobs"):
        return "logprobs"
    for name in _STATEFUL:
        if body.get(name) and not (name == "response_format" and body[name].get("type") == "text"):
            return name
    return None


@dataclass
class StreamState:
    """What the client has been sent of one streamed choice."""

    kind: str  # "completions" or "chat"
    body: dict[str, Any]  # the client's request
    prompt_ids: list[int] | None = None
    id: str | None = None
    created: int | None = None
    model: str | None = None
    finished: bool = False  # a finish_reason was sent
    usage_sent: bool = False
    resumes: int = 0
    _ids: list[int] = field(default_factory=list)
    _id_bytes: list[bytes] = field(default_factory=list)  # token ids of relayed events, parsed when needed

    @property
    def token_ids(self) -> list[int]:
        """Every token id sent so far."""
        if self._id_bytes:
            self._ids.extend(int(t) for piece in self._id_bytes for t in piece.split(b",") if t.strip())
            self._id_bytes.clear()
        return self._ids

    def observe(self, obj: dict[str, Any]) -> None:
        """Record one chunk sent to the client (original or rewritten)."""
        if self.id is None:
            self.id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        if self.prompt_ids is None and isinstance(obj.get("prompt_token_ids"), list):
            self.prompt_ids = obj["prompt_token_ids"]
        for choice in obj.get("choices") or []:
            if self.prompt_ids is None and isinstance(choice.get("prompt_token_ids"), list):
                self.prompt_ids = choice["prompt_token_ids"]
            self.token_ids.extend(choice.get("token_ids") or [])
            if choice.get("finish_reason") is not None:
                self.finished = True
        if obj.get("usage"):
            self.usage_sent = True

    def needs_parse(self, data: bytes) -> bool:
        """Whether an event must be parsed: the first one, one that carries the prompt's ids before they are
        known, and any that may be an error event. The rest go through `observe_raw`."""
        return self.id is None or b'"error"' in data or (self.prompt_ids is None and b'"prompt_token_ids"' in data)

    def observe_raw(self, data: bytes) -> None:
        """`observe` for one event's JSON text as the worker sent it (an event `needs_parse` declined)."""
        self._id_bytes.extend(_TOKEN_IDS.findall(data))
        if not self.finished and _FINISHED.search(data):
            self.finished = True
        if not self.usage_sent and _USAGE.search(data):
            self.usage_sent = True

    def continuation(self) -> dict[str, Any]:
        """The body of the completion that resumes the stream."""
        body = self.body
        resumed: dict[str, Any] = {k: body[k] for k in _CARRIED if k in body}
        assert self.prompt_ids is not None
        resumed.update(prompt=self.prompt_ids + self.token_ids, stream=True, return_token_ids=True)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if self.kind == "completions" and limit is None and "max_tokens" not in body:
            limit = 16  # the completions default
        if limit is not None:
            resumed["max_tokens"] = max(1, int(limit) - len(self.token_ids))
        else:
            resumed["max_tokens"] = None  # a chat without a limit: the rest of the context, not the completions 16
        if body.get("min_tokens"):
            resumed["min_tokens"] = max(0, int(body["min_tokens"]) - len(self.token_ids))
        return resumed

    def rewrite(self, obj: dict[str, Any], resumed_from: int) -> dict[str, Any] | None:
        """A chunk of the resumed completion as a chunk of the original stream (None: nothing to send).
        `resumed_from` is how many tokens had been sent when this continuation started."""
        choices = []
        for choice in obj.get("choices") or []:
            text = choice.get("text") or ""
            ids = choice.get("token_ids") or []
            if not text and not ids and choice.get("finish_reason") is None:
                continue
            out: dict[str, Any] = {"index": 0}
            if self.kind == "chat":
                out.update(delta={"content": text} if text else {}, logprobs=None)
            else:
                out.update(text=text, logprobs=None)
            out.update(finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
                       token_ids=ids)
            choices.append(out)
        usage = obj.get("usage")
        if not choices and not usage:
            return None
        new: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else
                               "text_completion", "created": self.created, "model": self.model, "choices": choices}
        if usage:
            n_prompt = len(self.prompt_ids or [])
            completion = resumed_from + int(usage.get("completion_tokens") or 0)
            new["usage"] = {**usage, "prompt_tokens": n_prompt, "completion_tokens": completion,
                            "total_tokens": n_prompt + completion}
        elif "usage" in obj:
            new["usage"] = None
        return new


def strip_token_ids(obj: dict[str, Any]) -> dict[str, Any]:
    """A chunk without the token-id fields the router asked for on the client's behalf."""
    obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or []:
        choice.pop("prompt_token_ids", None)
        choice.pop("token_ids", None)
    return obj


def strip_token_ids_raw(data: bytes) -> bytes:
    """`strip_token_ids` on an event's JSON text. Exact because a key can only match outside strings:
    inside a JSON string every quote is escaped, so ``"token_ids":`` cannot occur there."""
    return _ID_FIELDS.sub(b"", data)


# a token-id field (with its comma) and the ids of a "token_ids" field; the values are flat lists of ints
_ID_FIELDS = re.compile(rb',\s*"(?:prompt_)?token_ids"\s*:\s*(?:\[[^\]]*\]|null)'
                        rb'|"(?:prompt_)?token_ids"\s*:\s*(?:\[[^\]]*\]|null)\s*,?')
_TOKEN_IDS = re.compile(rb'"token_ids"\s*:\s*\[([^\]]*)\]')
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')  # a reason is a string; none is null
_USAGE = re.compile(rb'"usage"\s*:\s*\{')


def server_error_event(obj: dict[str, Any]) -> bool:
    """An in-stream error event that means the worker failed (not the request)."""
    err = obj.get("error")
    if not isinstance(err, dict):
        return False
    return err.get("type") == "server_error" or err.get("code") in ("engine_dead", 500, "500")


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
