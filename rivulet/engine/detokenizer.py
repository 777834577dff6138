"""Incremental detokenization and stop strings for one request.

Decoding uses vLLM's prefix-offset method on the fast (Rust) tokenizer: each step
decodes a small window of tokens twice, once up to the last emitted token (the
prefix) and once to the newest, and the difference is the new text.  Text is
released only when the window's decode does not end in U+FFFD, so a character
spread over several tokens (emoji, CJK) appears once, complete.  The window starts
with a few prompt tokens so that tokenizers whose decoding depends on the left
context (SentencePiece's leading space) decode the first output token right.

Stop strings are searched in the output text (never the prompt).  The earliest
completed stop string wins: the match that ends first, and among those the one
that starts first.  While streaming, the last ``len(longest stop) - 1``
characters are held back, since they may turn out to be the start of a stop
string; ``flush`` releases them when the request ends for another reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

from rivulet.sampling_params import SamplingParams

if TYPE_CHECKING:  # transformers takes ~1 s to import: loaded with the tokenizer, off the start-up path
    from transformers import PreTrainedTokenizerBase

# How many prompt tokens give the first output tokens their left context.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a finalised delta at a time.

    The concatenation of every delta returned by ``update`` and ``flush`` equals
    ``output_text``.  Without stop strings that is the tokenizer's decode of all
    output tokens (for byte-level BPE tokenizers, exactly
    ``tokenizer.decode(output_token_ids, skip_special_tokens=...)``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """``min_tokens``: stop strings are only checked once the output has more tokens."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not isinstance(backend, Tokenizer):
            raise TypeError(f"need a fast (Rust) tokenizer, got {type(tokenizer).__name__}")
        self._tokenizer: Tokenizer = backend
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in dict.fromkeys(stop) if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._hold_back = max((len(s) for s in self._stop), default=1) - 1

        # The decode window: ids[prefix_offset:read_offset] is already emitted
        # context, ids[read_offset:] is not decoded into the output yet.
        self._ids: list[int] = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

        self.output_token_ids: list[int] = []
        self._text = ""  # decoded output text, truncated at a stop string
        self._emitted = 0  # characters of _text already returned
        self.stop_reason: str | None = None
        self._closed = False

    @classmethod
    def from_params(
        cls,
        tokenizer: PreTrainedTokenizerBase | Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    # ------------------------------------------------------------------ state

    @property
    def output_text(self) -> str:
        """All output text decoded so far (cut at the stop string once one matched)."""
        return self._text

    @property
    def finished(self) -> bool:
        """True once a stop string matched; later tokens are ignored."""
        return self.stop_reason is not None

    # ---------------------------------------------------------------- updates

    def update(self, new_token_ids: Iterable[int]) -> str:
        """Add sampled tokens; return the text that is now final and safe to show."""
        if self.finished or self._closed:
            return ""
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self._ids.append(token_id)
            self._append_text(self._decode_step(final=False))
            if self.finished:
                break
        return self._release(hold_back=0 if self.finished else self._hold_back)

    def flush(self) -> str:
        """The request ends (eos, length, abort): release everything still held back.

        Incomplete trailing bytes decode as U+FFFD, as a plain decode would.
        """
        if self._closed:
            return ""
        self._closed = True
        if not self.finished and len(self._ids) > self._read_offset:
            self._append_text(self._decode_step(final=True))
        return self._release(hold_back=0)

    # -------------------------------------------------------------- internals

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The last few prompt tokens, shortened until their text ends on a whole character."""
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context.pop(0)
        return context

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def _decode_step(self, *, final: bool) -> str:
        """New text from the window, or "" while it ends in an incomplete character."""
        window_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (
            len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR)
        ):
            return ""
        # The window's text starts with the prefix's for byte-level BPE; for a decoder
        # that rewrites its left context this takes the tail, as vLLM does.
        delta = window_text[len(self._prefix_text) :]
        # Slide the window: what was just read becomes the next step's prefix.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return delta

    def _append_text(self, delta: str) -> None:
        if not delta:
            return
        checked_len = len(self._text)
        self._text += delta
        if self._stop and len(self.output_token_ids) > self._min_tokens:
            self._find_stop(checked_len)

    def _find_stop(self, checked_len: int) -> None:
        """Cut ``_text`` at the first stop string that completes after ``checked_len``."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            start = self._text.find(stop, max(0, checked_len - len(stop) + 1))
            if start != -1:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return
        end, start, stop = best
        self.stop_reason = stop
        self._text = self._text[: end if self._include_stop else start]

    def _release(self, *, hold_back: int) -> str:
        end = max(self._emitted, len(self._text) - hold_back)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta
