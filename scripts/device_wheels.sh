#!/usr/bin/env bash
# Wheels for a lent GPU machine (Python 3.12, torch, Triton and transformers already there, no
# package index): msgspec for the engine, and for the Ray steps of scripts/gpu_check.sh a Ray
# wheel without its Java jars, dashboard client and libraries specmoe does not import (79 -> 42
# MB) plus the Ray core, Ray Serve and OpenTelemetry dependencies that machine lacks: ~47 MB, which
# with the repository (~18 MB) just fits the 64 MiB a call may carry. Writes .whl/ (git-ignored
# through .git/info/exclude).
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
# Ray Serve's web stack (the HTTP test of the GPU tier; tried with Python 3.12 here: a Serve app answered)
download "$OUT" fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 aiohttp-cors==0.8.1 colorful==0.5.8 \
    opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 smart-open==9.0.4 watchfiles==1.3.0 \
    grpcio-reflection==1.85.1
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
