"""One-shot GPU check of Rivulet: kernels vs references, ceilings, decode and throughput.

    bash benchmarks/gpu/run.sh                # on a CUDA machine; results in $OUT (default ./out)
    python benchmarks/gpu/gpu_check.py --dry-run --out /tmp/x   # CPU smoke run, tiny sizes

Sections run one after another, each in its own Python process (a CUDA error in one cannot take
the others down) under its share of one global time budget: `ceilings` (copy bandwidth, bf16
matmul), `kernels` (every Triton op vs its reference, timed), `model` (Llama-3-8B-shaped model
on Rivulet and transformers; structured output on it when xgrammar is installed), `pytest` (tests/kernels on the GPU, bf16 cases included, and the step's tests on tiny models; only when
pytest is installed). Each section rewrites its JSON under $OUT/parts as it goes; the parent
merges them into $OUT/gpu_check.json and $OUT/summary.md after every section (also when one
fails or times out), and prints the summary at the end.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

SECTIONS = ("ceilings", "kernels", "model", "pytest")
KERNEL_GROUPS = ("rms_norm", "silu_and_mul", "rotary", "write_kv", "kv_copy", "attention", "moe", "fp8")
# seconds: (least worth starting with, most it may take)
LIMITS: dict[str, tuple[float, float]] = {"ceilings": (10, 45), "kernels": (30, 170), "model": (60, 400),
                                          "pytest": (30, 400)}
RESERVE_S = 8.0  # kept for merging and writing the table
# the CPU dry run caps every size at these
DRY_RUN_CAPS = dict(num_prompts=4, input_len=16, output_len=8, long_requests=2, long_input_len=24,
                    long_output_len=8, decode_steps=6, max_batched_tokens=256, kv_cache_gib=1 / 16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "./out"), help="results folder (default $OUT or ./out)")
    ap.add_argument("--budget-s", type=float, default=440.0, help="wall-clock budget for everything")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: CPU, float32, tiny sizes (checks the script)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--long-requests", type=int, default=256, help="0: no long run")
    ap.add_argument("--long-input-len", type=int, default=1000)
    ap.add_argument("--long-output-len", type=int, default=1000)
    ap.add_argument("--decode-steps", type=int, default=128, help="batch-1 decode steps timed")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=float, default=64.0,
                    help="KV cache of the main engine at most (less where the GPU leaves less: see model_checks)")
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count (quick runs)")
    ap.add_argument("--kernels", default="", help="comma list of kernel groups to check (default: all of "
                    "rms_norm, silu_and_mul, rotary, write_kv, kv_copy, attention, moe, fp8)")
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.section_list = [s for s in a.sections.split(",") if s]
    unknown = set(a.section_list) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    a.kernel_list = [k for k in a.kernels.split(",") if k]
    unknown = set(a.kernel_list) - set(KERNEL_GROUPS)
    if unknown:
        ap.error(f"unknown kernel groups {sorted(unknown)}; known: {', '.join(KERNEL_GROUPS)}")
    for name in ("num_prompts", "input_len", "output_len", "decode_steps", "max_batched_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if a.dry_run:
        for k, cap in DRY_RUN_CAPS.items():
            setattr(a, k, min(getattr(a, k), cap))
    return a


# ---- child: one section ----

def run_child(a: argparse.Namespace) -> int:
    import torch

    from common import Deadline, PartWriter, error_text

    device = torch.device("cpu" if a.dry_run else "cuda")
    dtype = torch.float32 if a.dry_run else torch.bfloat16
    deadline = Deadline(a.deadline or time.time() + 600)
    out = PartWriter(Path(a.out) / "parts" / f"{a.section}.json")
    try:
        if a.section in ("ceilings", "kernels"):
            from kernel_checks import REAL, TINY, run_ceilings, run_kernels

            sizes = TINY if a.dry_run else REAL
            if a.section == "ceilings":
                run_ceilings(out, sizes, device, dtype)
            else:
                run_kernels(out, sizes, device, dtype, deadline, quick=a.dry_run, groups=a.kernel_list)
                rows = out.data.get("rows", [])
                bad = [r for r in rows if not r.get("passed")]
                if bad:
                    out.set("status", f"FAIL ({len(bad)} of {len(rows)} cases failed or errored)")
                    return 0
        elif a.section == "model":
            from model_checks import LLAMA3_8B, TINY_LLAMA, model_failures, run_model

            cfg = dict(TINY_LLAMA if a.dry_run else LLAMA3_8B)
            if a.layers:
                cfg["num_hidden_layers"] = a.layers
            run_model(out, cfg, a, device, dtype, deadline)
            bad = model_failures(out.data)
            if bad:
                out.set("status", f"FAIL ({'; '.join(bad)})")
                return 0
        elif a.section == "pytest":
            run_pytest(out, deadline)
            if out.data.get("returncode") != 0:
                out.set("status", f"FAIL (pytest exit {out.data.get('returncode')})")
                return 0
        out.set("status", "ok")
        return 0
    except BaseException as e:  # noqa: BLE001 - record everything, even KeyboardInterrupt
        out.set("status", "error")
        out.set("error", error_text(e))
        return 1


def run_pytest(out: Any, deadline: Any) -> None:
    # the kernels against their references, and the KV tier's copies on the device (tiny model, float32; the
    # tensor- and pipeline-parallel tier test wants two devices). The C++ CPU kernels are CI's: on the lent
    # machine's image (torch 2.11+cu130, GCC 13) any extension's c10::str of an integer segfaults, so their
    # error-path tests crash pytest there.
    # Also the step's own GPU paths on tiny models (pinned input copies, async outputs, graphs), against the
    # synchronous loop and the direct path; and the compiled model in CUDA graphs, saved and loaded again
    # (tests/kernels has compiling over the Triton ops, and the graphs of the compiled forward).
    steps = [f"tests/engine/test_step_modes.py::test_async_and_draft_steps_match_sync_on_tiny_models[{k}]"
             for k in ("llama", "qwen3")]
    steps.append("tests/compilation/test_compile.py::test_compiled_model_gives_the_eager_tokens")
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "tests/engine/test_kv_tier.py",
           "tests/worker/test_staging.py", *steps,
           "--ignore=tests/kernels/test_cpu_kernels.py", "--ignore=tests/kernels/test_packed_linear.py",
           "-k", "not default_model and not every_rank", "-q", "-p", "no:cacheprovider",
           "--tb=short", "--show-capture=no"]  # each failure short: the H100 run's tail was torch's DEBUG log
    if importlib.util.find_spec("xdist") is not None:  # serial, the GPU tests took over 134 s of the budget
        cmd += ["-n", "4"]
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(deadline.left() - 3, 5))
        out.set("returncode", p.returncode)
        out.set("output_tail", (p.stdout + p.stderr)[-20000:])
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out.set("returncode", "timeout")
        out.set("output_tail", text[-20000:] + "\n[pytest stopped at the time budget]")


# ---- parent: run the sections, merge, write the table ----

def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _meta(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        device = f"{p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}), CUDA {torch.version.cuda}"
    else:
        device = "CPU (no CUDA device)"
    return {"date": datetime.date.today().isoformat(), "commit": commit, "device": device,
            "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
            "dry_run": a.dry_run, "budget_s": a.budget_s, "sections": a.section_list,
            "args": {k: v for k, v in vars(a).items()
                     if k not in ("section", "deadline", "section_list", "kernel_list")}}


def run_section(name: str, a: argparse.Namespace, argv: list[str], limit: float) -> dict[str, Any]:
    out = Path(a.out)
    part = out / "parts" / f"{name}.json"
    part.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--section", name,
           "--deadline", str(time.time() + limit - 5)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if a.dry_run:
        env["TRITON_INTERPRET"] = "1"
    t0 = time.time()
    status = None
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
        log, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        rc, status = None, f"timeout after {limit:.0f}s"
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / f"{name}.log").write_text(log)
    try:
        data = json.loads(part.read_text())
    except (OSError, json.JSONDecodeError):
        data = {}
    if status is not None:
        data["status"] = status
    elif rc != 0 and not data.get("error"):
        data["status"] = "error"
        data["error"] = f"exit code {rc}; log tail:\n{log[-1500:]}"
    elif data.get("status") == "running":
        data["status"] = "error"
        data["error"] = f"section ended without finishing (exit code {rc}); log tail:\n{log[-1500:]}"
    data["elapsed_s"] = round(time.time() - t0, 1)
    return data


def write_results(out: Path, results: dict[str, Any]) -> str:
    from report import render

    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    table = render(results)
    (out / "summary.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.section:
        return run_child(a)
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device is visible (torch.cuda.is_available() is False); this check needs a GPU "
              "(use --dry-run to check the script itself on CPU)", file=sys.stderr)
        return 2
    out = Path(a.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    start = time.time()
    end = start + a.budget_s
    results: dict[str, Any] = {"meta": _meta(a), "sections": {}}
    try:
        for name in a.section_list:
            left = end - time.time() - RESERVE_S
            least, most = LIMITS[name]
            if name == "pytest" and importlib.util.find_spec("pytest") is None:
                results["sections"][name] = {"status": "skipped", "reason": "pytest is not installed"}
            elif left < least:
                results["sections"][name] = {"status": "skipped", "reason": f"time budget: {max(left, 0):.0f}s left"}
            else:
                print(f"[gpu_check] {name}: up to {min(most, left):.0f}s", flush=True)
                results["sections"][name] = run_section(name, a, argv, min(most, left))
                print(f"[gpu_check] {name}: {results['sections'][name].get('status')} "
                      f"in {results['sections'][name]['elapsed_s']}s", flush=True)
            results["meta"]["elapsed_s"] = time.time() - start
            write_results(out, results)
    finally:
        results["meta"]["elapsed_s"] = time.time() - start
        table = write_results(out, results)
    print(table)
    print(f"[gpu_check] wrote {out / 'summary.md'} and {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
