#!/usr/bin/env bash
# The device checks in one call, each step under its own time limit: the GPU test tier, the kernel
# benchmark, the engine on CUDA with Mixtral-shaped random weights against transformers, expert
# offload from pinned host memory at that size, and one MoE layer's hop to expert actors holding
# those weights on the GPU. Logs go to $OUT (default runs/gpu); each step's tail is printed.
#
#   PY=python3 OUT=/tmp/gpu scripts/gpu_check.sh
#
# On a machine without msgspec or Ray (the lent H200's image), carry the wheels that
# scripts/device_wheels.sh writes to .whl/ and start with
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -u
OUT=${OUT:-runs/gpu}
PY=${PY:-python3}
CKPT=${CKPT:-/tmp/mixtral-shaped}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

STEPS=${STEPS:-gpu_tier,kernels,engine_cuda,offload_cuda,transport_cuda}  # which steps to run

step() {  # step NAME LIMIT_S COMMAND...: run with a limit, log to $OUT/NAME.log, print its tail
    local name=$1 limit=$2 t0 rc
    shift 2
    [[ ",$STEPS," == *",$name,"* ]] || return 0
    t0=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "=== $name: rc $rc in $(($(date +%s) - t0)) s (limit $limit s)"
    tail -n "${TAIL:-30}" "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
step gpu_tier "${GPU_TIER_S:-200}" $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider --timeout=150
step kernels "${KERNELS_S:-60}" $PY benchmarks/kernels.py --quick
step engine_cuda "${ENGINE_S:-240}" $PY benchmarks/engine_cuda.py --checkpoint-dir "$CKPT" \
    --configs "${CONFIGS:-plain,ngram k=4,plain compiled}" --save-result "$OUT/engine_cuda.json"
step offload_cuda "${OFFLOAD_S:-90}" $PY benchmarks/offload_cuda.py --checkpoint "$CKPT" \
    --save-result "$OUT/offload_cuda.json"
step transport_cuda "${TRANSPORT_S:-90}" $PY benchmarks/transport.py --device cuda --dtype bfloat16 \
    --checkpoint "$CKPT" --iters 100 --save-result "$OUT/transport_cuda.json"
