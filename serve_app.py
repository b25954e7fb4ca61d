"""Wire specmoe's Ray Serve application from a YAML config and run it.

    python serve_app.py --config configs/embedded.yaml      # what `make serve` runs
    RAY_ADDRESS=<head>:6379 python serve_app.py ...          # deploy onto a running cluster
    serve run configs/serve.yaml                             # Serve config file (serve_app:build_app)

Only wiring lives here: the config is validated (msgspec), checkpoint paths resolved, a Ray
cluster joined or a loopback-only local Ray started (``actors/cluster.py``), and the deployments of
``actors/deployments.py`` bound.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":
    # Before the imports below (torch: ~1.5 s), so that a Ctrl-C or SIGTERM during them stops the
    # start instead of being lost (a background start has SIGINT ignored until a handler is set).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)

try:
    import msgspec

    from actors.api_key import API_KEY_ENV
    from actors.config import ServeConfig
    from actors.port_checks import check_port, claim_port, proxy_start_error, release_ports
    from actors.startup_checks import StartupError, check_experts, check_fits_this_machine
    from engine.errors import CheckpointError, ConfigError
    from engine.yaml_config import load_yaml
except KeyboardInterrupt:  # nothing started yet: nothing to stop
    if __name__ != "__main__":
        raise
    print("specmoe: interrupted while starting", file=sys.stderr)
    sys.exit(0)

APP_NAME = "specmoe"
# Relative checkpoint paths in a Serve config's args are relative to the repository (where this
# file is): `serve run` builds the app in a Ray worker whose working directory is not the shell's.
REPO_ROOT = Path(__file__).resolve().parent
SHUTDOWN_DRAIN_TIMEOUT_S = 2.0  # longest wait for the drain signal to be delivered
_running: dict = {}  # the app this process deployed: owns_ray, namespace, signal (drain actor)
SHARED_EXPERT_PREFIX = "specmoe-experts-g"  # the detached shared pool's actor names (actors/expert_pool.py)


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


GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"
GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def ray_env(config: ServeConfig) -> dict:
    """Environment every Ray worker gets: one torch thread, the OTel settings of this shell, and
    the HTTP proxy's side of ``config.serve_transport`` (the proxy reads it when it starts)."""
    from observability import otel_env_vars

    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **otel_env_vars()}
    # Not the API key: Ray's runtime-env agent logs a job's env_vars (start() passes it in the config).
    env.update({k: v for k, v in os.environ.items() if k.startswith("SPECMOE_") and k != API_KEY_ENV})
    env["RAY_SERVE_PROXY_USE_GRPC"] = "1" if config.serve_transport == "grpc" else "0"
    # Serve's gRPC hops (proxy <- ingress <- verifier) refuse a message over 4 MiB by default: a
    # non-streamed response or stream item that large (a batch with logprobs, /tokenize of a 3 MB
    # prompt) was a bare 500. Ray's own limit for its other gRPC is 2 GiB.
    env[GRPC_MAX_MESSAGE_ENV] = str(GRPC_MAX_MESSAGE_BYTES)
    return env


def start(config: ServeConfig, base: Path | None = None, wait_ready_s: float = 300.0,
          address: str | None = None, sigterm: Callable | None = None) -> str:
    """Join the Ray cluster at ``address`` (else ``RAY_ADDRESS``) or start a loopback-only local Ray,
    deploy the application and return its base URL once it answers. ``sigterm``: a SIGTERM handler
    to (re)install once Ray is up (``ray.init`` replaces the process's handler with its own).

    Raises:
        StartupError: missing checkpoint, port in use (or claimed by another specmoe server
            starting here), Ray not starting (or its cluster unreachable), a replica failing (its
            error named), or the app not becoming healthy in time.
        ConfigError, CheckpointError: checkpoints that do not fit the config or each other, or
            a damaged checkpoint file (``EngineArgs.check_checkpoints``), a CUDA device missing here.
    """
    from ray import serve

    from actors.cluster import cluster_address, create_drain_signal, init_ray
    from actors.deployments import build_app as bind_app
    from engine.loader import check_device_present

    address = cluster_address(address)
    resolve_paths(config, base or Path.cwd())
    check_experts(config, config.engine.check_checkpoints("engine."))
    if address is None:  # on a cluster the proxies listen on the cluster's nodes, not here
        claim_port(config.http.port)  # before the check: a server starting at the same moment loses here
        check_port(config.http.host, config.http.port)
        # Here too (not only in the replicas): the embedded start runs every replica on this machine.
        check_device_present(config.engine.device, "engine.device")
    try:
        owns_ray = init_ray(config.experts.namespace, ray_env(config), address)
    except Exception as e:  # ray.init raises bare Exception / ConnectionError (node start timeout, bad address)
        raise StartupError(f"Ray did not start{f' (address {address!r})' if address else ''}: {e}") from e
    if sigterm is not None:
        signal.signal(signal.SIGTERM, sigterm)
    _running.update(owns_ray=owns_ray, namespace=config.experts.namespace,
                    signal=create_drain_signal(config.experts.namespace))
    if owns_ray:  # after the update: a failed check stops the Ray it started
        import ray

        check_fits_this_machine(config, ray.cluster_resources())
    try:
        serve.start(proxy_location=config.http.proxy_location,
                    http_options={"host": config.http.host, "port": config.http.port})
    except Exception as e:  # RayTaskError / ActorDiedError from the proxy
        raise proxy_start_error(config.http.host, config.http.port, e) from e
    # $SPECMOE_API_KEY into the config the ingress gets (kept out of ray_env's logged runtime env)
    http = msgspec.structs.replace(config.http, api_key=config.http.resolved_api_key())
    try:
        serve.run(bind_app(msgspec.structs.replace(config, http=http)), name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as e:  # Serve's DEPLOY_FAILED: a replica's constructor failed three times
        raise StartupError(f"the application did not deploy: {_replica_errors() or e}; the replicas' "
                           f"tracebacks are in the log above") from e
    url = f"http://{config.http.host}:{config.http.port}"
    _wait_healthy(url, wait_ready_s)
    return url


_EXCEPTION_MODULE = re.compile(r"^(?:\w+\.)+(?=\w+: )")  # "engine.errors.CheckpointError: ..." -> "CheckpointError: ..."


def _replica_errors() -> str:
    """Each failed deployment's error, as the last line of its Serve status message (the replica
    constructor's exception, e.g. a checkpoint tensor of the wrong shape): the operator's answer,
    which otherwise sat three times in a few hundred lines of Ray tracebacks. Empty if Serve's
    status cannot be read."""
    from ray import serve

    try:
        deployments = serve.status().applications[APP_NAME].deployments
    except Exception:  # best effort: the generic message still stands
        return ""
    errors = []
    for name, d in deployments.items():
        lines = [line.strip() for line in (d.message or "").splitlines() if line.strip()]
        if str(d.status).endswith("DEPLOY_FAILED") and lines:
            errors.append(f"{name}: {_EXCEPTION_MODULE.sub('', lines[-1])}")
    return "; ".join(errors)


def build_app(args: dict):
    """Ray Serve application builder (``import_path: serve_app:build_app`` in a Serve config file,
    or ``serve run serve_app:build_app``).

    Args:
        args: a :class:`ServeConfig` as plain data (the config file's ``applications[].args``).
            Its ``http`` section's host, port and proxy location do not apply (the Serve
            config's ``http_options`` do; its API key and CORS settings do), nor do the
            ``ingress``/``verifier`` replica settings the config file's ``deployments[]`` set.

    Raises:
        ConfigError: invalid args (the message names the field path) or a missing checkpoint.
    """
    from actors.deployments import build_app as bind_app

    try:
        config = msgspec.convert(args, ServeConfig)
    except (msgspec.ValidationError, ValueError, TypeError) as e:
        raise ConfigError(f"serve_app:build_app args: {e}") from e
    try:
        resolve_paths(config, REPO_ROOT)
        check_experts(config, config.engine.check_checkpoints("engine."))
    except (StartupError, CheckpointError, ConfigError) as e:
        raise ConfigError(f"serve_app:build_app args: {e}") from e
    return bind_app(config)


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


def stop(drain_timeout_s: float = SHUTDOWN_DRAIN_TIMEOUT_S) -> None:
    """End in-flight streams cleanly, then shut the app down: Serve and Ray when this process started
    them, else only this app (the cluster keeps running)."""
    import ray
    from ray import serve

    from actors.cluster import drain, kill_detached_actors, kill_leftover_ray_processes

    signal, owns_ray = _running.pop("signal", None), _running.pop("owns_ray", True)
    namespace = _running.pop("namespace", None)
    try:
        if signal is not None:
            drain(signal, drain_timeout_s)
        if owns_ray:
            serve.shutdown()
        else:  # the cluster stays up: remove only what this app made
            serve.delete(APP_NAME)
            if namespace is not None:
                kill_detached_actors(namespace, SHARED_EXPERT_PREFIX)
    finally:
        ray.shutdown()
        if owns_ray:
            kill_leftover_ray_processes()
        release_ports()


def stop_or_force() -> None:
    """:func:`stop`; a Ctrl-C during it (a user who will not wait for the drain) skips what is left,
    kills the embedded Ray's processes and says so, instead of ending in a traceback."""
    from actors.cluster import kill_leftover_ray_processes

    try:
        stop()
    except KeyboardInterrupt:
        print("specmoe: interrupted while stopping; killing Ray's processes", file=sys.stderr)
        kill_leftover_ray_processes()


def apply_overrides(config: ServeConfig, args: argparse.Namespace) -> ServeConfig:
    """Command-line overrides (for benchmark sweeps), re-validated like the YAML."""
    raw = msgspec.to_builtins(config)
    if args.host:
        raw["http"]["host"] = args.host
    if args.port is not None:
        raw["http"]["port"] = args.port
    if getattr(args, "api_key", None) is not None:
        raw["http"]["api_key"] = args.api_key
    if getattr(args, "allowed_origins", None) is not None:
        raw["http"]["allowed_origins"] = args.allowed_origins
    if args.speculative_method == "none":
        raw["engine"].update(speculative_method=None, draft_model=None, num_speculative_tokens=0)
    elif args.speculative_method:
        raw["engine"]["speculative_method"] = args.speculative_method
        if args.speculative_method == "ngram":  # the config's draft model has no part in n-gram drafting
            raw["engine"]["draft_model"] = None
    if getattr(args, "draft_model", None):
        raw["engine"]["draft_model"] = args.draft_model
    if args.num_speculative_tokens is not None:
        raw["engine"]["num_speculative_tokens"] = args.num_speculative_tokens
    if args.speculative_policy:
        raw["engine"]["speculative_policy"] = args.speculative_policy
    if getattr(args, "pipelined_drafting", None) is not None:
        raw["engine"]["pipelined_drafting"] = args.pipelined_drafting
    if getattr(args, "two_batch_overlap", None) is not None:
        raw["experts"]["two_batch_overlap"] = args.two_batch_overlap
    try:
        return msgspec.convert(raw, ServeConfig)
    except (msgspec.ValidationError, ValueError) as e:
        raise ConfigError(f"command-line override: {e}") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/embedded.yaml", help="YAML ServeConfig (default: %(default)s)")
    parser.add_argument("--host", help="override http.host")
    parser.add_argument("--port", type=int, help="override http.port")
    parser.add_argument("--api-key", help=f"override http.api_key (else ${API_KEY_ENV}): the /v1 routes, /tokenize "
                                          "and /detokenize then need 'Authorization: Bearer <key>'")
    parser.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                        help="override http.allowed_origins: CORS for these origins ('*': any)")
    parser.add_argument("--speculative-method", choices=["draft", "eagle3", "ngram", "none"],
                        help="override engine.speculative_method (none: plain decoding)")
    parser.add_argument("--draft-model", help="override engine.draft_model (a draft checkpoint or an EAGLE-3 head)")
    parser.add_argument("--num-speculative-tokens", type=int, help="override engine.num_speculative_tokens")
    parser.add_argument("--speculative-policy", choices=["adaptive", "fixed"],
                        help="override engine.speculative_policy")
    parser.add_argument("--pipelined-drafting", action=argparse.BooleanOptionalAction, default=None,
                        help="override engine.pipelined_drafting (draft the next window during verification)")
    parser.add_argument("--two-batch-overlap", action=argparse.BooleanOptionalAction, default=None,
                        help="override experts.two_batch_overlap (interleave two micro-batches' layers)")
    parser.add_argument("--address", help="Ray cluster to deploy onto (default: $RAY_ADDRESS; unset: start a "
                                          "local Ray that listens on 127.0.0.1 only)")
    args = parser.parse_args(argv)
    install_signal_handlers()
    try:
        config = apply_overrides(load_yaml(args.config, ServeConfig), args)
        url = start(config, address=args.address, sigterm=_sigterm)
    except (ConfigError, CheckpointError, StartupError) as e:
        print(f"specmoe: cannot start: {e}", file=sys.stderr)
        _stop_if_started()
        return 2
    except (KeyboardInterrupt, SystemExit):
        print("specmoe: interrupted while starting; shutting down")
        ignore_sigterm_while_stopping()
        _stop_if_started()
        return 0
    print(f"specmoe is serving {config.model_name!r} at {url}/v1")
    # Without a tokenizer (engine.skip_tokenizer_init) prompts are token ids.
    prompt = "[5, 6, 7]" if config.engine.skip_tokenizer_init else '"def fibonacci(n):"'
    auth = " -H 'Authorization: Bearer <your API key>'" if config.http.resolved_api_key() else ""  # never the key
    print(f"  try: curl {url}/v1/completions{auth} -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{config.model_name}\", \"prompt\": {prompt}, \"max_tokens\": 48, "
          f"\"temperature\": 0}}'")
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        print("specmoe: shutting down")
    finally:
        ignore_sigterm_while_stopping()
        t0 = time.monotonic()
        stop_or_force()
        print(f"specmoe: stopped in {time.monotonic() - t0:.1f} s")
    return 0


def install_signal_handlers() -> None:
    """SIGTERM (docker stop, Kubernetes, systemd) shuts down like Ctrl-C, also during start-up
    (ray.init installs its own SIGTERM handler, so start() puts ours back). SIGINT raises
    KeyboardInterrupt even when the server was started in the background by a non-interactive
    shell (``python serve_app.py &``, a script or a Makefile recipe): POSIX shells start such jobs
    with SIGINT ignored, and Python then installs no handler, so Ctrl-C / ``kill -INT`` did nothing."""
    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _sigterm(*_) -> None:
    raise SystemExit(0)


def ignore_sigterm_while_stopping() -> None:
    """A SIGTERM during :func:`stop` must not cut the drain and Serve's shutdown short: ``kill -TERM
    -<pgid>`` on ``make serve`` can deliver two (the group's, and the one GNU make forwards to its
    child). Stopping is bounded (the drain's timeout, then Serve's own); Ctrl-C still interrupts."""
    signal.signal(signal.SIGTERM, lambda *_: print("specmoe: already shutting down", file=sys.stderr))


def _stop_if_started() -> None:
    """Shut down what a start interrupted at any point had started: Ray's processes too when the
    interruption came inside ``ray.init`` (Ray then reports not initialized), and the port's lock
    (taken before Ray starts)."""
    from actors.cluster import kill_leftover_ray_processes

    ray = sys.modules.get("ray")  # an interruption inside `import ray` leaves it half imported
    try:
        if _running or (ray is not None and getattr(ray, "is_initialized", lambda: False)()):
            stop_or_force()  # which kills the leftovers itself
        else:
            kill_leftover_ray_processes()
    finally:
        release_ports()


if __name__ == "__main__":
    sys.exit(main())
