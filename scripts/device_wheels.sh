#!/usr/bin/env bash
# Wheels for a lent GPU machine (Python 3.12, torch, Triton and transformers already there, no
# package index): msgspec for the engine, and for the Ray steps of scripts/gpu_check.sh a Ray
# wheel without its Java jars, dashboard client and libraries specmoe does not import (79 -> 42
# MB, so it fits the 64 MiB a call may carry) plus the Ray core and OpenTelemetry dependencies
# that machine lacks. Writes .whl/ (git-ignored through .git/info/exclude). Ray Serve's web stack
# (fastapi, uvicorn, pydantic, ...) does not fit as well, so tests/gpu/test_http_cuda.py stays out.
#
#   scripts/device_wheels.sh && grep -qxF /.whl/ .git/info/exclude || echo /.whl/ >> .git/info/exclude
#   then, on the device: pip install --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
OUT=${OUT:-.whl}
RAY=${RAY:-2.60.0}
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$1" "${@:2}"
}
download "$OUT" msgspec==0.23.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2 \
    opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
    googleapis-common-protos==1.76.0
download "$tmp" "ray==$RAY"
(cd "$tmp" && unzip -q ray-*.whl && rm ray-*.whl \
    && rm -rf ray/jars ray/dashboard/client ray/rllib ray/data ray/llm ray/tune/examples ray/train/examples \
    && python3 - "ray-$RAY.dist-info/RECORD" <<'PY'
import os, sys
# The RECORD must list only files the wheel still holds.
record = sys.argv[1]
lines = [line for line in open(record) if os.path.exists(line.split(",")[0]) or line.startswith(record)]
open(record, "w").writelines(lines)
PY
)
rm -f "$OUT"/ray-*.whl
(cd "$tmp" && zip -q -r -9 "ray-$RAY-cp312-cp312-manylinux2014_x86_64.whl" ray "ray-$RAY.dist-info")
mv "$tmp"/ray-*.whl "$OUT"/
du -sh "$OUT"
