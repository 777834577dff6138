"""How often a seeded request samples other tokens when it is preempted and recomputed: the logic of
tests/engine/test_batched_equals_alone.py::test_seeded_sampling_survives_preemption over several seed sets.

    .venv/bin/python benchmarks/seeded_preemption.py --dtype float32 --seed-sets 100,200,300,400,500,600,700,800

Each set: 10 seeded requests (temperature 1, 16 tokens) alone, then together in 10 KV blocks of 16, which
preempts some of them; prints the requests whose tokens differ.
"""

from __future__ import annotations

import argparse
import json
import random

from rivulet import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed-sets", default="100,200,300,400,500,600,700,800")
    a = ap.parse_args()
    rng = random.Random(1)
    words = "river stone cloud engine paper light garden number silver market music window".split()
    llm = LLM(dtype=a.dtype, max_model_len=128, seed=0, num_kv_blocks=10, block_size=16, max_num_seqs=16)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(" ".join(rng.choice(words) for _ in range(rng.randint(12, 30)))).input_ids}
               for _ in range(10)]
    total = 0
    sets = [int(x) for x in a.seed_sets.split(",")]
    for base in sets:
        params = [SamplingParams(temperature=1.0, seed=base + i, max_tokens=16, ignore_eos=True) for i in range(10)]
        alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
        before = llm.engine.core.scheduler.num_preemptions
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        differ = [i for i in range(10) if together[i] != alone[i]]
        total += len(differ)
        print(json.dumps({"seeds": f"{base}+i", "preemptions": llm.engine.core.scheduler.num_preemptions - before,
                          "differing_requests": differ}))
    print(json.dumps({"dtype": a.dtype, "differing_requests": total, "requests": 10 * len(sets)}))


if __name__ == "__main__":
    main()
