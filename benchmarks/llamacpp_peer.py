"""llama.cpp's own numbers on the same GGUF file, through llama-cpp-python, for the CPU targets
(`benchmarks/cpu_targets.sh`). Runs in the llama.cpp venv, not Rivulet's (it imports only llama_cpp and numpy):

    /work/llamacpp-venv/bin/python benchmarks/llamacpp_peer.py single --model M.gguf --result-json out.json
    /work/llamacpp-venv/bin/python benchmarks/llamacpp_peer.py batched --model M.gguf --parallel 64 \
        --input-len 128 --output-len 128 --result-json out.json
    /work/llamacpp-venv/bin/python benchmarks/llamacpp_peer.py serve [--no-amx] --model M.gguf --port 8011 ...

`--no-amx` (first after the mode) keeps llama.cpp off AMX where the CPU reports it but cannot run it (see
`deny_amx`; `probe-amx MODEL.gguf` exits 1 on such machines); `serve` runs `python -m llama_cpp.server` with the
remaining arguments.

single: decode tok/s of one stream (`Llama.generate`, greedy, `--output-len` tokens from a short prompt, EOS
ignored) and prompt processing tok/s of a `--prefill-len`-token prompt (`Llama.eval`, n_batch = prefill-len).
batched: `--parallel` sequences through the low-level batch API (`llama_batch` + `llama_decode`, one sequence id
per stream, greedy argmax over the logits), like llama.cpp's `batched` example: all prompts prefilled in
n_batch chunks, then one decode call per step for every stream. This is what llama.cpp offers for batched
decoding from Python: llama-cpp-python's server runs one request at a time.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np


def deny_amx() -> None:
    """Make arch_prctl(ARCH_REQ_XCOMP_PERM) fail in this process (a seccomp filter), so ggml's AMX check says
    "AMX is not ready" and llama.cpp uses its AVX-512 paths. Needed where the CPU reports AMX but the kernel or
    sandbox does not enable AMX state: there the first AMX matmul dies with SIGILL (a -DGGML_NATIVE=ON build
    compiles AMX code on such CPUs). Everything else, including weight repacking, stays as built."""
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    ld_abs, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    allow, eperm = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    audit_arch_x86_64, nr_arch_prctl, arch_req_xcomp_perm = 0xC000003E, 158, 0x1023

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    prog = [ins(ld_abs, 4), ins(jeq, audit_arch_x86_64, 1, 0), ins(ret, allow),  # seccomp_data.arch
            ins(ld_abs, 0), ins(jeq, nr_arch_prctl, 1, 0), ins(ret, allow),  # .nr
            ins(ld_abs, 16), ins(jeq, arch_req_xcomp_perm, 0, 1), ins(ret, eperm),  # .args[0]
            ins(ret, allow)]
    buf = ctypes.create_string_buffer(b"".join(prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # NO_NEW_PRIVS, SECCOMP
        raise SystemExit(f"cannot install the seccomp filter: errno {ctypes.get_errno()}")


_AMX_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_batch=64, verbose=False)
llm.eval(list(range(100, 164)))
llm.eval([200])
"""


def amx_unusable(model: str) -> bool:
    """True when the CPU reports AMX and llama.cpp dies with SIGILL evaluating a few tokens (probed in a child
    process). Seen in sandboxes that report AMX but do not keep the AMX tile state of every thread: a small
    probe of the instructions alone passes there, llama.cpp's threads do not."""
    import signal
    import subprocess
    import sys

    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    if " amx_tile" not in flags:
        return False
    r = subprocess.run([sys.executable, "-c", _AMX_PROBE, model], capture_output=True)
    return r.returncode == -signal.SIGILL


def serve(args: list[str]) -> None:
    """`python -m llama_cpp.server ARGS` in this process (after --no-amx took effect)."""
    import runpy
    import sys

    sys.argv = ["llama_cpp.server", *args]
    runpy.run_module("llama_cpp.server", run_name="__main__")


def _random_ids(n: int, count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 40000), size=(count, n)).tolist()


def single(a: argparse.Namespace) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=a.model, n_ctx=max(a.prefill_len, 256) + a.output_len + 16, n_batch=a.prefill_len,
                n_ubatch=a.prefill_len, n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    short = llm.tokenize(b"The capital of France is", add_bos=True)
    decode_tok_s, first_token_s = [], []
    for it in range(a.iters + 1):
        llm.reset()
        t0 = time.perf_counter()
        times = []
        for _ in llm.generate(short, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) == a.output_len:
                break
        if it == 0:
            continue  # warm-up
        first_token_s.append(times[0] - t0)
        decode_tok_s.append((len(times) - 1) / (times[-1] - times[0]))
    prefill_tok_s = []
    for it, prompt in enumerate(_random_ids(a.prefill_len, a.iters + 1, llm.n_vocab(), a.seed)):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        if it:
            prefill_tok_s.append(a.prefill_len / (time.perf_counter() - t0))
    return {"benchmark": "llamacpp_single", "model": a.model, "threads": a.threads, "output_len": a.output_len,
            "prefill_len": a.prefill_len, "iterations": a.iters,
            "decode_tok_s_median": statistics.median(decode_tok_s), "decode_tok_s": decode_tok_s,
            "first_token_s_median": statistics.median(first_token_s),
            "prefill_tok_s_median": statistics.median(prefill_tok_s), "prefill_tok_s": prefill_tok_s}


def batched(a: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp as L
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp's load and graph logs
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(a.model.encode(), mparams)
    if not model:
        raise SystemExit(f"cannot load {a.model}")
    vocab_p = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab_p)
    per_seq = a.input_len + a.output_len + 8
    cp = L.llama_context_default_params()
    cp.n_ctx = per_seq * a.parallel
    cp.n_batch = a.n_batch
    cp.n_ubatch = a.n_batch
    cp.n_seq_max = a.parallel
    cp.n_threads = a.threads
    cp.n_threads_batch = a.threads
    cp.kv_unified = False  # separate streams (llama.cpp's advice when sequences share no prefix)
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit("cannot create the llama.cpp context")
    batch = L.llama_batch_init(max(a.n_batch, a.parallel), 0, 1)
    prompts = _random_ids(a.input_len, a.parallel, n_vocab, a.seed)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, pos, seq, want_logits)."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, want) in enumerate(items):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.seq_id[i][0] = seq
            batch.n_seq_id[i] = 1
            batch.logits[i] = want
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    def argmax_rows(n: int) -> list[int]:
        ptr = L.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n, n_vocab))
        return [int(x) for x in logits.argmax(axis=1)]

    def run() -> tuple[float, float, int]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        flat = [(tok, pos, s, pos == a.input_len - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        t0 = time.perf_counter()
        nxt: list[int] = []
        for i in range(0, len(flat), a.n_batch):
            chunk = flat[i:i + a.n_batch]
            decode(chunk)
            n_out = sum(1 for c in chunk if c[3])
            if n_out:
                nxt += argmax_rows(n_out)
        t_prefill = time.perf_counter() - t0
        produced = len(nxt)  # the first token of each stream
        for step in range(1, a.output_len):
            decode([(tok, a.input_len + step - 1, s, True) for s, tok in enumerate(nxt)])
            nxt = argmax_rows(a.parallel)
            produced += a.parallel
        return t_prefill, time.perf_counter() - t0, produced

    a_parallel, a_output = a.parallel, a.output_len
    runs = [run() for _ in range(a.iters)]  # the best of --iters runs (the first also warms up)
    t_prefill, total, produced = min(runs, key=lambda r: r[1])
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"benchmark": "llamacpp_batched", "model": a.model, "threads": a.threads, "parallel": a_parallel,
            "input_len": a.input_len, "output_len": a_output, "n_batch": a.n_batch, "iterations": a.iters,
            "prefill_s": t_prefill, "elapsed_s": total, "output_tokens": produced,
            "output_tok_s": produced / total, "decode_tok_s": (produced - a_parallel) / (total - t_prefill),
            "total_tok_s": (produced + a_parallel * a.input_len) / total}


def main() -> None:
    import sys

    if sys.argv[1:2] == ["probe-amx"]:  # probe-amx MODEL.gguf: exit 1 when llama.cpp needs --no-amx here
        sys.exit(1 if amx_unusable(sys.argv[2]) else 0)
    if sys.argv[1:2] == ["serve"]:  # serve [--no-amx] LLAMA_CPP_SERVER_ARGS...
        rest = sys.argv[2:]
        if rest[:1] == ["--no-amx"]:
            deny_amx()
            rest = rest[1:]
        serve(rest)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["single", "batched"])
    ap.add_argument("--model", required=True, help="the .gguf file")
    ap.add_argument("--no-amx", action="store_true", help="keep llama.cpp off AMX (see deny_amx)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--parallel", type=int, default=64)
    ap.add_argument("--n-batch", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-json", default=None)
    a = ap.parse_args()
    if a.no_amx:
        deny_amx()
    import llama_cpp

    r = single(a) if a.mode == "single" else batched(a)
    r.update({"llama_cpp_python": llama_cpp.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"})
    print(json.dumps(r, indent=2))
    if a.result_json:
        os.makedirs(os.path.dirname(os.path.abspath(a.result_json)), exist_ok=True)
        with open(a.result_json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
