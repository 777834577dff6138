"""N-gram (prompt lookup) proposer: the continuation of an earlier occurrence of the sequence's end.

For a sequence t[0..L), the longest n in [min_n, max_n] such that the last n tokens also occur
ending at some earlier position e < L-1 (the most recent such e among the longest matches)
proposes t[e+1 : e+1+k]. Edits, rewrites, extraction and code changes repeat their input, so the
drafts are often right; on free text they are mostly absent (no match) or rejected.

Each request's tokens are mirrored in a numpy buffer that grows with its outputs (kept beside the
request object, dropped with it). A lookup is a vectorized compare of the last token against the
buffer, then of the preceding tokens at the few candidate positions: O(L) numpy work, no Python
loop over the sequence.
"""

from __future__ import annotations

import weakref

import numpy as np

from rivulet.config import SpeculativeConfig
from rivulet.core.request import Request


class _Tokens:
    """A request's tokens as a growing int32 array (appended from `Request.all_token_ids`)."""

    def __init__(self) -> None:
        self.buf = np.empty(256, np.int32)
        self.n = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        if len(tokens) < self.n:  # never happens (tokens only grow); rebuild rather than trust it
            self.n = 0
        if len(tokens) > self.buf.size:
            grown = np.empty(max(len(tokens), 2 * self.buf.size), np.int32)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if len(tokens) > self.n:
            self.buf[self.n:len(tokens)] = tokens[self.n:]
            self.n = len(tokens)
        return self.buf[:self.n]


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k draft tokens after `tokens` (see the module docstring); empty when nothing matches."""
    length = tokens.shape[0]
    if length < min_n + 1 or k < 1:
        return tokens[:0]
    # candidate ends e < L-1 whose token equals the last one, then matched backwards one token at a time
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    matched = 1
    while ends.size and matched < max_n:
        ok = ends >= matched
        ok[ok] = tokens[ends[ok] - matched] == tokens[length - 1 - matched]
        if not ok.any():
            break
        ends = ends[ok]
        matched += 1
    if not ends.size or matched < min_n:
        return tokens[:0]
    start = int(ends[-1]) + 1  # the most recent of the longest matches
    return tokens[start:start + k]


class NgramProposer:
    """`proposer(request) -> draft token ids` for `EngineCore` (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self._tokens: weakref.WeakKeyDictionary[Request, _Tokens] = weakref.WeakKeyDictionary()

    def __call__(self, req: Request) -> list[int]:
        mirror = self._tokens.get(req)
        if mirror is None:
            mirror = self._tokens[req] = _Tokens()
        return propose_ngram(mirror.sync(req.all_token_ids), self.min_n, self.max_n, self.k).tolist()

    def __len__(self) -> int:
        """Requests with a token mirror alive (for tests of memory release)."""
        return len(self._tokens)
