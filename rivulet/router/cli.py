"""``rivulet router``'s flags (sglang-router's names); argparse only, so building the CLI stays cheap."""

from __future__ import annotations

import argparse

POLICY_NAMES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin")


def add_router_args(p: argparse.ArgumentParser) -> None:
    """``rivulet router``'s flags (sglang-router's names)."""
    p.add_argument("--worker-urls", nargs="+", default=[], metavar="URL", help="the workers' base URLs")
    p.add_argument("--policy", default="cache_aware", choices=POLICY_NAMES)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="cache_aware: smallest matched fraction of a request that routes by prefix")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="cache_aware: load difference (requests) above which the least loaded worker wins")
    p.add_argument("--balance-rel-threshold", type=float, default=1.0001,
                   help="cache_aware: ... and load ratio above which it wins")
    p.add_argument("--max-tree-size", type=int, default=1 << 24, help="cache_aware: characters remembered per worker")
    p.add_argument("--eviction-interval-secs", type=float, default=60.0)
    p.add_argument("--session-header", default="X-Session-ID",
                   help="consistent_hash: the header naming the session (else the body's `user`, else the text)")
    p.add_argument("--health-check-interval-secs", type=float, default=5.0)
    p.add_argument("--health-check-timeout-secs", type=float, default=5.0)
    p.add_argument("--health-failure-threshold", type=int, default=3)
    p.add_argument("--health-success-threshold", type=int, default=2)
    p.add_argument("--health-check-endpoint", default="/health")
    p.add_argument("--retry-max-retries", type=int, default=3)
    p.add_argument("--retry-initial-backoff-ms", type=float, default=50.0)
    p.add_argument("--retry-max-backoff-ms", type=float, default=5000.0)
    p.add_argument("--retry-backoff-multiplier", type=float, default=2.0)
    p.add_argument("--retry-jitter-factor", type=float, default=0.2)
    p.add_argument("--disable-retries", action="store_true")
    p.add_argument("--max-stream-failovers", type=int, default=3, help="resumes of one stream on other workers")
    p.add_argument("--cb-failure-threshold", type=int, default=5)
    p.add_argument("--cb-timeout-duration-secs", type=float, default=30.0)
    p.add_argument("--disable-circuit-breaker", action="store_true")
    p.add_argument("--request-timeout-secs", type=float, default=1800.0,
                   help="longest wait for a worker's next byte")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
