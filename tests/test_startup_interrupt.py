"""A server stopped while it is still starting leaves no process behind.

SIGTERM a few seconds into start-up lands inside ``ray.init``: Ray then reports not initialized,
so nothing was shut down, and Ray's dashboard and runtime-env agents stayed alive as orphans that
ignore SIGTERM (found by a new user; ``timeout 40 make serve`` on a slow machine does the same).
"""

import os
import signal
import subprocess
import sys
import time

import psutil

from benchmarks.serving.server_process import free_port

RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _group(pgid: int) -> list[str]:
    """Command lines of the live processes of process group ``pgid``."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.info["cmdline"] or []))
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def test_sigterm_inside_ray_init_leaves_no_ray_process():
    # A session of its own: the server leads its group, which Ray's processes share (the case a
    # group signal cannot clean up without killing the server itself).
    proc = subprocess.Popen([sys.executable, "serve_app.py", "--port", str(free_port())], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RAY_ADDRESS": "local"})
    try:
        deadline = time.monotonic() + 60
        while not any(c.startswith(RAY_AGENTS) for c in _group(proc.pid)):  # Ray's node is starting
            assert proc.poll() is None and time.monotonic() < deadline, "Ray's agents never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 5  # Ray's own processes may take a moment to exit
        while (left := _group(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"left running after the server exited: {left}"
    finally:
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == proc.pid:
                    p.kill()
            except (ProcessLookupError, psutil.Error):
                continue
