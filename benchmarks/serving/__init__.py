"""Serving benchmark for OpenAI-compatible streaming endpoints (the library behind ``benchmarks/serve.py``).

Modules:

- ``dataset``: JSONL prompts and deterministic request sampling.
- ``client``: one streaming request (SSE parsing, timestamps, failures) and ``/metrics`` scraping.
- ``loadgen``: fixed-concurrency and Gamma/Poisson load shapes (per-class arrivals), warm-up, time limits.
- ``metrics``: pure latency/throughput metric functions (TTFT, TPOT, ITL, e2e, percentiles).
- ``goodput``: SLOs (``--goodput``, ``--slo-file``), goodput and per-class SLO attainment.
- ``acceptance``: speculative-decoding acceptance from Prometheus counter deltas.
- ``sweep``: server configurations (running or started by command) x concurrency or request-rate
  sweeps, ratios.
- ``report``: printed tables and the JSON result.
- ``plots``: PNG figures (matplotlib, imported lazily).
"""
