"""Prompts have exactly the requested number of tokens, as the server counts them."""

from __future__ import annotations

import json

import pytest

from rivulet.bench.datasets import count_tokens, load_bench_tokenizer, make_requests
from rivulet.config import RivuletError


@pytest.mark.parametrize("n", [1, 2, 7, 64, 300])
def test_random_text_prompts_are_exact_with_the_default_tokenizer(default_tokenizer, n):
    reqs = make_requests("random", default_tokenizer, 12, n, 5, seed=n)
    assert len(reqs) == 12
    for r in reqs:
        assert isinstance(r.prompt, str) and r.prompt_len == n and r.output_len == 5
        assert count_tokens(default_tokenizer, r.prompt) == n
    assert len({r.prompt for r in reqs}) == 12  # different prompts


def test_range_ratio_and_ids_format(default_tokenizer):
    reqs = make_requests("random", default_tokenizer, 40, 100, 20, range_ratio=0.5, prompt_format="ids")
    lens = [r.prompt_len for r in reqs]
    assert all(50 <= n <= 150 for n in lens) and len(set(lens)) > 5
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(10 <= r.output_len <= 30 for r in reqs)
    special = set(default_tokenizer.all_special_ids)
    assert not any(t in special for r in reqs for t in r.prompt)
    texts = make_requests("random", default_tokenizer, 20, 100, 20, range_ratio=0.5)
    assert all(count_tokens(default_tokenizer, r.prompt) == r.prompt_len for r in texts)


def test_shared_prefix_prompts_share_their_start(default_tokenizer):
    reqs = make_requests("shared-prefix", default_tokenizer, 8, 64, 4, prefix_len=40)
    encoded = [default_tokenizer(r.prompt).input_ids for r in reqs]
    assert all(len(e) == 64 for e in encoded)
    assert all(e[:39] == encoded[0][:39] for e in encoded)  # the last prefix token may merge with the suffix
    assert len({tuple(e) for e in encoded}) == 8
    ids = make_requests("shared-prefix", default_tokenizer, 4, 32, 4, prompt_format="ids")
    assert all(r.prompt[:16] == ids[0].prompt[:16] and len(r.prompt) == 32 for r in ids)
    with pytest.raises(RivuletError, match="--prefix-len"):
        make_requests("shared-prefix", default_tokenizer, 4, 32, 4, prefix_len=32)
    groups = make_requests("shared-prefix", default_tokenizer, 24, 64, 4, prefix_len=40, num_prefixes=3)
    encoded = [default_tokenizer(r.prompt).input_ids for r in groups]
    assert all(len(e) == 64 for e in encoded) and len({tuple(e) for e in encoded}) == 24
    heads = [tuple(e[:39]) for e in encoded]
    assert len(set(heads)) == 3 and heads[::2] != heads[1::2]  # 3 prefixes, not in a fixed rotation
    with pytest.raises(RivuletError, match="--num-prefixes"):
        make_requests("shared-prefix", default_tokenizer, 4, 32, 4, num_prefixes=0)
    for other in ("random", "copy"):  # ignored there once, silently
        with pytest.raises(RivuletError, match="are for --dataset shared-prefix"):
            make_requests(other, default_tokenizer, 4, 32, 4, prefix_len=8)
        with pytest.raises(RivuletError, match="are for --dataset shared-prefix"):
            make_requests(other, default_tokenizer, 4, 32, 4, num_prefixes=2)
    with pytest.raises(RivuletError, match="--dataset-path is for --dataset jsonl"):
        make_requests("random", default_tokenizer, 4, 32, 4, dataset_path="p.jsonl")


def test_jsonl_dataset_counts_tokens_and_cycles(default_tokenizer, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps("Hello there") + "\n\n" + json.dumps({"prompt": "The capital of France is",
                                                                 "output_len": 3}) + "\n")
    reqs = make_requests("jsonl", default_tokenizer, 5, 1, 9, dataset_path=str(f))
    assert [r.output_len for r in reqs] == [9, 3, 9, 3, 9]
    assert reqs[1].prompt_len == count_tokens(default_tokenizer, "The capital of France is")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(RivuletError, match="cannot read --dataset-path"):
        make_requests("jsonl", default_tokenizer, 2, 1, 9, dataset_path=str(bad))
    with pytest.raises(RivuletError, match="--dataset-path"):
        make_requests("jsonl", default_tokenizer, 2, 1, 9)


@pytest.mark.parametrize("n", [2, 5, 33, 128])
def test_exact_lengths_with_a_tiny_hf_tokenizer(tiny_tokenizer_dir, n):
    tok = load_bench_tokenizer(str(tiny_tokenizer_dir))
    assert len(tok) < 400
    for r in make_requests("random", tok, 10, n, 4, seed=n):
        assert count_tokens(tok, r.prompt) == n == r.prompt_len
    for r in make_requests("shared-prefix", tok, 4, n, 4, seed=n):
        assert count_tokens(tok, r.prompt) == n


def test_unknown_tokenizer_is_one_line(tmp_path):
    with pytest.raises(RivuletError, match="pass --tokenizer"):
        load_bench_tokenizer("served-name-that-is-not-a-path")


def test_copy_dataset_asks_to_repeat_code_of_about_the_length(default_tokenizer):
    import argparse

    from rivulet.bench.cli import _serve_parser
    from rivulet.bench.datasets import DATASETS

    reqs = make_requests("copy", default_tokenizer, 6, 300, 50, seed=1)
    assert len({r.prompt for r in reqs}) == 6 and all(r.output_len == 50 for r in reqs)
    for r in reqs:
        assert r.prompt_len == count_tokens(default_tokenizer, r.prompt)
        assert 300 <= r.prompt_len < 300 + 80  # whole functions: a little over
        assert "return the whole code" in r.prompt or "exactly" in r.prompt
        assert r.prompt.count("def ") >= 3
    with pytest.raises(RivuletError, match="text prompts"):
        make_requests("copy", default_tokenizer, 2, 100, 5, prompt_format="ids")
    p = argparse.ArgumentParser()
    _serve_parser(p)
    assert next(a for a in p._actions if a.dest == "dataset").choices == list(DATASETS)
