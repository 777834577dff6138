"""Bytes the collectives move per token in each parallel mode: measured (counted inside
`rivulet.distributed`'s collectives) against the formula, as a Markdown table.

    .venv/bin/python benchmarks/comm_table.py              # tiny random models (seconds)
    .venv/bin/python benchmarks/comm_table.py --default    # also the default model (minutes)

Workload: 3 prompts (5, 23, 40 tokens) + 8 greedy tokens each, float32 (b = 4 bytes), so
T = 68 + 3 x 7 = 89 tokens computed and S = 24 rows sampled. Per token = over T, averaged over ranks.
payload = the tensor the op is about; wire = what a rank sends under ring algorithms
(all-reduce 2(n-1)/n x payload, reduce-scatter and all-gather (n-1)/n x payload).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from rivulet import LLM, SamplingParams  # noqa: E402

LENS, MAX_TOKENS = (5, 23, 40), 8
STEPS = [sum(LENS)] + [len(LENS)] * (MAX_TOKENS - 1)
T, S = sum(STEPS), len(LENS) * MAX_TOKENS


def pad(t: int, n: int) -> int:
    return -(-t // n) * n


def run(model: str, kw: dict, prompts) -> tuple[dict, list, list[list[int]]]:
    llm = LLM(model, dtype="float32", max_model_len=256, **kw)
    try:
        ex = llm.engine.core.executor
        ex.collect("reset")
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        comm, experts = ex.collect("comm"), ex.collect("experts")[0]
    finally:
        llm.shutdown()
    kinds = sorted(set().union(*comm))
    ranks = len(comm)
    avg = {k: {f: sum(c.get(k, {}).get(f, 0) for c in comm) / ranks for f in ("payload_bytes", "wire_bytes")}
           for k in kinds}
    return avg, experts, [o.outputs[0].token_ids for o in outs]


def formulas(mode: str, n: int, h: int, layers: int, moe_layers: int, vocab: int, k: int, cross: int, b: int = 4):
    """Expected (payload, wire) bytes per rank over the run, per op kind."""
    tpad = sum(pad(t, n) for t in STEPS)
    logits = S * pad(vocab, n) * b  # the LM head all-gathers the sampled rows' vocabulary shards
    f: dict[str, tuple[float, float]] = {}
    if mode == "tp":
        f["all_reduce"] = ((1 + 2 * layers) * T * h * b, 2 * (n - 1) / n * (1 + 2 * layers) * T * h * b)
        f["all_gather"] = (logits, (n - 1) / n * logits)
    elif mode == "tp+sp":
        f["reduce_scatter"] = ((1 + 2 * layers) * tpad * h * b, (n - 1) / n * (1 + 2 * layers) * tpad * h * b)
        f["all_gather"] = ((2 * layers + 1) * tpad * h * b + logits,
                           (n - 1) / n * ((2 * layers + 1) * tpad * h * b + logits))
    elif mode == "pp":  # one boundary: hidden + residual of every token; half the ranks send, half receive
        f["send"] = (2 * T * h * b / n, 2 * T * h * b / n)
        f["recv"] = (2 * T * h * b / n, 0)
    elif mode == "tp+ep":  # attention all-reduces stay; each MoE layer: 2 all-to-alls + an all-gather of shards
        dense = layers - moe_layers
        f["all_reduce"] = ((1 + layers + dense) * T * h * b, 2 * (n - 1) / n * (1 + layers + dense) * T * h * b)
        f["all_to_all"] = (2 * cross * h * b / n, 2 * cross * h * b / n)
        ag = moe_layers * tpad * h * b + logits
        f["all_gather"] = (ag, (n - 1) / n * ag)
    return f


def table(rows: list[tuple[str, str, dict, dict]]) -> str:
    out = ["| model | mode | op | measured payload B/token | formula | measured wire B/token | formula |",
           "|---|---|---|---:|---:|---:|---:|"]
    for model, mode, measured, expected in rows:
        tot = [0.0, 0.0, 0.0, 0.0]
        for op in sorted(set(measured) | set(expected)):
            m = measured.get(op, {"payload_bytes": 0, "wire_bytes": 0})
            e = expected.get(op, (0, 0))
            vals = [m["payload_bytes"] / T, e[0] / T, m["wire_bytes"] / T, e[1] / T]
            tot = [a + v for a, v in zip(tot, vals)]
            out.append(f"| {model} | {mode} | {op} | " + " | ".join(f"{v:,.0f}" for v in vals) + " |")
        out.append(f"| {model} | {mode} | **total** | " + " | ".join(f"**{v:,.0f}**" for v in tot) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--default", action="store_true", help="also measure the default model (TP=3, TP=3+SP, PP=2)")
    a = ap.parse_args()
    from helpers.tiny import make_tiny_model

    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in LENS]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for kind, modes in (("llama", [("tp", dict(tensor_parallel_size=2)),
                                       ("tp+sp", dict(tensor_parallel_size=2, enable_sequence_parallel=True)),
                                       ("pp", dict(pipeline_parallel_size=2))]),
                            ("mixtral", [("tp+ep", dict(tensor_parallel_size=2, enable_expert_parallel=True))])):
            path = Path(d) / kind
            hf = make_tiny_model(kind, path)
            c = hf.config
            want = run(str(path), {}, prompts)[2]
            for mode, kw in modes:
                measured, experts, toks = run(str(path), kw, prompts)
                assert toks == want, f"{kind} {mode}: tokens differ from a single rank"
                cross = sum(m["cross_rows"] for m in experts)
                n = kw.get("tensor_parallel_size", 1) * kw.get("pipeline_parallel_size", 1)
                exp = formulas(mode, n, c.hidden_size, c.num_hidden_layers, len(experts), c.vocab_size,
                               getattr(c, "num_experts_per_tok", 0), cross)
                rows.append((f"tiny {kind} (H={c.hidden_size}, L={c.num_hidden_layers}, V={c.vocab_size})",
                             f"{mode} n={n}", measured, exp))
    if a.default:
        prompts_d = [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts]
        want = run("default", {}, prompts_d)[2]
        for mode, kw in (("tp", dict(tensor_parallel_size=3)),
                         ("tp+sp", dict(tensor_parallel_size=3, enable_sequence_parallel=True)),
                         ("pp", dict(pipeline_parallel_size=2))):
            measured, _, toks = run("default", kw, prompts_d)
            assert toks == want, f"default {mode}: tokens differ from a single rank"
            n = kw.get("tensor_parallel_size", 1) * kw.get("pipeline_parallel_size", 1)
            rows.append(("default SmolLM2-135M (H=576, L=30, V=49152)", f"{mode} n={n}", measured,
                         formulas(mode, n, 576, 30, 0, 49152, 0, 0)))
    print(table(rows))


if __name__ == "__main__":
    main()
