"""A real Prometheus for tests: Debian's ``prometheus`` package, installed on demand, run on a free
port with a given scrape config, queried through its HTTP API.

:func:`ensure_prometheus` returns the binary or raises :class:`Unavailable` saying why (no apt,
not root, install failed); tests turn that into a visible skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx

INSTALL_TIMEOUT_S = 600


class Unavailable(RuntimeError):
    """Prometheus is not installed and cannot be installed here."""


def ensure_prometheus() -> str:
    """The ``prometheus`` binary, installing Debian's package (apt-get, as root) if needed.

    Raises:
        Unavailable: not installed and not installable (message says why).
    """
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get") is None:
        raise Unavailable("prometheus is not installed and there is no apt-get to install Debian's package")
    if os.geteuid() != 0:
        raise Unavailable("prometheus is not installed and installing Debian's package needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = "apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus"
    try:
        proc = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise Unavailable(f"installing prometheus took over {INSTALL_TIMEOUT_S} s") from e
    found = shutil.which("prometheus")
    if proc.returncode != 0 or not found:
        raise Unavailable(f"apt-get install prometheus failed (rc {proc.returncode}): {proc.stderr[-500:]}")
    return found


class PrometheusServer:
    """``prometheus`` on 127.0.0.1:``port`` with ``config_file``, its data under ``workdir``.

    Use as a context manager; :meth:`query` evaluates PromQL through ``/api/v1/query``.
    """

    def __init__(self, binary: str, config_file: Path, workdir: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 (closed in stop)
        self._proc = subprocess.Popen(
            [binary, f"--config.file={config_file}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Raises RuntimeError if Prometheus exits or is not ready within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout_s} s: {self.log_tail()}")

    def query(self, promql: str) -> dict:
        """The ``data`` of an instant query now; raises AssertionError with Prometheus' error text."""
        r = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{promql!r}: {body.get('error', r.text)}"
        return body["data"]

    def label_values(self, label: str, match: str) -> list[str]:
        r = httpx.get(f"{self.url}/api/v1/label/{label}/values", params={"match[]": match}, timeout=10)
        return r.json()["data"]

    def log_tail(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text()[-1000:]

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
