"""Streaming text filters for a pipeline's output: fed the text of one choice chunk by chunk, they return what
may be sent now and hold back any tail that could still become a match, so that a pattern split across chunks
is caught as surely as in one piece (the `regex` package's partial matches tell how much to hold)."""

from __future__ import annotations

from typing import Protocol

import regex


class TextFilter(Protocol):
    """One choice's output filter: `feed` each chunk, `finish` at the end; `stopped` once it ended the choice."""

    stopped: bool

    def feed(self, text: str) -> str: ...

    def finish(self) -> str: ...


def compile_patterns(patterns: list[str], where: str) -> regex.Pattern:
    """One alternation of `patterns`; ValueError for a bad one or one that matches the empty string."""
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"{where}: 'patterns' must be a non-empty list of regular expressions")
    for p in patterns:
        try:
            rx = regex.compile(p)
        except regex.error as e:
            raise ValueError(f"{where}: bad pattern {p!r}: {e}") from None
        if rx.fullmatch(""):
            raise ValueError(f"{where}: the pattern {p!r} matches the empty string")
    return regex.compile("|".join(f"(?:{p})" for p in patterns))


class _Scanner:
    """Finds matches in a stream; a match that reaches the end of what arrived may still grow, so the text from
    its start waits for more."""

    def __init__(self, rx: regex.Pattern) -> None:
        self.rx = rx
        self.buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buf += text
        return self._scan(final=False)

    def finish(self) -> str:
        return "" if self.stopped else self._scan(final=True)

    def _scan(self, final: bool) -> str:
        out, pos, buf = [], 0, self.buf
        hold = len(buf)
        for m in self.rx.finditer(buf, partial=not final):
            if not final and (m.partial or m.end() == len(buf)):
                hold = m.start()
                break
            out.append(buf[pos:m.start()])
            pos = m.end()
            replaced = self.on_match(m.group())
            if replaced is None:  # the choice ends here
                self.stopped, self.buf = True, ""
                return "".join(out)
            out.append(replaced)
        out.append(buf[pos:hold])
        self.buf = buf[hold:]
        return "".join(out)

    def on_match(self, text: str) -> str | None:
        raise NotImplementedError


class Redactor(_Scanner):
    """Every match replaced by `replacement`."""

    def __init__(self, rx: regex.Pattern, replacement: str) -> None:
        super().__init__(rx)
        self.replacement = replacement

    def on_match(self, text: str) -> str | None:
        return self.replacement


class Blocker(_Scanner):
    """The choice ends before the first match (followed by `message`, when one is given)."""

    def __init__(self, rx: regex.Pattern, message: str | None) -> None:
        super().__init__(rx)
        self.message = message
        self._tail = ""

    def on_match(self, text: str) -> str | None:
        self._tail = self.message or ""
        return None

    def feed(self, text: str) -> str:
        return self._with_tail(super().feed(text))

    def finish(self) -> str:
        return self._with_tail(super().finish())

    def _with_tail(self, out: str) -> str:
        out, self._tail = out + self._tail, ""
        return out


class Chain:
    """Filters applied in order, each to the previous one's output; stopped once any of them stopped."""

    def __init__(self, filters: list[TextFilter]) -> None:
        self.filters = filters

    @property
    def stopped(self) -> bool:
        return any(f.stopped for f in self.filters)

    def feed(self, text: str) -> str:
        for f in self.filters:
            text = f.feed(text)
        return text

    def finish(self) -> str:
        out = ""
        for i, f in enumerate(self.filters):
            out = f.feed(out) + f.finish() if i else f.finish()
        return out

    def apply(self, text: str) -> str:
        """A whole text at once."""
        return self.feed(text) + self.finish()
