"""Top-1 agreement with the float32 reference on the same teacher-forced decode steps: Rivulet's int4
path and llama.cpp's server on the default model's Q4_1 file.

The reference is transformers (float32) on the GGUF: its greedy continuation of 30 prompts (the fifteen
below, raw and in the chat template), 48 tokens each. Every system then sees
the prompt plus the reference's tokens and predicts the next one, one token per step (the decode path,
where the 4-bit kernels run); a step agrees when its argmax is the reference's.

    python benchmarks/int4_agreement.py --llama-server ~/.cache/rivulet-peers/llama.cpp/build/bin/llama-server \
        --json benchmarks/results/int4_agreement.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from rivulet.config import CacheConfig, ModelConfig
from rivulet.engine.tokenizer import load_tokenizer
from rivulet.models.loader import resolve_model
from rivulet.worker.batch import SeqChunk
from rivulet.worker.model_runner import ModelRunner

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of",
           # ten more (2026-12-05): 1440 steps, where the first five's 480 put a standard error of ~0.009 on a rate
           "The largest planet in our solar system is", "import numpy as np\n\ndef normalize(v):",
           "Photosynthesis is the process by which", "My favourite recipe for a quick dinner is",
           "The French Revolution began in", "To reverse a linked list in place,",
           "The main difference between a virus and a bacterium is", "Dear team, I am writing to let you know that",
           "The speed of light in a vacuum is", "A haiku about the ocean:"]
STEPS = 48


def prompts(tok) -> list[list[int]]:
    chat = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            for p in PROMPTS]
    chat = [c["input_ids"] if hasattr(c, "keys") else c for c in chat]
    return [tok(p).input_ids for p in PROMPTS] + chat


def reference(src, all_ids: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src.path), gguf_file=src.gguf_file, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    out = []
    for ids in all_ids:
        g = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=STEPS, do_sample=False, pad_token_id=0, repetition_penalty=None)
        out.append(g[0, len(ids):].tolist())
    return out


def rivulet_predictions(dtype: str, quantization: str | None, seqs: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    r = ModelRunner(ModelConfig(model="default", dtype=dtype, quantization=quantization),  # type: ignore[arg-type]
                    CacheConfig(block_size=16), resolve_model("default"))
    r.allocate_kv_cache(64)
    blocks = list(range(64))
    out = []
    for ids, ref in seqs:
        logits = [r.forward([SeqChunk(ids, 0, blocks)])]
        for i, t in enumerate(ref[:-1]):
            logits.append(r.forward([SeqChunk([t], len(ids) + i, blocks)]))
        out.append(torch.cat(logits).argmax(-1).tolist())
    return out


def llama_predictions(server: str, gguf: str, seqs: list[tuple[list[int], list[int]]], port: int) -> list[list[int]]:
    proc = subprocess.Popen([server, "-m", gguf, "-t", "2", "-c", "4096", "-np", "1", "--no-repack", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        out = []
        for ids, ref in seqs:
            preds = []
            for i in range(len(ref)):  # the prompt plus i reference tokens; the server reuses its cached prefix
                body = {"prompt": ids + ref[:i], "n_predict": 1, "temperature": 0, "top_k": 1, "cache_prompt": True,
                        "return_tokens": True, "samplers": ["top_k"]}
                req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
                preds.append(json.load(urllib.request.urlopen(req, timeout=60))["tokens"][0])
            out.append(preds)
        return out
    finally:
        proc.terminate()
        proc.wait()


def agreement(preds: list[list[int]], refs: list[list[int]]) -> float:
    agree = sum(int(p == r) for ps, rs in zip(preds, refs) for p, r in zip(ps, rs))
    return agree / sum(len(r) for r in refs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", type=Path, default=Path.home() / ".cache/rivulet-peers/llama.cpp/build/bin/llama-server")
    ap.add_argument("--port", type=int, default=8040)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    src = resolve_model("default")
    all_ids = prompts(load_tokenizer(src))
    refs = reference(src, all_ids)
    seqs = list(zip(all_ids, refs))
    result = {"steps": sum(len(r) for r in refs), "reference": "transformers float32 on the Q4_1 GGUF"}
    preds = {}
    for name, dtype, q in [("rivulet_bf16", "bfloat16", None), ("rivulet_int4_bf16_act", "bfloat16", "int4"),
                           ("rivulet_int4_fp32_act", "float32", "int4")]:
        preds[name] = rivulet_predictions(dtype, q, seqs)
        result[name] = agreement(preds[name], refs)
        print(f"{name}: top-1 agreement {result[name]:.4f}")
    if args.llama_server.exists():
        preds["llama_cpp_q4_1"] = llama_predictions(str(args.llama_server), src.gguf_path, seqs, args.port)
        result["llama_cpp_q4_1"] = agreement(preds["llama_cpp_q4_1"], refs)
        print(f"llama_cpp_q4_1: top-1 agreement {result['llama_cpp_q4_1']:.4f}")
        # paired: the steps only one of the two int4 paths gets right (what a difference in rates rests on)
        hits = {k: [p == r for ps, rs in zip(preds[k], refs) for p, r in zip(ps, rs)]
                for k in ("rivulet_int4_fp32_act", "llama_cpp_q4_1")}
        a, b = hits.values()
        result["only_rivulet_int4_fp32_act"] = sum(x and not y for x, y in zip(a, b))
        result["only_llama_cpp_q4_1"] = sum(y and not x for x, y in zip(a, b))
        print(f"steps only Rivulet int4 (fp32 act.) gets right: {result['only_rivulet_int4_fp32_act']}, "
              f"only llama.cpp: {result['only_llama_cpp_q4_1']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
