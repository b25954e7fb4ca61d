"""The ingress app adds no trace of its own beside specmoe's: FastAPI >= 0.165 traces requests on
OpenTelemetry's global tracer provider, which tracing installs in the ingress replica, and its spans
were a second trace per request (found by an operator's trial with a live collector)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A fresh process: the global tracer provider can be set only once per process.
_SCRIPT = """
import asyncio, json
import httpx
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)  # as setup_tracing does in the ingress replica

from actors.ingress import app

@app.get("/probe")
async def probe():
    with trace.get_tracer("test").start_as_current_span("the route's own span"):
        return {"ok": True}

async def main():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.get("/probe")).status_code == 200
        assert (await client.get("/no-such-route")).status_code == 404

asyncio.run(main())
print(json.dumps(sorted(s.name for s in exporter.get_finished_spans())))
"""


def test_the_ingress_app_makes_no_spans_of_its_own_under_a_global_tracer_provider():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # Only what the route itself records (the exporter works); FastAPI's "GET /probe",
    # "fastapi.endpoint", ... were exported besides it.
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["the route's own span"]
