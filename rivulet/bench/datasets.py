"""Benchmark prompts with exact token counts.

Random prompts are drawn as token ids (special tokens excluded), decoded to text, re-encoded and adjusted
(truncated or topped up with more random ids) until the text encodes to exactly the wanted number of
tokens, counted the way the server counts them (`tokenizer(text).input_ids`). With `prompt_format="ids"`
the ids themselves are the prompt: both Rivulet and llama.cpp's server accept a list of token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rivulet.config import RivuletError

PromptFormat = Literal["text", "ids"]
DATASETS: tuple[str, ...] = ("random", "shared-prefix", "copy", "jsonl")
_MAX_TRIES = 32


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    model: str | None = None  # the model (or LoRA adapter) it names; None: the run's --model


def load_bench_tokenizer(spec: str) -> Any:
    """The tokenizer of a model as Rivulet loads it: 'default', a HF folder (with or without weights), or a
    .gguf file (converted from its metadata and cached, see `rivulet.engine.tokenizer`)."""
    from rivulet.engine.tokenizer import load_tokenizer
    from rivulet.models.loader.source import ModelSource, resolve_model

    path = Path(spec).expanduser()
    if spec not in ("", "default") and path.is_dir() and not (path / "config.json").is_file() \
            and not any(path.glob("*.gguf")):
        tok = load_tokenizer(ModelSource(path), str(path))  # a tokenizer-only folder
    else:
        try:
            src = resolve_model(spec)
        except RivuletError as e:
            raise RivuletError(f"cannot find a tokenizer for {spec!r} ({e}); pass --tokenizer PATH") from None
        tok = load_tokenizer(src)
    if tok is None:
        raise RivuletError(f"{spec} has no tokenizer files; pass --tokenizer PATH")
    return tok


def count_tokens(tokenizer: Any, text: str) -> int:
    """Prompt tokens as the server counts them (special tokens such as BOS included when the model adds them)."""
    return len(tokenizer(text).input_ids)


class PromptMaker:
    """Random prompts of exact token length for one tokenizer."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tok = tokenizer
        self.rng = np.random.default_rng(seed)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        ids = [i for i in range(len(tokenizer)) if i not in special and i not in added]
        # tokens that are text on their own: a lone byte of a multi-byte character decodes to U+FFFD, which
        # re-encodes to other tokens, so the length would never settle
        pieces = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False)
        self.candidates = np.array([i for i, s in zip(ids, pieces) if s.strip() and "\ufffd" not in s],
                                   dtype=np.int64)
        if self.candidates.size == 0:
            raise RivuletError("the tokenizer has no ordinary tokens to build prompts from")
        self._n_special = count_tokens(tokenizer, "")  # e.g. 1 when the tokenizer adds a BOS

    def random_ids(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.choice(self.candidates, size=max(n, 0))]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def text(self, n: int, prefix_ids: list[int] | None = None) -> str:
        """A text that encodes to exactly n tokens (as `count_tokens` counts), starting with `prefix_ids`
        decoded (the last prefix token may merge with what follows)."""
        body = n - self._n_special
        if body < 1:
            raise RivuletError(f"cannot build a prompt of {n} tokens (the tokenizer adds {self._n_special})")
        prefix = list(prefix_ids or [])[:body]
        ids = prefix + self.random_ids(body - len(prefix))
        for _ in range(_MAX_TRIES):
            text = self._decode(ids)
            if count_tokens(self.tok, text) == n:
                return text
            enc = self._encode(text)
            keep = max(min(len(enc), body) - (1 if len(enc) < body else 0), 0)  # drop a possibly merged tail
            ids = enc[:keep] + self.random_ids(body - keep)
        raise RivuletError(f"could not build a text prompt of exactly {n} tokens; use --prompt-format ids")


def _lengths(rng: np.random.Generator, mean: int, ratio: float, count: int) -> list[int]:
    """Uniform integers in [mean*(1-ratio), mean*(1+ratio)] (vLLM's --random-range-ratio), at least 1."""
    lo, hi = max(int(mean * (1 - ratio)), 1), max(int(mean * (1 + ratio)), 1)
    return [int(x) for x in rng.integers(lo, hi + 1, size=count)]


def random_requests(tokenizer: Any, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prompt_format: PromptFormat = "text", seed: int = 0) -> list[SampleRequest]:
    maker = PromptMaker(tokenizer, seed)
    ins = _lengths(maker.rng, input_len, range_ratio, num)
    outs = _lengths(maker.rng, output_len, range_ratio, num)
    reqs = []
    for n_in, n_out in zip(ins, outs):
        prompt: str | list[int] = maker.random_ids(n_in) if prompt_format == "ids" else maker.text(n_in)
        reqs.append(SampleRequest(prompt, n_in, n_out))
    return reqs


def shared_prefix_requests(tokenizer: Any, num: int, input_len: int, output_len: int, prefix_len: int | None = None,
                           range_ratio: float = 0.0, prompt_format: PromptFormat = "text",
                           seed: int = 0, num_prefixes: int = 1) -> list[SampleRequest]:
    """Prompts that start with one of `num_prefixes` prefixes of `prefix_len` tokens (default: half of
    input_len), then differ. Each request takes a prefix at random (seeded), so no round-robin order lines
    up with the groups (sglang's generated-shared-prefix groups: what a cache-aware router keeps apart)."""
    maker = PromptMaker(tokenizer, seed)
    plen = input_len // 2 if prefix_len is None else prefix_len
    if not 0 <= plen < input_len:
        raise RivuletError(f"--prefix-len must be in [0, --input-len): got {plen} for {input_len}")
    if num_prefixes < 1:
        raise RivuletError(f"--num-prefixes must be >= 1: got {num_prefixes}")
    prefixes = []
    for _ in range(num_prefixes):
        prefix = maker.random_ids(plen)
        if prompt_format == "text" and plen:
            prefix = maker._encode(maker.text(plen + maker._n_special))  # a prefix that re-encodes to itself
        prefixes.append(prefix)
    suffix_lens = _lengths(maker.rng, input_len - plen, range_ratio, num)
    outs = _lengths(maker.rng, output_len, range_ratio, num)
    groups = maker.rng.integers(num_prefixes, size=num) if num_prefixes > 1 else [0] * num
    reqs = []
    for g, n_suf, n_out in zip(groups, suffix_lens, outs):
        prefix = prefixes[int(g)]
        n_in = plen + n_suf
        prompt: str | list[int] = prefix + maker.random_ids(n_suf) if prompt_format == "ids" else \
            maker.text(n_in, prefix)
        reqs.append(SampleRequest(prompt, n_in, n_out))
    return reqs


_WORDS = ("total", "count", "price", "weight", "index", "label", "score", "limit", "value", "order", "item",
          "width", "height", "offset", "ratio", "name", "user", "group", "result", "buffer", "window", "token")
_EDITS = ("Repeat the following code exactly, without any change:",
          "Rename the variable `{a}` to `{b}` in the following code and return the whole code:",
          "Add a one-line docstring to every function in the following code and return the whole code:",
          "Fix the indentation of the following code if needed and return the whole code:")


def _code(rng: np.random.Generator) -> str:
    """One small Python function with random names (a passage for the copy dataset)."""
    w = [str(x) for x in rng.choice(_WORDS, size=4, replace=False)]
    op = str(rng.choice(["+", "-", "*"]))
    return (f"def {w[0]}_{w[1]}({w[2]}, {w[3]}):\n"
            f"    {w[1]} = {w[2]} {op} {w[3]}\n"
            f"    if {w[1]} > {int(rng.integers(2, 100))}:\n"
            f"        return {w[1]} // {int(rng.integers(2, 9))}\n"
            f"    return {w[1]}\n\n")


def copy_requests(tokenizer: Any, num: int, input_len: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """Edit tasks whose answer repeats the input (the case prompt-lookup speculation is for): an
    instruction (repeat, rename a variable, add docstrings, fix indentation) over generated Python
    functions, about `input_len` tokens in all (whole functions: the length is approximate). Text
    prompts; send them with `--endpoint chat` to an instruction-tuned model."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(num):
        a, b = (str(x) for x in rng.choice(_WORDS, size=2, replace=False))
        head = str(rng.choice(_EDITS)).format(a=a, b=b) + "\n\n"
        body = ""
        while not body or count_tokens(tokenizer, head + body) < input_len:
            body += _code(rng)
        text = head + body.rstrip() + "\n"
        reqs.append(SampleRequest(text, count_tokens(tokenizer, text), output_len))
    return reqs


def jsonl_requests(tokenizer: Any, path: str, num: int, output_len: int,
                   prompt_format: PromptFormat = "text") -> list[SampleRequest]:
    """Lines of a JSONL file: a string, or {"prompt": str, "output_len"?: int}; cycled to `num` requests."""
    items: list[tuple[str, int]] = []
    try:
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if isinstance(obj, str):
                    items.append((obj, output_len))
                elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                    items.append((obj["prompt"], int(obj.get("output_len", output_len))))
                else:
                    raise ValueError(f"line {lineno}: expected a string or {{'prompt': str}}")
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise RivuletError(f"cannot read --dataset-path {path}: {e}") from None
    if not items:
        raise RivuletError(f"--dataset-path {path} holds no prompts")
    reqs = []
    for i in range(num):
        text, n_out = items[i % len(items)]
        ids = list(tokenizer(text).input_ids)
        reqs.append(SampleRequest(ids if prompt_format == "ids" else text, len(ids), n_out))
    return reqs


def make_requests(dataset: str, tokenizer: Any, num: int, input_len: int, output_len: int, *,
                  range_ratio: float = 0.0, prompt_format: PromptFormat = "text", prefix_len: int | None = None,
                  dataset_path: str | None = None, seed: int = 0, num_prefixes: int = 1) -> list[SampleRequest]:
    if num < 1 or input_len < 1 or output_len < 1:
        raise RivuletError("--num-prompts, --input-len and --output-len must be >= 1")
    if not 0 <= range_ratio < 1:
        raise RivuletError(f"--range-ratio must be in [0, 1): got {range_ratio}")
    if dataset != "shared-prefix" and (prefix_len is not None or num_prefixes != 1):
        raise RivuletError("--prefix-len and --num-prefixes are for --dataset shared-prefix")
    if dataset != "jsonl" and dataset_path:
        raise RivuletError("--dataset-path is for --dataset jsonl")
    if dataset == "random":
        return random_requests(tokenizer, num, input_len, output_len, range_ratio, prompt_format, seed)
    if dataset == "shared-prefix":
        return shared_prefix_requests(tokenizer, num, input_len, output_len, prefix_len, range_ratio,
                                      prompt_format, seed, num_prefixes)
    if dataset == "copy":
        if prompt_format != "text":
            raise RivuletError("--dataset copy builds text prompts (--prompt-format text)")
        return copy_requests(tokenizer, num, input_len, output_len, seed)
    if dataset == "jsonl":
        if not dataset_path:
            raise RivuletError("--dataset jsonl needs --dataset-path FILE")
        return jsonl_requests(tokenizer, dataset_path, num, output_len, prompt_format)
    raise RivuletError(f"unknown dataset {dataset!r} (choose from {', '.join(DATASETS)})")
