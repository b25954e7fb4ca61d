"""Wire specmoe's Ray Serve application from a YAML config and run it.

    python serve_app.py --config configs/embedded.yaml      # what `make serve` runs

Only wiring lives here: the config is validated (msgspec), checkpoint paths resolved, local Ray
started with this machine's resources, and the deployments of ``actors/deployments.py`` bound.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

from actors.config import ServeConfig
from engine.errors import ConfigError
from engine.yaml_config import load_yaml

APP_NAME = "specmoe"


class StartupError(RuntimeError):
    """The server cannot start; the message says why."""


def resolve_paths(config: ServeConfig, base: Path) -> None:
    """Make checkpoint paths absolute (Ray workers do not share the driver's cwd) and check them."""
    e = config.engine
    for field in ("model", "draft_model"):
        value = getattr(e, field)
        if value is None:
            continue
        path = (base / value).resolve() if not os.path.isabs(value) else Path(value)
        if not (path / "config.json").is_file():
            raise StartupError(f"engine.{field}: checkpoint {str(path)!r} not found (no config.json there)")
        setattr(e, field, str(path))


def check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise StartupError(f"http: cannot listen on {host}:{port} ({e.strerror}); is another server "
                               f"running? Pick another port in the config or with --port") from e


def ray_env() -> dict:
    """Environment every Ray worker gets: one torch thread, and the OTel settings of this shell."""
    from observability import otel_env_vars

    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **otel_env_vars()}
    env.update({k: v for k, v in os.environ.items() if k.startswith("SPECMOE_")})
    return env


def start(config: ServeConfig, base: Path | None = None, wait_ready_s: float = 300.0) -> str:
    """Start local Ray (if needed) and the application; return the base URL once it answers.

    Raises:
        StartupError: missing checkpoint, port in use, or the app not becoming healthy in time.
    """
    import ray
    from ray import serve

    from actors.deployments import build_app

    resolve_paths(config, base or Path.cwd())
    check_port(config.http.host, config.http.port)
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, namespace=config.experts.namespace,
                 runtime_env={"env_vars": ray_env()}, log_to_driver=True)
    serve.start(http_options={"host": config.http.host, "port": config.http.port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{config.http.host}:{config.http.port}"
    _wait_healthy(url, wait_ready_s)
    return url


def _wait_healthy(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.5)
    raise StartupError(f"server did not become healthy within {timeout_s:.0f} s ({last})")


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def apply_overrides(config: ServeConfig, args: argparse.Namespace) -> ServeConfig:
    """Command-line overrides (for benchmark sweeps), re-validated like the YAML."""
    import msgspec

    raw = msgspec.to_builtins(config)
    if args.host or args.port:
        raw["http"] = {"host": args.host or config.http.host, "port": args.port or config.http.port}
    if args.speculative_method == "none":
        raw["engine"].update(speculative_method=None, draft_model=None, num_speculative_tokens=0)
    elif args.speculative_method:
        raw["engine"]["speculative_method"] = args.speculative_method
    if args.num_speculative_tokens is not None:
        raw["engine"]["num_speculative_tokens"] = args.num_speculative_tokens
    if args.speculative_policy:
        raw["engine"]["speculative_policy"] = args.speculative_policy
    try:
        return msgspec.convert(raw, ServeConfig)
    except (msgspec.ValidationError, ValueError) as e:
        raise ConfigError(f"command-line override: {e}") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/embedded.yaml", help="YAML ServeConfig")
    parser.add_argument("--host", help="override http.host")
    parser.add_argument("--port", type=int, help="override http.port")
    parser.add_argument("--speculative-method", choices=["draft", "ngram", "none"],
                        help="override engine.speculative_method (none: plain decoding)")
    parser.add_argument("--num-speculative-tokens", type=int, help="override engine.num_speculative_tokens")
    parser.add_argument("--speculative-policy", choices=["adaptive", "fixed"],
                        help="override engine.speculative_policy")
    args = parser.parse_args(argv)
    try:
        config = apply_overrides(load_yaml(args.config, ServeConfig), args)
        url = start(config)
    except (ConfigError, StartupError) as e:
        print(f"specmoe: cannot start: {e}", file=sys.stderr)
        return 2
    print(f"specmoe is serving {config.model_name!r} at {url}/v1")
    print(f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{config.model_name}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 48, "
          f"\"temperature\": 0}}'")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        print("specmoe: shutting down")
    finally:
        stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
