"""Base-model requests on a LoRA server (`enable_lora=True`): the CPU decode program against the layer-by-layer
path, same engine and process, runs alternated. Greedy, 128-token prompts, 128 output tokens each.

    .venv/bin/python benchmarks/lora_base_steps.py [--streams 1 8] [--quantization int4] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

from rivulet import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    llm = LLM("default", dtype="bfloat16", quantization=a.quantization or None, max_num_seqs=max(a.streams),
              enable_lora=True, max_loras=4)
    runner = llm.engine.core.executor.runner
    program = runner.decode_program
    assert program is not None, runner.decode_program_skipped
    greedy = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate({"prompt_token_ids": list(range(100, 140))}, SamplingParams(max_tokens=4), use_tqdm=False)
    rows = []
    for n in a.streams:
        prompts = [{"prompt_token_ids": [(i * 37 + j * 11) % 40000 + 100 for j in range(128)]} for i in range(n)]
        got: dict[str, list[float]] = {"program": [], "layer_by_layer": []}
        for _ in range(a.rounds):
            for name in got:
                runner.decode_program = program if name == "program" else None
                start = time.perf_counter()
                llm.generate(prompts, greedy, use_tqdm=False)
                got[name].append(round(n * 128 / (time.perf_counter() - start), 1))
        rows.append({"streams": n, "tok_s": got})
        print(json.dumps(rows[-1]), flush=True)
    llm.shutdown()
    if a.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(a.json, "w") as f:
            json.dump({"benchmark": "lora_base_steps", "quantization": a.quantization, "commit": commit,
                       "cpu": platform.processor() or platform.machine(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
