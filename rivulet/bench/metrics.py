"""Per-request timings and their summary: TTFT, TPOT, inter-token latency, end-to-end latency, throughput,
goodput under SLOs. Times are seconds inside, milliseconds in the summaries (vLLM's `*_ms` names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from rivulet.config import RivuletError

PERCENTILES: tuple[int, ...] = (50, 90, 99)
SLO_KEYS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it. `itl` holds the gaps between consecutive content chunks (s)."""

    success: bool = False
    prompt_len: int = 0  # what the server reported in usage, else what the client computed
    output_tokens: int = 0  # usage.completion_tokens if the server sent it, else the content chunks counted
    ttft: float = 0.0  # request sent -> first content chunk
    latency: float = 0.0  # request sent -> last byte
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # perf_counter when sent, relative to the start of the run
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for single-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_slo(spec: str | None) -> dict[str, float]:
    """'ttft=500,tpot=50' -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); a RivuletError when malformed."""
    if not spec:
        return {}
    out: dict[str, float] = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise RivuletError(f"bad --slo {spec!r}: expected KEY=MS pairs with KEY in {', '.join(SLO_KEYS)}, "
                               "e.g. ttft=500,tpot=50")
        try:
            ms = float(value)
        except ValueError:
            raise RivuletError(f"bad --slo {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise RivuletError(f"bad --slo {spec!r}: {key} must be > 0 ms")
        out[key] = ms
    return out


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """A successful request within every given SLO (a request with no TPOT meets any TPOT SLO)."""
    if not r.success:
        return False
    if "ttft" in slo and r.ttft * 1000 > slo["ttft"]:
        return False
    tpot = r.tpot
    if "tpot" in slo and tpot is not None and tpot * 1000 > slo["tpot"]:
        return False
    return not ("e2el" in slo and r.latency * 1000 > slo["e2el"])


def distribution(name: str, values_s: Sequence[float], percentiles: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """{mean_NAME_ms, median_NAME_ms, std_NAME_ms, pXX_NAME_ms} of values in seconds (0.0 when empty)."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(a.mean()) if a.size else 0.0,
           f"median_{name}_ms": float(np.median(a)) if a.size else 0.0,
           f"std_{name}_ms": float(a.std()) if a.size else 0.0}
    for p in percentiles:
        out[f"p{p}_{name}_ms"] = float(np.percentile(a, p)) if a.size else 0.0
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, slo: dict[str, float] | None = None,
              max_errors: int = 5) -> dict[str, Any]:
    """The benchmark's numbers over successful requests; throughput divides by the run's wall time."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "errors": [r.error for r in failed[:max_errors]],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    out.update(distribution("ttft", [r.ttft for r in ok]))
    out.update(distribution("tpot", [t for r in ok if (t := r.tpot) is not None]))
    out.update(distribution("itl", [x for r in ok for x in r.itl]))
    out.update(distribution("e2el", [r.latency for r in ok]))
    if slo:
        good = sum(meets_slo(r, slo) for r in ok)
        out["slo"] = dict(slo)
        out["good_requests"] = good
        out["request_goodput"] = good / duration_s
    return out


def format_summary(s: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A fixed-width text table of a summary, like vLLM's benchmark_serving."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value: Any) -> None:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{v:>16}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if "request_goodput" in s:
        row("Request goodput (req/s):", s["request_goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + label + ' ':-^60}")
        row(f"Mean {name.upper()} (ms):", s[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", s[f"median_{name}_ms"])
        for p in PERCENTILES[1:]:
            row(f"P{p} {name.upper()} (ms):", s[f"p{p}_{name}_ms"])
    if "prefix_cache" in s:
        d = s["prefix_cache"]
        lines.append(f"{' Prefix Cache ':-^60}")
        row("Queried tokens:", d["queries"])
        row("Hit tokens:", d["hits"])
        row("Hit rate (%):", 100.0 * d["hit_rate"])
        for k in sorted(k for k in d if k.startswith("tier_hits_")):
            row(f"KV tier hits, {k.removeprefix('tier_hits_')} (blocks):", d[k])
    if "spec_decode" in s:
        d = s["spec_decode"]
        lines.append(f"{' Speculative Decoding ':-^60}")
        row("Drafts:", d["num_drafts"])
        row("Draft tokens:", d["num_draft_tokens"])
        row("Accepted tokens:", d["num_accepted_tokens"])
        row("Acceptance rate (%):", 100.0 * d["acceptance_rate"])
        row("Acceptance length (tokens per step):", d["mean_acceptance_length"])
    for e in s.get("errors", []):
        lines.append(f"error: {e}")
    lines.append("=" * 60)
    return "\n".join(lines)
