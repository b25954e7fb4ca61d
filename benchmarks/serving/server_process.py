"""`serve_app.py` in its own process on a YAML config written for the run (lifecycle, failover and cluster tests; the soak benchmark)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import yaml


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_command(shell_cmd: str) -> list[str]:
    """``shell_cmd`` under a shell that stays its parent, as make runs a recipe: started with
    ``start_new_session``, the shell leads the process group and the command is a member (a bare
    ``sh -c`` would exec a simple command, which would then lead the group itself). ``trap : TERM``
    lets the shell outlive a SIGTERM to the group and wait for the command, whose exit status it
    returns."""
    return ["sh", "-c", 'trap : TERM; eval "$1"; exit $?', "sh", shell_cmd]


def embedded_config(port: int) -> dict:
    """The embedded config as a dict, serving HTTP on ``port``."""
    config = yaml.safe_load(open("configs/embedded.yaml"))
    config["http"]["port"] = port
    return config


def _log_tail(log_path: Path | None, num_lines: int = 40) -> str:
    """The last lines of the server's log, for an assertion message (why it exited)."""
    if log_path is None or not log_path.exists():
        return ""
    return "\n--- serve_app.py log tail ---\n" + "\n".join(log_path.read_text(errors="replace").splitlines()[-num_lines:])


def wait_status(url: str, status: int, timeout_s: float, proc=None, log_path: Path | None = None) -> float:
    """Poll ``/health`` until it answers ``status``; seconds taken (AssertionError past timeout_s,
    or when ``proc`` exits: the message ends with ``log_path``'s tail)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        assert proc is None or proc.poll() is None, f"serve_app.py exited ({proc.returncode}){_log_tail(log_path)}"
        try:
            if httpx.get(url + "/health", timeout=10).status_code == status:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"/health did not answer {status} within {timeout_s} s{_log_tail(log_path)}")


def engine_gauge(url: str, name: str) -> float:
    """The value of the verifier's gauge ``specmoe:<name>`` on the server's ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    match = re.search(rf"^specmoe:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"specmoe:{name} is not on /metrics"
    return float(match[1])


def process_tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and its live descendants (zombies left out): with the embedded config,
    every process of the app (the Ray it started, its actors and Serve replicas)."""
    root = psutil.Process(pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:  # exited meanwhile
            continue
    return out


@contextlib.contextmanager
def serve_process(config: dict, path: Path, extra_args: tuple[str, ...] = (), start_timeout_s: float = 240,
                  stop_with_sigterm: bool = False, env: dict | None = None,
                  launcher: bool = False) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """Write ``config`` to ``path``, start the server on it (environment ``env``, default this
    process's) and wait until healthy.

    With ``launcher`` the server runs under a shell in a new session, as ``make serve`` runs it
    under make: the shell leads the process group, the server is a member, and the yielded
    process is the shell (its exit code is the server's; a SIGTERM to the group reaches both, the
    shell waits for the server). Yields (process, base URL, log path); on exit the process (the
    whole group with ``launcher``) is stopped (SIGTERM first with ``stop_with_sigterm``, then
    SIGKILL) if it still runs.
    """
    path.write_text(yaml.safe_dump(config))
    log_path = path.with_suffix(".log")
    log = open(log_path, "w")
    cmd = [sys.executable, "serve_app.py", "--config", str(path), *extra_args]
    if launcher:
        cmd = launcher_command(shlex.join(cmd))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=launcher)

    def stop(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig) if launcher else proc.send_signal(sig)

    url = f"http://127.0.0.1:{config['http']['port']}"
    try:
        wait_status(url, 200, timeout_s=start_timeout_s, proc=proc, log_path=log_path)
        yield proc, url, log_path
    finally:
        if proc.poll() is None:
            if stop_with_sigterm:
                stop(signal.SIGTERM)
            try:
                proc.wait(30 if stop_with_sigterm else 0.001)
            except subprocess.TimeoutExpired:
                stop(signal.SIGKILL)
                proc.wait(30)
        log.close()
