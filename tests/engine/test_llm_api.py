"""The offline API on the default model: samples, seeds, stops, logprobs, validation."""

from __future__ import annotations

import math

import pytest
import torch

from rivulet import LLM, RivuletError, SamplingParams

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. The story should be "
          "set on a stormy night and end with a surprise.")  # > 2 KV blocks


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, seed=0)


def _text(llm, prompt=PROMPT, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_max_tokens_and_finish_reason(llm):
    out = _text(llm, temperature=0, max_tokens=7, ignore_eos=True)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_n_samples_share_the_prompt_blocks(llm):
    kv = llm.engine.core.kv_cache_manager
    hits0 = kv.stats.hits
    res = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12), use_tqdm=False)[0]
    assert [o.index for o in res.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in res.outputs}) > 1  # different samples
    assert kv.stats.hits > hits0  # samples 1 and 2 reused sample 0's prompt blocks
    again = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12), use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in res.outputs]


def test_seeded_sample_is_the_same_alone_and_in_a_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = _text(llm, temperature=1.0, top_p=0.9, seed=1234, max_tokens=16).token_ids
    others = ["Tell me about rivers.", "1, 2, 3, 4,", "The weather today"]
    outs = llm.generate(others[:2] + [PROMPT] + others[2:], [SamplingParams(temperature=1.0, max_tokens=20)] * 2
                        + [sp] + [SamplingParams(temperature=0.5, seed=9, max_tokens=8)], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone


def test_stop_string_across_tokens(llm):
    full = _text(llm, temperature=0, max_tokens=40, ignore_eos=True)
    text = full.text
    # a stop string starting inside a token and ending inside a later one
    stop = text[15:24]
    assert stop and text.index(stop) == 15
    cut = _text(llm, temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    assert cut.text == text[:15] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = _text(llm, temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[:24]


def test_stop_token_ids(llm):
    full = _text(llm, temperature=0, max_tokens=20, ignore_eos=True)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = _text(llm, temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == llm.get_tokenizer().decode(full.token_ids[:first], skip_special_tokens=True)


def test_logprobs_are_the_model_distribution(llm):
    out = _text(llm, temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    assert len(out.logprobs) == 6
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert pos[tok].rank == 1  # greedy picks the most likely token
        ranked = sorted(pos.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked][:3] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        assert sum(math.exp(lp.logprob) for lp in pos.values()) <= 1.0 + 1e-5
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))
    # the first logprob equals log_softmax of the model's next-token logits
    ids = llm.get_tokenizer()(PROMPT).input_ids
    from rivulet.worker.batch import SeqChunk

    runner = llm.engine.core.executor.runner
    ref = runner.forward([SeqChunk(ids, 0, list(range(runner.kv_caches[0].shape[1] - 8, runner.kv_caches[0].shape[1])))])
    ref_lp = torch.log_softmax(ref[0], -1)
    assert out.logprobs[0][out.token_ids[0]].logprob == pytest.approx(ref_lp.max().item(), abs=1e-4)


def test_cache_salt_keeps_tenants_apart(llm):
    prompt = "In the tenant's own words: " + PROMPT  # shares no leading block with other tests' prompts
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(salt):
        p = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        return llm.generate(p, sp, use_tqdm=False)[0]

    first = run("tenant-a")
    assert first.num_cached_tokens == 0
    same = run("tenant-a")
    assert same.num_cached_tokens >= 32 and same.outputs[0].token_ids == first.outputs[0].token_ids
    other, unsalted = run("tenant-b"), run(None)  # cached, but under another salt: computed again
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert other.outputs[0].token_ids == unsalted.outputs[0].token_ids == first.outputs[0].token_ids


def test_prompt_logprobs_survive_chunking_and_bypass_the_prefix_cache(llm):
    prompt = " ".join([PROMPT] * 8)  # several full blocks: the prefix cache can hold them
    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)  # cache the prompt's blocks
    stats = llm.engine.core.kv_cache_manager.stats
    hits = stats.hits
    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    assert stats.hits > hits  # a plain request now starts from cached blocks
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    whole = llm.generate(prompt, sp, use_tqdm=False)[0]  # ... this one must compute every position
    ids = whole.prompt_token_ids
    assert len(whole.prompt_logprobs) == len(ids) and whole.prompt_logprobs[0] is None
    assert all(ids[i] in whole.prompt_logprobs[i] for i in range(1, len(ids)))
    chunked = LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=5)
    parts = chunked.generate(prompt, sp, use_tqdm=False)[0].prompt_logprobs
    assert len(parts) == len(ids)
    for i in range(1, len(ids)):
        assert parts[i][ids[i]].logprob == pytest.approx(whole.prompt_logprobs[i][ids[i]].logprob, abs=1e-4)
        assert parts[i][ids[i]].rank == whole.prompt_logprobs[i][ids[i]].rank


@pytest.mark.parametrize("make_bad, message", [
    (lambda llm: SamplingParams(temperature=-1), "temperature must be a finite number >= 0, got -1"),
    (lambda llm: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (lambda llm: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (lambda llm: SamplingParams(n=0), "n must be an integer >= 1, got 0"),
    (lambda llm: llm.generate("x " * 1100, SamplingParams(max_tokens=4), use_tqdm=False),
     r"maximum context length is 1024 tokens; the request needs 1105 \(1101 in the prompt, 4 for the completion\)"),
    (lambda llm: llm.generate("", use_tqdm=False), "the prompt is empty"),
    (lambda llm: llm.generate({"prompt_token_ids": [1, 2, 10**6]}, use_tqdm=False),
     r"token id 1000000 is outside the vocabulary \(size 49152\)"),
    (lambda llm: llm.generate({"prompt_token_ids": [-1, 2]}, use_tqdm=False),
     r"token id -1 is outside the vocabulary \(size 49152\)"),
    (lambda llm: llm.generate(PROMPT, SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False),
     r"logit_bias token id 10000000 is outside the vocabulary \[0, 49152\)"),
    (lambda llm: llm.generate({"prompt": PROMPT, "cache_salt": ""}, use_tqdm=False),
     "cache_salt must be a non-empty string, not ''"),
    (lambda llm: llm.generate({"prompt": PROMPT, "salt": "x"}, use_tqdm=False),
     "unknown prompt field 'salt'; a prompt dict has cache_salt, prompt, prompt_token_ids"),
], ids=["neg-temp", "top_p-0", "top_p-1.5", "n-0", "too-long", "empty", "oov", "negative-id", "bias-oov",
        "empty-salt", "unknown-field"])
def test_bad_input_is_a_clear_value_error_and_engine_survives(llm, make_bad, message):
    with pytest.raises(RivuletError, match=message):  # RivuletError is a ValueError
        make_bad(llm)
    assert not llm.engine.has_unfinished_requests()
    assert _text(llm, temperature=0, max_tokens=3, ignore_eos=True).finish_reason == "length"


def test_too_long_prompt_mentions_the_context(llm):
    with pytest.raises(RivuletError, match="maximum context length is 1024"):
        llm.generate("x " * 1100, use_tqdm=False)


def test_abort_frees_blocks(llm):
    eng = llm.engine
    kv = eng.core.kv_cache_manager
    rid = eng.add_request(None, PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert kv.usage > 0
    eng.abort_request(rid)
    eng.step()
    assert kv.usage == 0 and not eng.has_unfinished_requests()


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=8),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>system")
    assert tok.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert out.outputs[0].text
    same = llm.generate({"prompt_token_ids": out.prompt_token_ids}, SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0]  # chat is generate on the rendered prompt, nothing more
    assert out.outputs[0].text == same.outputs[0].text


def test_seeded_tokens_depend_on_seed_and_position_only(llm):
    """A seeded request resumed as prompt + its first k tokens (what the router does when a worker dies) goes on
    with the same tokens: each draw is seeded by (seed, position), not by how many draws came before."""
    sp = dict(temperature=1.0, seed=77, max_tokens=12, ignore_eos=True)
    full = _text(llm, **sp).token_ids
    ids = llm.engine.tokenizer(PROMPT).input_ids
    for k in (1, 5):
        rest = llm.generate({"prompt_token_ids": ids + full[:k]}, SamplingParams(**{**sp, "max_tokens": 12 - k}),
                            use_tqdm=False)[0].outputs[0].token_ids
        assert full[:k] + rest == full
    assert _text(llm, **{**sp, "seed": 78}).token_ids != full


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    """vLLM's left cut: the last N tokens of the prompt (-1: as many as the context holds)."""
    long = " ".join(f"w{i}" for i in range(700))  # > 1024 tokens
    full = llm.get_tokenizer()(long).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate(long, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, truncate_prompt_tokens=50),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == full[-50:]
    alone = llm.generate({"prompt_token_ids": full[-50:]}, greedy, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids  # the same prompt to the model
    with pytest.raises(ValueError, match="maximum context"):
        llm.generate(long, greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context"):  # -1: the whole context, no room for an output
        llm.generate(long, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=0)
