"""Start-up checks of the embedded server's HTTP port: whether it can be bound, a lock that one
specmoe server holds on it from its start to its exit, and what Serve's proxy failing to bind it
means (``serve_app.start`` uses them before and while Ray starts)."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import tempfile
from pathlib import Path

from actors.startup_checks import StartupError


def _bind_error(host: str, port: int) -> OSError | None:
    """Why ``host:port`` cannot be bound now (None: it can)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


_OTHER_PORT = "another port: http.port in the config, --port, or `make serve PORT=...`"


def check_port(host: str, port: int) -> None:
    """Raises StartupError with the advice that fits the bind error: another port when it is taken
    or privileged, another host when the host is no address of this machine."""
    if (e := _bind_error(host, port)) is None:
        return
    if e.errno == errno.EADDRINUSE:
        raise StartupError(f"http: cannot listen on {host}:{port} ({e.strerror}); is another server "
                           f"running? Pick {_OTHER_PORT}") from e
    if e.errno == errno.EACCES:
        raise StartupError(f"http: cannot listen on {host}:{port} ({e.strerror}): ports below 1024 need "
                           f"privileges; pick {_OTHER_PORT}") from e
    raise StartupError(f"http.host: cannot listen on {host!r} ({e.strerror}): not an address of this "
                       f"machine; use 127.0.0.1, 0.0.0.0 or one of its addresses (--host)") from e


def proxy_start_error(host: str, port: int, error: Exception) -> StartupError:
    """What ``serve.start`` failing means: the port taken since :func:`check_port` (Ray's own
    processes pick ephemeral ports as they start), or, with the port free, the proxy itself failed
    (Serve kills and replaces a proxy that misses its readiness checks, e.g. on an overloaded
    machine); saying "port taken" then sent users looking for another server."""
    if _bind_error(host, port) is not None:
        return StartupError(f"http: Serve's proxy cannot listen on {host}:{port} ({type(error).__name__}); "
                            f"pick {_OTHER_PORT}")
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    return StartupError(f"http: Serve's proxy did not start on {host}:{port}, which is free ({type(error).__name__}"
                        f"{': ' + first_line if first_line else ''}); Serve replaces a proxy that misses its "
                        f"readiness checks, as on an overloaded machine: see the log above, and retry")


_port_locks: dict[int, int] = {}  # port -> this process's descriptor of its lock file (held open)


def claim_port(port: int) -> None:
    """Take this machine's lock on ``port`` for the rest of this process (or until
    :func:`release_ports`): two servers started at once both passed :func:`check_port` before
    either proxy bound the port, and Serve's proxies bind with ``SO_REUSEPORT``, so both served on
    it and requests (and Prometheus scrapes) landed on either at random (an operator trial,
    2026-12-07). The lock is ``flock`` on a file in the temporary directory: the kernel drops it
    when the process exits, ``kill -9`` included. A lock file that cannot be opened (an unwritable
    temporary directory) skips the lock; :func:`check_port` still runs.

    Raises:
        StartupError: another process holds the lock (a specmoe server starting or serving).
    """
    if port in _port_locks:
        return
    path = Path(tempfile.gettempdir()) / f"specmoe-port-{port}.lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StartupError(f"http: another specmoe server is starting or serving on port {port} on this "
                           f"machine (it holds {path}); pick {_OTHER_PORT}") from None
    _port_locks[port] = fd


def release_ports() -> None:
    """Give up every lock :func:`claim_port` took (the server stopped, or did not start)."""
    while _port_locks:
        os.close(_port_locks.popitem()[1])  # closing the only descriptor of the open file releases its flock
