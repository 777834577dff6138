"""The `rivulet bench` subcommands: serve, throughput, latency, plot. Every bad input is a RivuletError
(one `rivulet: error: ...` line, exit 2)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rivulet.config import RivuletError


def _serve_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id to request (default: the first one /v1/models lists)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves: request i names adapter i mod len(NAMES) as its model "
                        "(vLLM's bench picks one at random)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for exact prompt lengths: 'default', HF folder or .gguf (default: the model id)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--api-key", default=None)
    # datasets.DATASETS (not imported here: numpy would slow every `rivulet` command's start)
    p.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "copy", "jsonl"],
                   help="copy: edit tasks whose answer repeats the prompt (use with --endpoint chat)")
    p.add_argument("--dataset-path", default=None, help="JSONL file for --dataset jsonl")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-R), len*(1+R)]")
    p.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: shared tokens (default input-len/2)")
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: distinct prefixes, each request takes one at random (seeded)")
    p.add_argument("--prompt-format", default="text", choices=["text", "ids"],
                   help="send decoded text (default) or the token ids themselves")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per point")
    p.add_argument("--request-rate", type=float, default=None, help="requests/s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    p.add_argument("--max-duration-s", type=float, default=None,
                   help="stop each point after this long (requests still running are cancelled)")
    p.add_argument("--sweep", default=None, help="comma-separated values, one point each, e.g. 1,4,16,64")
    p.add_argument("--sweep-over", default="concurrency", choices=["concurrency", "rate"])
    p.add_argument("--prompts-per-concurrency", type=float, default=None, metavar="K",
                   help="each concurrency point sends K x its concurrency requests (instead of --num-prompts)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (Rivulet, vLLM, llama.cpp)")
    p.add_argument("--eos-logit-bias", action="store_true",
                   help="also bias the tokenizer's EOS ids by -100 (for servers without ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None, help="sent as top_p (default: not sent)")
    p.add_argument("--top-k", type=int, default=None, help="sent as top_k (default: not sent)")
    p.add_argument("--min-p", type=float, default=None, help="sent as min_p (default: not sent)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=500,tpot=50 (also e2el)")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--label", default=None, help="name of the system in the JSON and plots")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of throughput vs TPOT/TTFT (needs matplotlib)")
    p.add_argument("--disable-tqdm", action="store_true")


def _offline_common(p: argparse.ArgumentParser, input_len: int) -> None:
    """The engine flags of `rivulet generate/serve` (so any engine option applies here too) + the sizes."""
    from rivulet.engine.args import EngineArgs

    EngineArgs.add_cli_args(p)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--result-json", default=None)


def _llm_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that `rivulet.LLM` takes, except model and dtype; unset ones (None) left to the bench."""
    from rivulet.engine.args import EngineArgs

    names = EngineArgs.names() - {"model", "dtype"}
    return {k: v for k, v in vars(a).items() if k in names and v is not None}


def add_bench_parser(sub: Any) -> None:
    """Register `rivulet bench ...` on the main parser's subparsers."""
    b = sub.add_parser("bench", help="benchmark a server over HTTP, or the engine offline")
    bs = b.add_subparsers(dest="bench_command", required=True)
    _serve_parser(bs.add_parser("serve", help="load-test an OpenAI-compatible server (Rivulet or a peer)"))
    t = bs.add_parser("throughput", help="offline throughput of N random prompts (Rivulet and/or transformers)")
    _offline_common(t, 128)
    t.add_argument("--backend", default="rivulet", help="rivulet, transformers, or both: rivulet,transformers")
    t.add_argument("--num-prompts", type=int, default=64)
    t.set_defaults(dtype="bfloat16", max_num_seqs=None, max_num_batched_tokens=4096)
    lat = bs.add_parser("latency", help="prefill and per-token decode time of one request")
    _offline_common(lat, 512)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--profile", default=None, metavar="DIR", help="write a torch.profiler chrome trace here")
    lat.set_defaults(dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=None, enable_prefix_caching=False)
    pl = bs.add_parser("plot", help="plot one or more `bench serve` result JSONs into one PNG")
    pl.add_argument("results", nargs="+")
    pl.add_argument("-o", "--output", required=True)
    pl.add_argument("--label", action="append", default=None, help="one per result file, in order")


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise RivuletError(f"cannot write {path}: {e}") from None
    print(f"wrote {path}", file=sys.stderr)


def _check_writable(path: str | None, flag: str) -> None:
    """Fail before a run, not after it, where its results could not be written."""
    if not path:
        return
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RivuletError(f"{flag} {path}: cannot create {parent}: {e.strerror or e}") from None
    if not os.access(parent, os.W_OK) or Path(path).is_dir():
        raise RivuletError(f"{flag} {path}: not a writable file path")


def _parse_sweep(spec: str | None, over: str) -> list[float] | None:
    if not spec:
        return None
    try:
        values = [float(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise RivuletError(f"bad --sweep {spec!r}: expected comma-separated numbers, e.g. 1,4,16,64") from None
    if not values or any(not v > 0 for v in values) or \
            (over == "concurrency" and any(v != int(v) or math.isinf(v) for v in values)):
        raise RivuletError(f"bad --sweep {spec!r}: expected positive {'integers' if over == 'concurrency' else 'rates'}")
    return values


def _check_serve_args(a: argparse.Namespace) -> list[float] | None:
    from rivulet.bench.metrics import parse_slo

    sweep = _parse_sweep(a.sweep, a.sweep_over)
    swept = {"concurrency": "max_concurrency", "rate": "request_rate"}[a.sweep_over] if sweep else None
    if a.request_rate is None and a.max_concurrency is None and not sweep:
        raise RivuletError("give --request-rate R or --max-concurrency C (or --sweep VALUES)")
    if a.request_rate is not None and not a.request_rate > 0:
        raise RivuletError(f"--request-rate must be > 0 (or inf): got {a.request_rate}")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise RivuletError(f"--max-concurrency must be >= 1: got {a.max_concurrency}")
    if swept and getattr(a, swept) is not None:
        raise RivuletError(f"--sweep over {a.sweep_over} replaces --{swept.replace('_', '-')}; give one of them")
    if not a.burstiness > 0:
        raise RivuletError(f"--burstiness must be > 0: got {a.burstiness}")
    if a.max_duration_s is not None and not a.max_duration_s > 0:
        raise RivuletError(f"--max-duration-s must be > 0: got {a.max_duration_s}")
    if a.prompts_per_concurrency is not None and not (a.prompts_per_concurrency > 0 and sweep and
                                                       a.sweep_over == "concurrency"):
        raise RivuletError("--prompts-per-concurrency needs a positive K and --sweep over concurrency")
    if a.num_warmups < 0:
        raise RivuletError("--num-warmups must be >= 0")
    if not a.timeout > 0:
        raise RivuletError(f"--timeout must be > 0 seconds: got {a.timeout}")
    _check_writable(a.result_json, "--result-json")
    _check_writable(a.plot, "--plot")
    if a.endpoint == "chat" and a.prompt_format == "ids":
        raise RivuletError("--endpoint chat needs --prompt-format text")
    a.slo_ms = parse_slo(a.slo)
    if a.extra_body:
        try:
            a.extra_body = json.loads(a.extra_body)
        except ValueError as e:
            raise RivuletError(f"bad --extra-body: {e}") from None
        if not isinstance(a.extra_body, dict):
            raise RivuletError("bad --extra-body: expected a JSON object")
    if a.plot:
        from rivulet.bench.plot import _pyplot

        _pyplot()  # fail before the run, not after it
    return sweep


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from rivulet.bench.datasets import load_bench_tokenizer, make_requests
    from rivulet.bench.metrics import format_summary
    from rivulet.bench.serve import ClientConfig, LoadConfig, check_server, load_points, normalize_base_url, \
        run_point, warm_up

    sweep = _check_serve_args(a)
    base_url = normalize_base_url(a.base_url)
    models = asyncio.run(check_server(base_url, a.api_key))
    model = a.model or (models[0] if models else None)
    if model is None:
        raise RivuletError(f"{base_url}/v1/models lists no model; pass --model")
    tok = load_bench_tokenizer(a.tokenizer or model)
    loads = load_points(LoadConfig(request_rate=math.inf if a.request_rate is None else a.request_rate,
                                   max_concurrency=a.max_concurrency, burstiness=a.burstiness,
                                   max_duration_s=a.max_duration_s, seed=a.seed), sweep, a.sweep_over)
    counts = [max(1, round(a.prompts_per_concurrency * (ld.max_concurrency or 1))) if a.prompts_per_concurrency
              else a.num_prompts for ld in loads]
    requests = make_requests(a.dataset, tok, max(counts), a.input_len, a.output_len, range_ratio=a.range_ratio,
                             prompt_format=a.prompt_format, prefix_len=a.prefix_len, dataset_path=a.dataset_path,
                             seed=a.seed, num_prefixes=a.num_prefixes)
    if a.lora_modules:
        requests = [dataclasses.replace(r, model=a.lora_modules[i % len(a.lora_modules)])
                    for i, r in enumerate(requests)]
    eos = sorted({t for t in [tok.eos_token_id] if t is not None}) if a.eos_logit_bias else []
    cfg = ClientConfig(base_url=base_url, model=model, endpoint=a.endpoint, api_key=a.api_key,
                       temperature=a.temperature, ignore_eos=a.ignore_eos, eos_logit_bias=eos,
                       sampling={k: v for k, v in (("top_p", a.top_p), ("top_k", a.top_k), ("min_p", a.min_p))
                                 if v is not None},
                       extra_body=a.extra_body or {}, timeout_s=a.timeout)
    if a.num_warmups:
        asyncio.run(warm_up(cfg, requests[0], a.num_warmups))
    points = []
    for load, count in zip(loads, counts):
        desc = "requests" if not sweep else f"c={load.max_concurrency}" if a.sweep_over == "concurrency" else \
            f"rate={load.request_rate:g}"
        point = run_point(cfg, requests[:count], load, a.slo_ms, use_tqdm=not a.disable_tqdm, desc=desc)
        title = f"{a.label or model} {desc if sweep else ''}".strip()
        print(format_summary(point, title), flush=True)
        points.append(point)
    result = {"benchmark": "serve", "label": a.label or model, "base_url": base_url, "model": model,
              "endpoint": a.endpoint, "dataset": a.dataset, "input_len": a.input_len, "output_len": a.output_len,
              "range_ratio": a.range_ratio, "prompt_format": a.prompt_format, "num_prompts": a.num_prompts,
              "ignore_eos": a.ignore_eos, "lora_modules": a.lora_modules, "sweep_over": a.sweep_over if sweep else None,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "points": points}
    _write_json(a.result_json, result)
    if a.plot:
        from rivulet.bench.plot import plot_results

        plot_results([result], [result["label"]], a.plot)
        print(f"wrote {a.plot}", file=sys.stderr)
    return 0


def cmd_bench_throughput(a: argparse.Namespace) -> int:
    from rivulet.bench.offline import run_throughput

    _check_writable(a.result_json, "--result-json")

    backends = [b.strip() for b in a.backend.split(",") if b.strip()]
    result = run_throughput(a.model, backends, [a.dtype], a.num_prompts, a.input_len, a.output_len, a.seed,
                            log=lambda r: print(json.dumps(r), flush=True), **_llm_kwargs(a))
    _write_json(a.result_json, result)
    return 0


def cmd_bench_latency(a: argparse.Namespace) -> int:
    from rivulet.bench.offline import run_latency

    _check_writable(a.result_json, "--result-json")

    result = run_latency(a.model, a.dtype, a.input_len, a.output_len, a.num_iters, a.num_iters_warmup, a.profile,
                         a.seed, log=lambda r: print(json.dumps(r, indent=2), flush=True), **_llm_kwargs(a))
    _write_json(a.result_json, result)
    return 0


def cmd_bench_plot(a: argparse.Namespace) -> int:
    from rivulet.bench.plot import plot_files

    plot_files(a.results, a.output, a.label)
    print(f"wrote {a.output}", file=sys.stderr)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    return {"serve": cmd_bench_serve, "throughput": cmd_bench_throughput, "latency": cmd_bench_latency,
            "plot": cmd_bench_plot}[a.bench_command](a)
