"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

from helpers.runner import make_runner, teacher_forced_logits
from rivulet.engine.tokenizer import load_tokenizer
from rivulet.models.loader import resolve_model
from rivulet.worker.batch import SeqChunk

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]
STEPS = 48
MARGIN = 1e-4


@pytest.fixture(scope="module")
def src():
    return resolve_model("default")


@pytest.fixture(scope="module")
def tokenizer(src):
    return load_tokenizer(src)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    raw = [tokenizer(p).input_ids for p in PROMPTS]
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            for p in PROMPTS]
    chat = [c["input_ids"] if isinstance(c, dict) or hasattr(c, "keys") else c for c in chat]
    return raw + chat


@pytest.fixture(scope="module")
def reference(src, prompts):
    """transformers' greedy continuations and per-step raw logits, all prompts in one left-padded batch (one
    generate of STEPS steps instead of one per prompt: the masked padding leaves each row's logits as alone)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src.path), gguf_file=src.gguf_file, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # compare all STEPS tokens: no stopping, no EOS masking
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    g = hf.generate(input_ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=0, repetition_penalty=None)
    logits = torch.stack(g.logits, dim=1).float()  # [prompts, steps, vocab]
    return [(g.sequences[i, width:].tolist(), logits[i]) for i in range(len(prompts))]


def _greedy(runner, ids: list[int], steps: int) -> list[int]:
    blocks = list(range(64))
    logits = runner.forward([SeqChunk(ids, 0, blocks)])
    toks: list[int] = []
    for _ in range(steps):
        toks.append(int(logits[0].argmax()))
        logits = runner.forward([SeqChunk([toks[-1]], len(ids) + len(toks) - 1, blocks)])
    return toks


def test_greedy_float32_matches_transformers(prompts, reference):
    runner = make_runner("default", "float32", num_blocks=64 * 1, block_size=16)
    for ids, (ref_toks, ref_logits) in zip(prompts, reference):
        ours = _greedy(runner, ids, STEPS)
        for step, (a, b) in enumerate(zip(ours, ref_toks)):
            if a != b:
                top2 = ref_logits[step].topk(2).values
                margin = (top2[0] - top2[1]).item()
                assert margin < MARGIN, f"prompt {ids[:8]}...: step {step} differs ({a} vs {b}) at margin {margin:.3g}"
                break  # after a near-tie the continuations legitimately diverge


def _agreement(runner, prompts, reference, one_token_steps: bool) -> tuple[float, float, int]:
    """(top-1 agreement, mean |dlogprob| of the reference token, steps), teacher-forced on the fp32
    continuations: the whole sequence in one prefill, or the prompt then one token per step (the
    decode path, where small-batch kernels such as int8 run)."""
    agree = total = 0
    dlp = []
    for ids, (ref_toks, ref_logits) in zip(prompts, reference):
        seq = ids + ref_toks
        if one_token_steps:
            logits = teacher_forced_logits(runner, seq[:-1], [len(ids)], list(range(64)))[len(ids) - 1:]
        else:
            logits = runner.forward([SeqChunk(seq, 0, list(range(64)))], all_logits=True)[len(ids) - 1 : -1]
        agree += int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        total += len(ref_toks)
        lp, ref_lp = logits.float().log_softmax(-1), ref_logits.log_softmax(-1)
        idx = torch.tensor(ref_toks)[:, None]
        dlp.append((lp.gather(1, idx) - ref_lp.gather(1, idx)).abs().flatten())
    return agree / total, torch.cat(dlp).mean().item(), total


def test_bfloat16_agrees_with_float32(prompts, reference, capsys):
    """bf16 next-token agreement and log-probability error, teacher-forced on the fp32 continuations."""
    runner = make_runner("default", "bfloat16", num_blocks=64, block_size=16)
    rate, mean_dlp, total = _agreement(runner, prompts, reference, one_token_steps=False)
    with capsys.disabled():
        print(f"\nbf16 vs fp32 on the default model: top-1 agreement {rate:.4f} over {total} steps, "
              f"mean |dlogprob| {mean_dlp:.4f}")
    # measured 0.973/0.025 (Zen 4, panel kernels) and 0.969/0.026 (Xeon, AMX tiles) over these 480 steps: the
    # floors leave ~9 steps of agreement and 1.6x the error for kernels that round bf16 differently
    assert rate >= 0.95 and mean_dlp < 0.04


# (method, activations, least top-1 agreement, largest mean |dlogprob|): measured 0.958/0.055, 0.956/0.044 and
# 0.965/0.038 on 480 steps; the int4 LM head (4-bit, requantized from the file's Q8_0) gave 0.894/0.154
@pytest.mark.parametrize("method,act,min_rate,max_dlp", [("int8", "bfloat16", 0.93, 0.08),
                                                         ("int4", "bfloat16", 0.94, 0.07),
                                                         ("int4", "float32", 0.95, 0.06)])
def test_quantized_decode_agrees_with_float32(method, act, min_rate, max_dlp, prompts, reference, capsys):
    """The weight-only int8/int4 paths (decode steps) against the fp32 reference. int4 holds the file's
    Q4_1 weights exactly, so its cost is the int8 activation blocks (llama.cpp's Q8_1: the same) and,
    with bf16 activations, the bf16 rounding of everything else (llama.cpp computes those in fp32)."""
    runner = make_runner("default", act, num_blocks=64, block_size=16, quantization=method)
    assert runner.model.lm_head.quant is not None  # the path under test is really taken
    rate, mean_dlp, total = _agreement(runner, prompts, reference, one_token_steps=True)
    with capsys.disabled():
        print(f"\n{method} ({act} activations) vs fp32 on the default model: top-1 agreement {rate:.4f} over "
              f"{total} decode steps, mean |dlogprob| {mean_dlp:.4f}")
    assert rate >= min_rate and mean_dlp < max_dlp
