"""Grammars of the engine's constrained requests: compiled in a thread, matched per request, one token
bitmask per step.

`submit` starts a request's grammar (checked and compiled in a worker thread, cached by grammar, so
the engine loop never waits for xgrammar); `take_ready` hands over the requests whose grammar is
ready, each with its own `GrammarMatcher` in `Request.grammar`, and the ones that failed (a bad
grammar, or longer than `timeout_s`) with their error. Each step `bitmask` gives the allowed tokens
of every logits row of the step (all ones for unconstrained rows) and `accept` advances a request's
matcher by the tokens it kept. A matcher reaches its end only through a stop token (EOS), which the
request always stops at. With `after_token_ids` (the end of a model's reasoning) the grammar starts
only once the output has produced them: until then the request samples freely.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any


from rivulet.config import RivuletError
from rivulet.core.outputs import SchedulerOutput
from rivulet.core.request import Request
from rivulet.sampling_params import StructuredOutputsParams
from rivulet.structured.grammar import check, compile_grammar

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept


class RequestGrammar:
    """A request's matcher, and whether it is on yet (it waits for `after` in the output)."""

    def __init__(self, matcher: Any, after: list[int] | None) -> None:
        self.matcher = matcher
        self.after = list(after or [])
        self.active = not self.after
        self._recent: list[int] = []

    @property
    def ended(self) -> bool:
        """The grammar took its end (a stop token): nothing may follow, min_tokens or not."""
        return self.active and self.matcher.is_terminated()

    def accept(self, token_id: int, request_id: str) -> None:
        if not self.active:
            self._recent = (self._recent + [token_id])[-len(self.after):]
            self.active = self._recent == self.after
            return
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            logger.error("request %s: token %d does not fit its grammar", request_id, token_id)


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, timeout_s: float = 60.0) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rivulet-grammar")
        self._compiler: Any = None  # built in the pool's thread on first use
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._waiting: dict[str, tuple[Request, Future, float]] = {}

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- compiling ----

    def _compile(self, params: StructuredOutputsParams) -> Any:
        check(params)
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return compile_grammar(self._compiler, params)

    def submit(self, req: Request) -> None:
        params = req.sampling_params.structured_outputs
        key = params.key
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._cache[key] = self._pool.submit(self._compile, params)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        self._waiting[req.request_id] = (req, fut, time.monotonic())

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._waiting.pop(rid, None)

    def take_ready(self, wait_s: float = 0.0) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose matcher is ready, (request, error) of those that failed); with `wait_s`,
        waits that long for a first grammar when nothing is ready yet (an otherwise idle engine)."""
        if wait_s > 0 and self._waiting:
            wait([f for _, f, _ in self._waiting.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        ready, failed = [], []
        now = time.monotonic()
        for rid, (req, fut, since) in list(self._waiting.items()):
            if not fut.done():
                if now - since > self.timeout_s:
                    del self._waiting[rid]
                    failed.append((req, f"structured output: the grammar did not compile within {self.timeout_s:.0f} s"))
                continue
            del self._waiting[rid]
            err = fut.exception()
            if err is not None:
                msg = str(err) if isinstance(err, RivuletError) else f"structured output: {type(err).__name__}: {err}"
                failed.append((req, msg))
                continue
            import xgrammar as xgr

            req.grammar = RequestGrammar(xgr.GrammarMatcher(fut.result()),
                                         req.sampling_params.structured_outputs.after_token_ids)
            ready.append(req)
        return ready, failed

    # ---- each step ----

    @staticmethod
    def constrained(out: SchedulerOutput, requests: dict[str, Request]) -> bool:
        """Whether a request that samples this step has a grammar (so the step needs a bitmask)."""
        for rid in out.sampling_request_ids:
            req = requests.get(rid)
            if req is not None and req.grammar is not None:
                return True
        return False

    def bitmask(self, out: SchedulerOutput, requests: dict[str, Request]) -> bytes | None:
        """int32 [logits rows, ceil(vocab / 32)] as bytes, rows in the runner's order (each sampling
        request, 1 + its drafts rows); None when no row is constrained.

        A request's draft rows hold the masks after its drafts: the matcher takes the drafts one by one
        (then rolls them back). Rows after a draft the grammar refuses stay all ones: the row before it
        disallows that draft, so verification never reaches them."""
        rows: list[tuple[Any, list[int]]] = []
        for rid in out.num_scheduled_tokens:
            if rid in out.sampling_request_ids:
                req = requests.get(rid)
                grammar = req.grammar if req is not None else None
                matcher = grammar.matcher if grammar is not None and grammar.active else None
                rows.append((matcher, out.scheduled_spec_tokens.get(rid, [])))
        if not any(m is not None for m, _ in rows):
            return None
        import torch
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(sum(1 + len(d) for _, d in rows), self.vocab_size)  # all allowed
        i = 0
        for matcher, drafts in rows:
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(mask, i)
                taken = 0
                for d in drafts:
                    if matcher.is_terminated() or not matcher.accept_token(d):
                        break
                    taken += 1
                    if not matcher.is_terminated():
                        matcher.fill_next_token_bitmask(mask, i + taken)
                if taken:
                    matcher.rollback(taken)
            i += 1 + len(drafts)
        assert mask.dtype == torch.int32
        return mask.numpy().tobytes()

    @staticmethod
    def accept(req: Request, token_ids: list[int]) -> None:
        """Advance `req`'s matcher by the tokens it kept this step (a token the mask allowed)."""
        for t in token_ids:
            req.grammar.accept(t, req.request_id)
