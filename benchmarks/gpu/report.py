"""The GPU check's summary table (markdown) from its merged JSON results."""

from __future__ import annotations

from typing import Any


def _f(x: Any, digits: int = 1) -> str:
    if x is None or x == "":
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 10 ** -digits or abs(x) >= 1e6):
            return f"{x:.2e}"
        return f"{x:.{digits}f}"
    return str(x)


def _status(sec: dict[str, Any] | None) -> str:
    if not sec:
        return "not run"
    s = sec.get("status", "?")
    extra = sec.get("reason") or (sec.get("error", "").strip().splitlines() or [""])[-1]
    return f"{s}" + (f" ({extra[:160]})" if extra and s != "ok" else "")


def _ceilings(c: dict[str, Any]) -> list[str]:
    return ["## Ceilings", "", "| measure | value |", "|---|---|",
            f"| HBM copy bandwidth (read+write, {_f(c.get('copy_bytes', 0) / 2**30, 2)} GiB) | "
            f"{_f(c.get('copy_gbps'))} GB/s |",
            f"| {c.get('matmul_dtype', 'bf16')} matmul {c.get('matmul_n', '?')}^3 | "
            f"{_f(c.get('matmul_tflops'))} TFLOP/s |",
            ""]


def _kernels(rows: list[dict[str, Any]], c: dict[str, Any]) -> list[str]:
    bw, fl = c.get("copy_gbps"), c.get("matmul_tflops")
    lines = ["## Triton kernels vs PyTorch references", "",
             "Error: max |Triton - reference in float32| / max |reference|. Bandwidth counts the bytes the op "
             "must move (inputs read + outputs written); whichever of bandwidth or compute is the closer "
             "ceiling is the kernel's bound.", "",
             "| kernel | shape | dtype | rel err | tol | result | Triton ms | ref ms | speedup | GB/s | % copy BW "
             "| TFLOP/s | % matmul |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r and "ms" not in r:
            err = r["error"].strip().splitlines()[-1][:120].replace("|", "/")
            lines.append(f"| {r.get('kernel')} | {r.get('shape', '-')} | {r.get('dtype', '-')} | - | - | "
                         f"ERROR: {err} | - | - | - | - | - | - | - |")
            continue
        ms, ref_ms = r.get("ms"), r.get("ref_ms")
        gbps = r["bytes"] / (ms / 1e3) / 1e9 if ms and r.get("bytes") else None
        tflops = r["flops"] / (ms / 1e3) / 1e12 if ms and r.get("flops") else None
        result = "pass" if r.get("passed") else "FAIL"
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {_f(r.get('rel_err'), 4)} | {_f(r.get('tol'), 4)} | "
            f"{result} | {_f(ms, 3)} | {_f(ref_ms, 3)} | {_f(ref_ms / ms if ms and ref_ms else None)}x | "
            f"{_f(gbps)} | {_f(100 * gbps / bw if gbps and bw else None)} | {_f(tflops)} | "
            f"{_f(100 * tflops / fl if tflops and fl else None)} |")
    return lines + [""]


def _model(m: dict[str, Any], c: dict[str, Any]) -> list[str]:
    cfg = m.get("config", {})
    lines = ["## Model: Llama-3-8B shape, dummy weights", "",
             f"hidden {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers, "
             f"{cfg.get('num_attention_heads')} heads / {cfg.get('num_key_value_heads')} KV heads, "
             f"intermediate {cfg.get('intermediate_size')}, vocab {cfg.get('vocab_size')}", "",
             "| step | status |", "|---|---|"]
    for step in ("hf_build", "rivulet_build", "copy_weights", "logits_vs_hf", "decode_b1", "decode_profile",
                 "generate_b1", "throughput", "throughput_sync", "hf_generate", "structured", "spec_decode",
                 "throughput_long", "compiled"):
        lines.append(f"| {step} | {_status(m.get(step))} |")
    lines.append("")
    b = m.get("rivulet_build", {})
    if b.get("status") == "ok":
        lines += [f"Weights {_f(b['weight_bytes'] / 1e9, 2)} GB; CUDA graphs: {_f(b.get('cuda_graphs'))} "
                  f"(buckets {b.get('graph_buckets')}, captured in {_f(b.get('graph_capture_s'))} s); "
                  f"KV blocks {b.get('num_kv_blocks')}; built in {_f(b.get('elapsed_s'))} s."
                  + (f" Graph capture failed: {b['cuda_graph_error'][:300]}" if b.get("cuda_graph_error") else ""), ""]
    lv = m.get("logits_vs_hf", {})
    if lv.get("status") == "ok":
        lines += [f"Logits vs transformers (32-token prompt, same weights): max |diff| {_f(lv['max_abs_diff'], 3)} "
                  f"(max |logit| {_f(lv['max_abs_logit'], 2)}), min cosine {_f(lv['min_cosine'], 5)}, top-1 agreement "
                  f"{_f(100 * lv['top1_agreement'])}% -> {'pass' if lv.get('passed') else 'FAIL'}.", ""]
    d = m.get("decode_b1", {})
    if d.get("status") == "ok":
        bw = c.get("copy_gbps")
        bound = bw * 1e9 / d["bytes_per_step"] if bw and d.get("bytes_per_step") else None
        lines += ["### Batch-1 decode (model runner, greedy)", "",
                  f"Bandwidth bound: {_f(bound)} tok/s = copy bandwidth / {_f(d.get('bytes_per_step', 0) / 1e9, 2)} GB "
                  "read per token (weights + KV).", "",
                  "| mode | tok/s | ms/token | % of bound |", "|---|---|---|---|"]
        co = m.get("compiled", {})
        compiled_mode = "compiled -O2 + graphs" if co.get("cuda_graphs") else "compiled -O2, no graphs"
        for mode, v in (("eager", d.get("eager_tok_s")), ("graphs", d.get("graphs_tok_s")),
                        (compiled_mode, co.get("graphs_tok_s") if co.get("status") == "ok" else None)):
            if v:
                lines.append(f"| {mode} | {_f(v)} | {_f(1e3 / v, 2)} | {_f(100 * v / bound if bound else None)} |")
        if co.get("status") == "ok":
            lines += ["", f"Compiled (-O2): graphs {co.get('compiled')} compiled, {co.get('loaded')} loaded, and CUDA "
                      f"graphs {'captured' if co.get('cuda_graphs') else 'NOT captured'} in "
                      f"{_f(co.get('compile_and_capture_s'))} s; fusions {co.get('fusions')}; fallbacks "
                      f"{co.get('fallbacks')}; batch-1 tokens equal eager: {_f(co.get('tokens_equal_eager'))}."
                      + (f" Capture failed: {co['cuda_graph_error'][:300]}" if co.get("cuda_graph_error") else "")]
        if "graph_tokens_equal_eager" in d:
            lines.append("")
            lines.append(f"Greedy tokens with graphs identical to eager: {_f(d['graph_tokens_equal_eager'])}.")
        lines.append("")
    prof = m.get("decode_profile", {})
    if prof.get("status") == "ok":
        runs = [v for k, v in prof.items() if k.startswith("b") and isinstance(v, dict) and "batch" in v]
        lines += ["### Where a decode step goes (model runner with hand-made batches, built from lists: more host "
                  "time than the engine's vectorized gather; device ms between events around each forward, kernel ms "
                  "from torch.profiler)", "",
                  "| batch | context | graphs | wall ms/step | device ms/step | kernel ms/step | host share |",
                  "|---|---|---|---|---|---|---|"]
        for r in runs:
            dev = r.get("device_ms_per_step")
            host = f"{100 * (1 - dev / r['wall_ms_per_step']):.0f}%" if dev else "-"
            lines.append(f"| {r['batch']} | {r['context']} | {_f(r['graphs'])} | {_f(r['wall_ms_per_step'], 3)} | "
                         f"{_f(dev, 3)} | {_f(r.get('kernel_ms_per_step'), 3)} | {host} |")
        eng = prof.get("engine_b1")
        if eng and eng.get("kernel_ms_per_token"):
            w, k = eng["wall_ms_per_token"], eng["kernel_ms_per_token"]
            lines += ["", f"The engine at batch 1 (`LLM.generate`, async scheduling {_f(eng['async_scheduling'])}, "
                      f"{eng['output_len']} tokens): {_f(w, 3)} ms per token, of which kernels {_f(k, 3)} ms: "
                      f"host share {100 * (1 - k / w):.0f}%."]
        for r in runs:
            lines += ["", f"Top kernels at batch {r['batch']} (ms per step, calls per step): " + "; ".join(
                f"`{k['name'][:60]}` {_f(k['ms_per_step'], 3)} x{k['calls_per_step']}" for k in r["top"][:8])]
        lines.append("")
    rows = []
    g1 = m.get("generate_b1", {})
    if g1.get("status") == "ok":
        for mode in ("eager", "graphs", "graphs_sync"):
            if mode in g1:
                rows.append((f"Rivulet LLM.generate ({mode.replace('_', ', ')})", g1[mode]))
    for key, label in (("throughput", "Rivulet LLM.generate"), ("throughput_sync", "Rivulet LLM.generate (sync loop)"),
                       ("throughput_long", "Rivulet LLM.generate (long)")):
        if m.get(key, {}).get("status") == "ok":
            rows.append((label, m[key]))
    if m.get("compiled", {}).get("status") == "ok" and "throughput" in m["compiled"]:
        rows.append((f"Rivulet LLM.generate (-O2{' + graphs' if m['compiled'].get('cuda_graphs') else ''})",
                     m["compiled"]["throughput"]))
    hf = m.get("hf_generate", {})
    if hf.get("status") == "ok":
        rows += [("transformers generate", hf["batch"]), ("transformers generate", hf["b1"])]
    if rows:
        lines += ["### Generation (greedy, ignore_eos, random prompt ids)", "",
                  "| system | requests x in/out | output tok/s | total tok/s | elapsed s |", "|---|---|---|---|---|"]
        for label, r in rows:
            lines.append(f"| {label} | {r['requests']} x {r['input_len']}/{r['output_len']} | "
                         f"{_f(r['output_tok_s'])} | {_f(r['total_tok_s'])} | {_f(r['elapsed_s'], 2)} |")
        lines.append("")
    st = m.get("structured", {})
    if st.get("status") == "ok":
        lines += [f"### Structured output ({st['requests']} requests, JSON schema vs free, up to {st['max_tokens']} "
                  "tokens; a step per token of the longest answer)", "",
                  "| scheduling | mode | ms/step | steps | constrained answers finished / valid |", "|---|---|---|---|---|"]
        for sched in ("async", "sync"):
            for mode, r in st.get(sched, {}).items():
                if isinstance(r, dict):
                    fin = f"{r['finished']} / {r['valid']}" if "finished" in r else "-"
                    lines.append(f"| {sched} | {mode} | {_f(r['ms_per_step'], 2)} | {r['steps']} | {fin} |")
        lines.append("")
    sd = m.get("spec_decode", {})
    if sd.get("status") == "ok":
        lines += [f"### Speculative decoding (dummy weights: acceptance comes from greedy loops; draft = this shape "
                  f"with {sd['draft_layers']} layers)", "",
                  f"| config | 1 stream tok/s | speedup | acceptance | tokens per verify | {sd['streams']} streams tok/s "
                  "| speedup | graphs (query lengths) | tokens = plain |", "|---|---|---|---|---|---|---|---|---|"]
        for name in ("plain", "ngram", "draft"):
            r = sd.get(name)
            if isinstance(r, dict):
                b1 = r["b1"]
                lines.append(f"| {name} | {_f(b1['output_tok_s'])} | {_f(r.get('speedup_b1'), 2)} | "
                             f"{_f(b1.get('acceptance_rate'), 2)} | {_f(b1.get('tokens_per_verify'), 2)} | "
                             f"{_f(r['many']['output_tok_s'])} | {_f(r.get('speedup_many'), 2)} | "
                             f"{r.get('graph_query_lens')} | {_f(r.get('tokens_equal_plain'))} |")
        lines.append("")
    return lines


def _errors(results: dict[str, Any]) -> list[str]:
    out = []
    for name, sec in results.get("sections", {}).items():
        if sec.get("error"):
            out.append(f"**{name}**\n```\n{sec['error'].strip()}\n```")
        for key, step in sec.items():
            if isinstance(step, dict) and step.get("error"):
                out.append(f"**{name}/{key}**\n```\n{step['error'].strip()}\n```")
        for r in sec.get("rows", []):
            if r.get("error"):
                out.append(f"**{name}/{r.get('kernel')}**\n```\n{r['error'].strip()}\n```")
    return ["## Errors", ""] + out + [""] if out else []


def render(results: dict[str, Any]) -> str:
    meta = results.get("meta", {})
    secs = results.get("sections", {})
    c = secs.get("ceilings", {})
    lines = [f"# Rivulet GPU check{' (DRY RUN: CPU, tiny sizes)' if meta.get('dry_run') else ''}", "",
             f"{meta.get('device', '?')}; torch {meta.get('torch')}, triton {meta.get('triton')}, transformers "
             f"{meta.get('transformers')}; commit {meta.get('commit')}; {meta.get('date')}; "
             f"{_f(meta.get('elapsed_s'))} s of a {meta.get('budget_s')} s budget.", "",
             "| section | status | seconds |", "|---|---|---|"]
    for name in meta.get("sections", list(secs)):
        sec = secs.get(name)
        lines.append(f"| {name} | {_status(sec)} | {_f((sec or {}).get('elapsed_s'))} |")
    lines.append("")
    if c.get("copy_gbps") or c.get("matmul_tflops"):
        lines += _ceilings(c)
    if secs.get("kernels", {}).get("rows"):
        lines += _kernels(secs["kernels"]["rows"], c)
    if secs.get("model"):
        lines += _model(secs["model"], c)
    pt = secs.get("pytest", {})
    if pt.get("output_tail"):
        lines += ["## pytest tests/kernels on the GPU", "", "```", pt["output_tail"].strip()[-3000:], "```", ""]
    lines += _errors(results)
    return "\n".join(lines) + "\n"
