"""Metrics math on synthetic timings: TPOT, ITL, percentiles, throughput, goodput, SLO parsing."""

from __future__ import annotations

import pytest

from rivulet.bench.metrics import RequestResult, distribution, format_summary, meets_slo, parse_slo, summarize
from rivulet.config import RivuletError


def _req(ttft: float, tpot: float, n: int, prompt: int = 10) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt, output_tokens=n, ttft=ttft, latency=ttft + tpot * (n - 1),
                         itl=[tpot] * (n - 1))


def test_tpot_excludes_the_first_token_and_needs_two_tokens():
    assert _req(0.5, 0.1, 11).tpot == pytest.approx(0.1)
    assert RequestResult(success=True, output_tokens=1, ttft=0.2, latency=0.2).tpot is None


def test_distribution_percentiles_are_linear_interpolation_in_ms():
    d = distribution("x", [i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert d["mean_x_ms"] == pytest.approx(50.5)
    assert d["median_x_ms"] == pytest.approx(50.5)
    assert d["p90_x_ms"] == pytest.approx(90.1)
    assert d["p99_x_ms"] == pytest.approx(99.01)
    assert distribution("x", [])["p99_x_ms"] == 0.0


def test_summary_counts_throughput_and_itl_over_successes_only():
    rs = [_req(0.1, 0.01, 11), _req(0.3, 0.03, 21, prompt=20),
          RequestResult(success=False, error="HTTP 500: boom", latency=0.05)]
    s = summarize(rs, duration_s=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 32
    assert s["output_throughput"] == pytest.approx(16.0)
    assert s["total_token_throughput"] == pytest.approx(31.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(20.0)
    # ITL pools every gap: 10 of 10 ms and 20 of 30 ms
    assert s["mean_itl_ms"] == pytest.approx((10 * 10 + 20 * 30) / 30)
    assert s["median_itl_ms"] == pytest.approx(30.0)
    assert s["mean_e2el_ms"] == pytest.approx((200 + 900) / 2)
    assert "request_goodput" not in s
    text = format_summary(s)
    assert "Successful requests:" in text and "error: HTTP 500: boom" in text


def test_goodput_counts_requests_within_every_slo():
    rs = [_req(0.1, 0.01, 11), _req(0.6, 0.01, 11), _req(0.1, 0.08, 11), _req(0.1, 0.04, 11)]
    slo = parse_slo("ttft=500,tpot=50")
    assert [meets_slo(r, slo) for r in rs] == [True, False, False, True]
    s = summarize(rs, duration_s=4.0, slo=slo)
    assert s["good_requests"] == 2 and s["request_goodput"] == pytest.approx(0.5)
    assert meets_slo(_req(0.1, 0.01, 11), {"e2el": 250}) and not meets_slo(_req(0.1, 0.01, 11), {"e2el": 150})
    assert not meets_slo(RequestResult(success=False), {})


@pytest.mark.parametrize("spec", ["ttft", "ttft=abc", "foo=3", "ttft=-1", "ttft=0"])
def test_bad_slo_is_a_rivulet_error(spec):
    with pytest.raises(RivuletError, match="bad --slo"):
        parse_slo(spec)


def test_slo_parsing():
    assert parse_slo(" TTFT=250 , tpot=12.5,e2el=3000") == {"ttft": 250.0, "tpot": 12.5, "e2el": 3000.0}
    assert parse_slo(None) == {}


def test_spec_decode_counters_from_rivulet_or_vllm_metrics_and_their_summary():
    from rivulet.bench.serve import parse_spec_counters, spec_decode_summary

    text = ('# HELP rivulet:spec_decode_num_drafts_total x\nrivulet:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
            'rivulet:spec_decode_num_draft_tokens_total{model_name="m"} 30.0\n'
            'rivulet:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0\n'
            'rivulet:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0\n')
    before = parse_spec_counters(text)
    assert before == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12}
    after = parse_spec_counters('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 30.0\n'
                                'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 90.0\n'
                                'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 52.0\n')
    d = spec_decode_summary(before, after)
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (20, 60, 40)
    assert d["acceptance_rate"] == pytest.approx(2 / 3) and d["mean_acceptance_length"] == pytest.approx(3.0)
    assert parse_spec_counters("rivulet:num_preemptions_total 3.0\n") is None
    assert spec_decode_summary(None, None) is None
    s = summarize([], 1.0) | {"spec_decode": d}
    assert "Acceptance length (tokens per step):" in format_summary(s)


def test_cache_counters_from_rivulet_or_vllm_metrics_and_their_summary():
    from rivulet.bench.serve import cache_summary, parse_cache_counters

    before = parse_cache_counters('rivulet:prefix_cache_queries_total{model_name="m"} 100.0\n'
                                  'rivulet:prefix_cache_hits_total{model_name="m"} 40.0\n'
                                  'rivulet:kv_tier_hits_total{model_name="m",tier="disk"} 3.0\n'
                                  'rivulet:kv_tier_hits_total{model_name="m",tier="host"} 0.0\n'
                                  'rivulet:kv_tier_misses_total{model_name="m"} 9.0\n')
    assert before == {"queries": 100, "hits": 40, "tier_hits_disk": 3, "tier_hits_host": 0}
    after = parse_cache_counters('rivulet:prefix_cache_queries_total{model_name="m"} 300.0\n'
                                 'rivulet:prefix_cache_hits_total{model_name="m"} 190.0\n'
                                 'rivulet:kv_tier_hits_total{model_name="m",tier="disk"} 8.0\n'
                                 'rivulet:kv_tier_hits_total{model_name="m",tier="host"} 2.0\n')
    d = cache_summary(before, after)
    assert d == {"queries": 200, "hits": 150, "tier_hits_disk": 5, "tier_hits_host": 2, "hit_rate": 0.75}
    vllm = parse_cache_counters('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 50.0\n'
                                'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 5.0\n')
    assert cache_summary(None, vllm) == {"queries": 50, "hits": 5, "hit_rate": 0.1}
    assert parse_cache_counters("rivulet:num_preemptions_total 3.0\n") is None and cache_summary(None, None) is None
    text = format_summary(summarize([], 1.0) | {"prefix_cache": d})
    assert "Hit rate (%):" in text and "75.00" in text and "KV tier hits, disk (blocks):" in text
