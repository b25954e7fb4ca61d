"""Sweeps: several server configurations x a list of load points (concurrencies, or request rates for
goodput vs offered load), compared against a baseline.

A configuration file (YAML or JSON) holds a list of entries (or ``{"configs": [...]}``); each has a
``name`` and either

- ``base_url``: a server that is already running, or
- ``start_cmd``: a shell command that starts one, with ``{port}`` replaced by a free port (or the
  entry's ``port``), plus optional ``ready_url`` (default ``{base_url}/health``), ``base_url``
  (default ``http://127.0.0.1:{port}``), ``cwd``, ``env`` and ``startup_timeout_s``. The sweep
  starts it in its own process group, waits until ``ready_url`` answers 200, runs its
  benchmarks, and kills the whole group afterwards.

Any entry may also set ``model`` (the request ``model`` field for that server).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from benchmarks.serving.acceptance import (
    AcceptanceMetrics,
    SpecDecodeCounters,
    acceptance_metrics,
    add_counters,
)
from benchmarks.serving.loadgen import LoadShape
from benchmarks.serving.runner import BenchmarkRun
from benchmarks.serving.server_process import free_port, launcher_command

POLL_INTERVAL_S = 0.1
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL


@dataclass(frozen=True)
class ServerConfig:
    """One server configuration of a sweep (see the module docstring for the fields)."""

    name: str
    base_url: str | None = None
    start_cmd: str | None = None
    ready_url: str | None = None
    port: int | None = None
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    model: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("every configuration needs a name")
        if self.base_url is None and self.start_cmd is None:
            raise ValueError(f"configuration {self.name!r}: give a base_url or a start_cmd")


@dataclass(frozen=True)
class SweepFailure:
    """A configuration whose server could not be started (its runs are missing from the sweep)."""

    name: str
    reason: str


def load_server_configs(path: str | Path, names: Sequence[str] | None = None) -> list[ServerConfig]:
    """Entries of a YAML/JSON configuration file, all of them or those in ``names`` (in that order).

    Raises ValueError for unknown fields, duplicate names or names not in the file, so a typo
    fails before any server is started.
    """
    text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    entries = data.get("configs") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of configurations or {{'configs': [...]}}")
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    configs: dict[str, ServerConfig] = {}
    for entry in entries:
        unknown = set(entry) - known if isinstance(entry, dict) else {"<not a mapping>"}
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {sorted(unknown)} in {entry!r}")
        config = ServerConfig(**entry)
        if config.name in configs:
            raise ValueError(f"{path}: duplicate configuration name {config.name!r}")
        configs[config.name] = config
    if names is None:
        return list(configs.values())
    missing = [n for n in names if n not in configs]
    if missing:
        raise ValueError(f"{path}: no configuration named {missing}; available: {sorted(configs)}")
    return [configs[n] for n in names]


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group started for ``proc`` and wait until every process in it has
    exited (not only ``proc``: the server shuts down after its launcher shell may have); SIGKILL
    what is left after ``grace_s`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the shell, or the group would not look empty
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(POLL_INTERVAL_S)


async def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200; RuntimeError if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before {url} was ready")
            with contextlib.suppress(httpx.HTTPError, OSError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(POLL_INTERVAL_S)
    raise RuntimeError(f"{url} not ready after {timeout_s:g} s")


@contextlib.asynccontextmanager
async def serving(config: ServerConfig, log_dir: Path) -> AsyncIterator[str]:
    """Yield the base URL of ``config``'s server, starting and finally stopping it if needed.

    The started server's stdout/stderr go to ``log_dir/<name>.log``.
    """
    if config.start_cmd is None:
        assert config.base_url is not None
        yield config.base_url.rstrip("/")
        return
    port = str(config.port or free_port())
    # str.replace, not str.format: shell commands may contain other braces (${VAR}, awk).
    base_url = (config.base_url or "http://127.0.0.1:{port}").replace("{port}", port).rstrip("/")
    ready_url = (config.ready_url or base_url + "/health").replace("{port}", port)
    log_path = log_dir / f"{config.name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            launcher_command(config.start_cmd.replace("{port}", port)),
            cwd=config.cwd,
            env={**os.environ, **config.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own process group, led by the shell (the server's signals reach it), in this
            # session: a new session is a new scheduling autogroup on Linux, and against the load
            # generator's the server's (whose graph readers spin) lost 5-15 % of its tokens at
            # concurrency 8 and 3-7x on ITL p99 (docs/TRANSPORT.md, "Draft transport"); a deployed
            # server has its machine to itself.
            process_group=0,
        )
    try:
        try:
            await wait_ready(ready_url, proc, config.startup_timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} (server log: {log_path})") from exc
        yield base_url
    finally:
        stop_process_group(proc)


RunOne = Callable[[str, ServerConfig, LoadShape], Awaitable[BenchmarkRun]]


def sweep_shapes(
    shape: LoadShape, concurrencies: Sequence[int], request_rates_per_s: Sequence[float] | None
) -> list[LoadShape]:
    """The load points of a sweep: ``shape`` at every request rate when rates are given (its
    concurrency stays a cap), else closed loops at every concurrency."""
    if request_rates_per_s:
        return [dataclasses.replace(shape, request_rate_per_s=rate) for rate in request_rates_per_s]
    return [dataclasses.replace(shape, concurrency=c) for c in concurrencies]


async def run_sweep(
    configs: Sequence[ServerConfig],
    shapes: Sequence[LoadShape],
    run_one: RunOne,
    log_dir: Path | None = None,
) -> tuple[list[BenchmarkRun], list[SweepFailure]]:
    """``run_one(base_url, config, shape)`` for every configuration and load point (``sweep_shapes``).

    Configurations run one after another (each server started only for its own runs); one that
    fails to start is recorded as a SweepFailure and the sweep goes on.
    """
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="specmoe-sweep-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[BenchmarkRun] = []
    failures: list[SweepFailure] = []
    for config in configs:
        try:
            async with serving(config, log_dir) as base_url:
                for shape in shapes:
                    runs.append(await run_one(base_url, config, shape))
        except RuntimeError as exc:
            failures.append(SweepFailure(config.name, str(exc)))
    return runs, failures


@dataclass(frozen=True)
class BaselineRatios:
    """One configuration vs the baseline at one load point: value / baseline value (None = n/a)."""

    name: str
    concurrency: int | None
    output_throughput: float | None
    itl_p50: float | None
    itl_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    request_rate_per_s: float | None = None  # the load point of a request-rate sweep


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline; None when either is missing or the baseline is 0."""
    if value is None or not baseline:
        return None
    return value / baseline


def baseline_ratios(runs: Sequence[BenchmarkRun], baseline: str) -> list[BaselineRatios]:
    """Ratios of every run against the baseline run at the same load point (concurrency and request
    rate), in run order."""
    base_by_point = {load_point(r.shape): r.metrics for r in runs if r.label == baseline}
    rows = []
    for run in runs:
        base = base_by_point.get(load_point(run.shape))
        if base is None:
            continue
        m = run.metrics
        rows.append(
            BaselineRatios(
                name=run.label,
                concurrency=run.shape.concurrency,
                output_throughput=ratio(m.output_throughput_tok_per_s, base.output_throughput_tok_per_s),
                itl_p50=ratio(m.itl.median_s, base.itl.median_s),
                itl_p99=ratio(m.itl.p99_s, base.itl.p99_s),
                tpot_p50=ratio(m.tpot.median_s, base.tpot.median_s),
                tpot_p99=ratio(m.tpot.p99_s, base.tpot.p99_s),
                request_rate_per_s=run.shape.request_rate_per_s,
            )
        )
    return rows


def load_point(shape: LoadShape) -> tuple[int | None, float | None]:
    """(concurrency, request rate): what makes two runs of a sweep comparable."""
    return shape.concurrency, shape.request_rate_per_s


def acceptance_by_config(runs: Sequence[BenchmarkRun]) -> dict[str, AcceptanceMetrics]:
    """Acceptance per configuration over all of its runs (counter deltas summed first)."""
    totals: dict[str, SpecDecodeCounters] = {}
    for run in runs:
        prev = totals.get(run.label)
        totals[run.label] = run.counter_deltas if prev is None else add_counters(prev, run.counter_deltas)
    return {name: acceptance_metrics(total) for name, total in totals.items()}
