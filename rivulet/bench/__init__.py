"""`rivulet bench`: load generation against any OpenAI-compatible server (`serve`), offline throughput and
single-request latency through the engine in-process (`throughput`, `latency`), and plots of sweeps (`plot`).

Modules: `datasets` (prompts of exact token counts), `metrics` (TTFT/TPOT/ITL/E2EL summaries, goodput),
`serve` (the async HTTP client and load generator), `offline` (throughput and latency), `plot` (matplotlib,
imported lazily), `cli` (the argument parsers and commands).
"""
