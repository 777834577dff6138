"""Where to fill the grammar bitmask of a synchronous step: in the step thread while the forward pass runs
("overlap"), or on the engine thread before it ("inline"), against free text, in one process, rounds in
alternating order. 16 requests x 128 tokens of the default model (bf16) under the JSON schema of
benchmarks/structured.sh; reports ms per step (wall time per 16 tokens).

    python benchmarks/structured_overlap.py --rounds 4 --out benchmarks/results/structured_overlap/offline.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

from rivulet import LLM, SamplingParams
from rivulet.bench.offline import machine_info
from rivulet.sampling_params import StructuredOutputsParams

SCHEMA = json.loads(re.search(r"SCHEMA='(.*?)'", (Path(__file__).parent / "structured.sh").read_text()).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM("default", max_model_len=1024, enable_prefix_caching=False)
    prompts = [f"Shopping list number {i}, as JSON:" for i in range(16)]
    constrained = SamplingParams(temperature=0, max_tokens=128,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    free = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    core = llm.engine.core
    llm.generate(prompts, constrained, use_tqdm=False)  # grammar compiled, caches warm
    ms: dict[str, list[float]] = {"overlap": [], "inline": [], "free": []}
    for r in range(args.rounds):
        for mode in (["overlap", "inline", "free"] if r % 2 == 0 else ["free", "inline", "overlap"]):
            core.overlap_grammar = mode == "overlap"
            t0 = time.perf_counter()
            outs = llm.generate(prompts, free if mode == "free" else constrained, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            ms[mode].append(round((time.perf_counter() - t0) / tokens * len(prompts) * 1000, 2))
            print(f"round {r} {mode}: {ms[mode][-1]} ms per step", flush=True)
    llm.shutdown()
    result = {"benchmark": "structured_overlap", **machine_info(), "ms_per_step": ms,
              "median_ms_per_step": {k: statistics.median(v) for k, v in ms.items()}}
    print(json.dumps(result["median_ms_per_step"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
