#!/usr/bin/env bash
# Every benchmark of docs/BENCHMARKS.md in one go, one after another (never concurrently: they
# share the machine). Results land in benchmarks/results/ (ignored by git); plots in docs/img/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=benchmarks/results
mkdir -p "$OUT" docs/img
$PY benchmarks/engine.py --num-prompts 24 --max-tokens 64 --save-result $OUT/engine.json 2>&1 | tee $OUT/engine.log
$PY benchmarks/serve_vs_engine.py --num-prompts 16 --max-tokens 48 --save-result $OUT/serve_vs_engine.json 2>&1 | tee $OUT/serve_vs_engine.log
$PY benchmarks/speculation.py --batches 1,4,8,16 --num-prompts 16 --max-tokens 64 --repeats 3 --save-result $OUT/speculation.json 2>&1 | tee $OUT/speculation.log
$PY benchmarks/interference.py --duration-s 12 --budgets 64,128,256 --tpot-ms 20,30 --save-result $OUT/interference.json 2>&1 | tee $OUT/interference.log
$PY benchmarks/goodput_mix.py --rates 0.5,1,2 --num-requests 40 --slo-file configs/slo_goodput.yaml \
    --save-result $OUT/goodput_mix.json --plot docs/img 2>&1 | tee $OUT/goodput_mix.log
$PY benchmarks/hedging.py --repeats 3 --save-result $OUT/hedging.json 2>&1 | tee $OUT/hedging.log
$PY benchmarks/hedging.py --repeats 3 --transport actor_calls --save-result $OUT/hedging_calls.json 2>&1 | tee $OUT/hedging_calls.log
$PY benchmarks/replication.py --repeats 3 --save-result $OUT/replication.json 2>&1 | tee $OUT/replication.log
$PY benchmarks/hedging.py --repeats 3 --flip-s 0.5 --save-result $OUT/hedging_flip.json 2>&1 | tee $OUT/hedging_flip.log
$PY benchmarks/soak.py --duration-s 1200 --save-result $OUT/soak.json 2>&1 | tee $OUT/soak.log
$PY benchmarks/tracing_overhead.py --num-requests 32 --concurrency 4 --max-tokens 48 --save-result $OUT/tracing.json 2>&1 | tee $OUT/tracing.log
$PY benchmarks/serve.py --sweep --config-file configs/sweep.yaml \
    --configs speculation_off,draft_k1,draft_k2,draft_k4,draft_k6,draft_k8,adaptive_k8,ngram_k4 --baseline speculation_off \
    --concurrency-list 1,2,4,8,16 --num-requests 16 --max-tokens 48 --ignore-eos --no-progress \
    --save-result $OUT/sweep.json --plot docs/img 2>&1 | tee $OUT/sweep.log
