"""A server stopped while it is still starting stops, and leaves no process behind.

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


def _wait_for_ray_agents(group: int, alive: subprocess.Popen) -> None:
    """Until Ray's agents run in process group ``group``: ``ray.init`` is under way."""
    deadline = time.monotonic() + 60
    while not any(c.startswith(RAY_AGENTS) for c in _group(group)):
        assert alive.poll() is None and time.monotonic() < deadline, "Ray's agents never started"
        time.sleep(0.05)


def _assert_group_ends(group: int) -> None:
    deadline = time.monotonic() + 5  # Ray's own processes may take a moment to exit
    while (left := _group(group)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running after the server exited: {left}"


def _kill_group(group: int) -> None:
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == group:
                p.kill()
        except (ProcessLookupError, psutil.Error):
            continue


def test_sigterm_inside_ray_init_leaves_no_ray_process():
    # A session of its own: the server leads its group, which Ray's processes share (the case a
    # group signal cannot clean up without killing the server itself).
    proc = subprocess.Popen([sys.executable, "serve_app.py", "--port", str(free_port())], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RAY_ADDRESS": "local"})
    try:
        _wait_for_ray_agents(proc.pid, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _assert_group_ends(proc.pid)
    finally:
        _kill_group(proc.pid)


# A launcher like make: leads the terminal's group, catches SIGINT without passing it on, and waits
# for its child.
LAUNCHER = ("import signal, subprocess, sys\n"
            "signal.signal(signal.SIGINT, lambda *_: None)\n"
            "sys.exit(subprocess.call(sys.argv[1:]))\n")


def test_ctrl_c_inside_ray_init_under_a_launcher_stops_the_start():
    """A new user's Ctrl-C 2.5-3 s into `make serve` was lost: during ``ray.init`` the server sits in
    a process group of its own (so that a group SIGTERM cannot kill Ray before streams drain), and
    the terminal's SIGINT reaches only the launcher's group."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, sys.executable, "serve_app.py", "--port",
                                 str(free_port())], start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env={**os.environ, "RAY_ADDRESS": "local"})
    server = None
    try:
        deadline = time.monotonic() + 30
        while not (children := psutil.Process(launcher.pid).children()):
            assert time.monotonic() < deadline, "the launcher started nothing"
            time.sleep(0.05)
        server = children[0].pid
        _wait_for_ray_agents(server, launcher)
        assert os.getpgid(server) == server != launcher.pid  # inside ray.init, out of the terminal's group
        os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        assert launcher.wait(timeout=60) == 0  # the server's exit code
        _assert_group_ends(server)
    finally:
        _kill_group(launcher.pid)
        if server is not None:
            _kill_group(server)
