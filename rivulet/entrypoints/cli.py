"""`rivulet` command line: serve (OpenAI-compatible HTTP server), generate (batch of prompts), chat
(interactive, streaming) and bench (benchmarks, `rivulet/bench/`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any

from rivulet.config import RivuletError


def _engine_args(p: argparse.ArgumentParser) -> None:
    from rivulet.engine.args import EngineArgs

    EngineArgs.add_cli_args(p)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _serve_args(p: argparse.ArgumentParser) -> None:
    """The OpenAI server's own flags (vLLM's names)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: --model); the first appears in responses")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API endpoints")
    p.add_argument("--max-queue", type=int, default=None,
                   help="answer 503 once max-num-seqs + this many requests are unfinished (default: no limit)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let requests in flight finish before closing them")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file or text) used in place of the model's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\": tool calls parsed from the answer by --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="the tool-call format of the model: hermes (Qwen2.5/3, Hermes), llama3_json, mistral")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="put a reasoning model's <think>...</think> in message.reasoning_content")
    p.add_argument("--data-parallel-policy", default="cache_aware",
                   choices=["cache_aware", "round_robin", "power_of_two", "consistent_hash"],
                   help="with --data-parallel-size: which replica takes a request")
    p.add_argument("--max-engine-restarts", type=int, default=3,
                   help="restart a dead engine up to this many times per 10 minutes, then exit 1")
    p.add_argument("--engine-watchdog-s", type=float, default=300.0,
                   help="kill and restart an engine that has work but sent nothing for this long")
    p.add_argument("--max-request-bytes", type=int, default=32 << 20,
                   help="answer 413 to request bodies larger than this (default 32 MiB)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="with --enable-lora: LoRA adapters (PEFT folders) served as models of these names, as "
                        "name=path or JSON {\"name\": ..., \"path\": ...}")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a generation request not done this long after it arrived: 408, or an error event "
                        "ending its stream (default: no limit)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces of requests to this OTLP/HTTP collector, e.g. "
                        "http://127.0.0.1:4318/v1/traces (default: no traces)")
    p.add_argument("--log-requests", action="store_true",
                   help="log one JSON line per finished request (ids, model, token counts, latencies; no text)")
    p.add_argument("--log-request-text", action="store_true",
                   help="with --log-requests: put the prompt and output text in the lines too")
    p.add_argument("--config", default=None, metavar="DEPLOY.YAML",
                   help="serve several models, each in its own engine, from a deployment file (docs/pipelines.md); "
                        "engine arguments then go in the file")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rivulet", description="Rivulet LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete prompts offline and print the results")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompts-file", default=None, help="JSONL: one string or {'prompt': ...} per line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user message")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _engine_args(g)
    _sampling_args(g)
    c = sub.add_parser("chat", help="talk to the model in the terminal, streaming the replies")
    c.add_argument("--system", default=None, help="system prompt")
    _engine_args(c)
    _sampling_args(c)
    c.set_defaults(max_tokens=512, temperature=0.7)
    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    s.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    _engine_args(s)
    _serve_args(s)
    from rivulet.bench.cli import add_bench_parser
    from rivulet.router.cli import add_router_args

    add_bench_parser(sub)
    add_router_args(sub.add_parser("router", help="route OpenAI requests over many servers (replicas)"))
    from rivulet.plan.cli import add_plan_args

    add_plan_args(sub.add_parser("plan", help="predict and rank the parallel layouts of a model on a cluster"))
    return parser


def _make_llm(a: argparse.Namespace) -> Any:
    from rivulet.engine.args import EngineArgs
    from rivulet.engine.llm import LLM

    args = EngineArgs.from_cli_args(a)
    return LLM(**dataclasses.asdict(args))


def _params(a: argparse.Namespace) -> Any:
    from rivulet.sampling_params import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.sampling_seed,
                          stop=a.stop, ignore_eos=a.ignore_eos)


def _read_prompts(a: argparse.Namespace) -> list[str]:
    prompts = list(a.prompt)
    if a.prompts_file:
        try:
            with open(a.prompts_file) as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        item = json.loads(line)
                        prompts.append(item if isinstance(item, str) else item["prompt"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise RivuletError(f"cannot read prompts from {a.prompts_file}: {e}") from None
    if not prompts:
        raise RivuletError("no prompt given: use --prompt TEXT or --prompts-file FILE")
    return prompts


def cmd_generate(a: argparse.Namespace) -> None:
    prompts = _read_prompts(a)
    params = _params(a)
    llm = _make_llm(a)
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        if a.json:
            print(json.dumps({"prompt": p, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
        elif len(prompts) == 1:
            print(c.text)
        else:
            print(f"--- {p!r}\n{c.text}")


def cmd_chat(a: argparse.Namespace) -> None:
    llm = _make_llm(a)
    engine, params = llm.engine, _params(a)
    history: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    print("Type a message (Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = engine.tokenizer(text, add_special_tokens=False).input_ids
        rid = engine.add_request(None, ids, params)
        shown = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    reply = out.outputs[0].text
                    print(reply[shown:], end="", flush=True)
                    shown = len(reply)
        print()
        history.append({"role": "assistant", "content": reply})


def cmd_serve(a: argparse.Namespace) -> int:
    from rivulet.entrypoints.openai.launch import run_server

    if a.model_tag is not None:
        a.model = a.model_tag
    return run_server(a)


def cmd_router(a: argparse.Namespace) -> int:
    from rivulet.router.app import build_router, run_router

    try:
        router = build_router(a)
    except ValueError as e:
        raise RivuletError(str(e)) from None
    return run_router(router, a)


def cmd_bench(a: argparse.Namespace) -> int:
    from rivulet.bench.cli import cmd_bench as run

    return run(a)


def cmd_plan(a: argparse.Namespace) -> int:
    from rivulet.plan.cli import cmd_plan as run

    return run(a)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    a = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("rivulet: %(message)s"))
    log = logging.getLogger("rivulet")
    log.handlers = [handler]
    log.setLevel(logging.INFO)
    lines = logging.StreamHandler(sys.stderr)  # --log-requests: bare JSON lines, for log shippers
    lines.setFormatter(logging.Formatter("%(message)s"))
    requests_log = logging.getLogger("rivulet.requests")
    requests_log.handlers, requests_log.propagate = [lines], False
    try:
        code = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench,
                "router": cmd_router, "plan": cmd_plan}[a.command](a)
    except RivuletError as e:
        print(f"rivulet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
