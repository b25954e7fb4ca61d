"""The serve config's validation (field paths in every error) and the command line's overrides."""

import msgspec
import pytest
from ray.serve.handle import DeploymentHandle

import serve_app
from actors.config import ServeConfig
from engine.errors import ConfigError


@pytest.mark.parametrize("section, culprit", [
    ("experts:\n  experts_per_actor: 0\n", "experts.experts_per_actor must be >= 1, got 0 - at `$.experts`"),
    # One field per message, with its value (several fields used to share one message).
    ("experts:\n  max_attempts: 0\n", "experts.max_attempts must be >= 1, got 0 - at `$.experts`"),
    ("experts:\n  hot_expert_replicas: {3: 0}\n", "experts.hot_expert_replicas.3 must be >= 1, got 0"),
    ("experts:\n  hot_expert_replicas: {-1: 2}\n",
     "experts.hot_expert_replicas must be keyed by group indexes >= 0, got -1 - at `$.experts`"),
    # inf reached ray.wait in every layer (OverflowError: a 500 for every request) or the start's ray.get.
    ("experts:\n  call_timeout_s: .inf\n", "experts.call_timeout_s must be > 0 and finite, got inf - at `$.experts`"),
    ("verifier_start_timeout_s: .inf\n", "verifier_start_timeout_s must be > 0 and finite, got inf"),
    ("verifier:\n  graceful_shutdown_timeout_s: .inf\n", "graceful_shutdown_timeout_s must be >= 0 and finite, got inf"),
    ("draft:\n  call_timeout_s: 0\n", "draft.call_timeout_s must be > 0 and finite, got 0.0 - at `$.draft`"),
    # Accepted, then every verifier replica failed in its straggler detector.
    ("experts:\n  straggler_multiple: .nan\n", "experts.straggler_multiple must be >= 1 and finite, got nan"),
    ("experts:\n  straggler_floor_ms: -5\n", "experts.straggler_floor_ms must be >= 0 and finite, got -5.0"),
    ("verifier:\n  max_ongoing_requests: -2\n", "max_ongoing_requests must be >= 1, got -2 - at `$.verifier`"),
    ("request_timeout_s: -1\n", "request_timeout_s must be > 0 and finite, got -1.0"),
    # Ray refuses these only when it places an actor, inside a replica's start (tracebacks, exit 1).
    ("verifier:\n  num_cpus: -1\n", "num_cpus must be >= 0, got -1.0 - at `$.verifier`"),
    ("verifier:\n  num_gpus: -1\n", "num_gpus must be >= 0, got -1.0 - at `$.verifier`"),
    ("ingress:\n  resources: {head: -1}\n", "resources.head must be > 0, got -1.0 - at `$.ingress`"),
    ("draft:\n  num_cpus: -0.5\n", "num_cpus must be >= 0, got -0.5 - at `$.draft`"),
    ("experts:\n  num_gpus: -1\n", "experts.num_gpus must be >= 0, got -1.0 - at `$.experts`"),
    ("experts:\n  torch_threads: 0\n", "experts.torch_threads must be >= 1, got 0 - at `$.experts`"),
    # The draft actor is one per verifier replica: a replica count of its own was silently ignored.
    ("draft:\n  num_replicas: 2\n", "Object contains unknown field `num_replicas` - at `$.draft`"),
    ("engine_step_timeout_s: -1\n", "engine_step_timeout_s must be > 0 and finite, got -1.0"),
    ("body_timeout_s: .inf\n", "body_timeout_s must be > 0 and finite, got inf"),
    ("verifier:\n  health_check_timeout_s: 0\n", "health_check_timeout_s must be > 0 and finite, got 0.0 - at `$.verifier`"),
    ("verifier_start_timeout_s: 0\n", "verifier_start_timeout_s must be > 0 and finite, got 0.0"),
    ("http:\n  host: ''\n", "Expected `str` of length >= 1 - at `$.http.host`"),
    ("http:\n  api_key: ''\n", "Expected `str` of length >= 1 - at `$.http.api_key`"),
    ("http:\n  allowed_origins: ['']\n", "Expected `str` of length >= 1 - at `$.http.allowed_origins[0]`"),
    # The rest of CORS means nothing without origins: a config that sets it alone is a mistake.
    ("http:\n  allow_credentials: true\n", "allow_credentials must be left at its default False unless "
     "allowed_origins is set (no CORS without it), got True - at `$.http`"),
    ("http:\n  allowed_methods: [GET]\n", "allowed_methods must be left at its default ('*',) unless "
     "allowed_origins is set (no CORS without it), got ('GET',) - at `$.http`"),
    # A class's name is in the message (msgspec's own path shows a dict key as [...]).
    ("engine:\n  model: x\n  scheduler:\n    slo_classes:\n      fast: {ttft_ms: 100}\n      slow: {ttft_ms: -5}\n",
     "slo_classes.slow.ttft_ms must be > 0, got -5.0 - at `$.engine.scheduler`"),
    # msgspec's path has [...] for a dict entry; the message names the entry's key instead.
    ("engine:\n  model: x\n  scheduler:\n    slo_classes:\n      fast: {ttft_ms: 100}\n      slow: {tpot_msx: 5}\n",
     "Object contains unknown field `tpot_msx` - at `$.engine.scheduler.slo_classes.slow`"),
    ("engine:\n  model: x\n  scheduler:\n    slo_classes:\n      fast: {ttft_ms: soon}\n      slow: {ttft_ms: 9}\n",
     "Expected `float | null`, got `str` - at `$.engine.scheduler.slo_classes.fast.ttft_ms`"),
    ("stream_batching_interval_ms: -1\n", "stream_batching_interval_ms must be >= 0, got -1.0"),
    ("stream_batching_interval_ms: .inf\n", "stream_batching_interval_ms must be finite, got inf"),
    # Batching a stream must not by itself break a class's ITL budget.
    ("engine:\n  model: x\n  scheduler:\n    slo_classes:\n      chat: {ttft_ms: 100, itl_ms: 25}\n"
     "stream_batching_interval_ms: 40\n",
     "stream_batching_interval_ms must be <= engine.scheduler.slo_classes.chat.itl_ms (25), got 40.0"),
])
def test_invalid_config_names_the_field(tmp_path, capsys, section, culprit):
    cfg = tmp_path / "c.yaml"
    engine = "" if section.startswith("engine:") else "engine:\n  model: x\n"
    cfg.write_text(f"model_name: m\n{engine}{section}")
    assert serve_app.main(["--config", str(cfg)]) == 2
    assert culprit in capsys.readouterr().err


def test_an_empty_model_name_names_the_field(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name: ''\nengine:\n  model: x\n")
    assert serve_app.main(["--config", str(cfg)]) == 2
    assert "Expected `str` of length >= 1 - at `$.model_name`" in capsys.readouterr().err


@pytest.mark.parametrize("argv, method, k, policy", [
    (["--speculative-method", "none"], None, 0, "adaptive"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "6", "--speculative-policy", "fixed"], "ngram", 6,
     "fixed")])
def test_command_line_overrides(argv, method, k, policy):
    import argparse

    from actors.config import ServeConfig
    from engine.yaml_config import load_yaml

    ns = argparse.Namespace(host=None, port=None, speculative_method=None, num_speculative_tokens=None,
                            speculative_policy=None)
    for flag, value in zip(argv[::2], argv[1::2]):
        setattr(ns, flag[2:].replace("-", "_"), int(value) if value.isdigit() else value)
    config = serve_app.apply_overrides(load_yaml("configs/embedded.yaml", ServeConfig), ns)
    assert (config.engine.speculative_method, config.engine.num_speculative_tokens) == (method, k)
    assert config.engine.speculative_policy == policy
    if method == "ngram":  # the config's draft model is dropped, not an error
        assert config.engine.draft_model is None


def test_a_draft_length_without_a_way_to_draft_is_a_config_error():
    """``--speculative-method none --num-speculative-tokens 4`` used to serve plain decoding silently."""
    import argparse

    from actors.config import ServeConfig
    from engine.yaml_config import load_yaml

    ns = argparse.Namespace(host=None, port=None, speculative_method="none", num_speculative_tokens=4,
                            speculative_policy=None)
    with pytest.raises(ConfigError, match=r"num_speculative_tokens: 4 needs a speculative_method .* - at `\$\.engine`"):
        serve_app.apply_overrides(load_yaml("configs/embedded.yaml", ServeConfig), ns)


@pytest.mark.parametrize(("port", "error"), [(0, ">= 1"), (-1, ">= 1"), (99999, "<= 65535"), (8123, None)])
def test_a_port_override_is_validated_like_the_yaml(port, error):
    import argparse

    from actors.config import ServeConfig
    from engine.yaml_config import load_yaml

    ns = argparse.Namespace(host=None, port=port, speculative_method=None, num_speculative_tokens=None,
                            speculative_policy=None)
    config = load_yaml("configs/embedded.yaml", ServeConfig)
    if error is None:
        assert serve_app.apply_overrides(config, ns).http.port == port
    else:  # was a traceback from bind() (99999, -1) or silently port 8000 (0)
        with pytest.raises(ConfigError, match=rf"{error} - at `\$\.http\.port`"):
            serve_app.apply_overrides(config, ns)


@pytest.mark.parametrize("value", [True, False])
def test_two_batch_overlap_override(value):
    import argparse

    from actors.config import ServeConfig
    from engine.yaml_config import load_yaml

    ns = argparse.Namespace(host=None, port=None, speculative_method=None, num_speculative_tokens=None,
                            speculative_policy=None, two_batch_overlap=value)
    config = serve_app.apply_overrides(load_yaml("configs/embedded.yaml", ServeConfig), ns)
    assert config.experts.two_batch_overlap is value
    assert serve_app.apply_overrides(config, argparse.Namespace(
        host=None, port=None, speculative_method=None, num_speculative_tokens=None,
        speculative_policy=None)).experts.two_batch_overlap is value  # unset: kept


@pytest.mark.parametrize("transport, grpc", [("grpc", True), ("actor_calls", False)])
def test_serve_transport_sets_the_proxy_env_and_the_ingress_handle(transport, grpc):
    from actors.ingress import IngressServer

    config = msgspec.convert({"model_name": "m", "engine": {"model": "checkpoints/stdlib-moe-target"},
                              "serve_transport": transport}, ServeConfig)
    assert serve_app.ray_env(config)["RAY_SERVE_PROXY_USE_GRPC"] == ("1" if grpc else "0")
    ingress = IngressServer(config, _RecordingHandle())
    assert ingress.verifier.calls == [{"_by_reference": not grpc}]
    assert ingress._verifier_stream.calls == [{"_by_reference": not grpc}, {"stream": True}]


def test_an_unknown_serve_transport_names_the_field():
    with pytest.raises(msgspec.ValidationError, match=r"serve_transport"):
        msgspec.convert({"model_name": "m", "engine": {"model": "x"}, "serve_transport": "zmq"}, ServeConfig)


@pytest.mark.parametrize("transport, graph", [("compiled_graph", True), ("actor_calls", False)])
def test_draft_transport_picks_the_draft_actors_hop(monkeypatch, transport, graph):
    """``draft_transport`` decides whether the verifier's RemoteDrafter gets graph settings (a
    compiled graph to its draft actor) or none (plain actor calls)."""
    import actors.draft_server
    from actors.verifier import VerifierServer

    class Built(Exception):
        pass

    def remote_drafter(spec, timeout_s, graph_config=None):
        raise Built(graph_config)

    monkeypatch.setattr(actors.draft_server, "RemoteDrafter", remote_drafter)
    config = {"model_name": "m", "engine": {"model": "checkpoints/stdlib-moe-target",
                                            "draft_model": "checkpoints/stdlib-draft"},
              "draft_transport": transport}
    server = VerifierServer(config, engine_factory=lambda: None)
    server.tag = "test"  # set by _build_pool in a replica
    with pytest.raises(Built) as built:
        server.build_engine()
    assert (built.value.args[0] is not None) == graph
    if graph:
        assert built.value.args[0] == server.config.experts  # the experts section's graph settings


def test_an_unknown_draft_transport_names_the_field():
    with pytest.raises(msgspec.ValidationError, match=r"draft_transport"):
        msgspec.convert({"model_name": "m", "engine": {"model": "x"}, "draft_transport": "nccl"}, ServeConfig)


class _RecordingHandle(DeploymentHandle):
    """A verifier handle that records the options it is given (no Serve instance needed)."""

    def __init__(self, calls: tuple = ()) -> None:  # Serve's own __init__ would look up a router
        self.calls = list(calls)

    def options(self, **kwargs) -> "_RecordingHandle":
        return _RecordingHandle((*self.calls, kwargs))


def test_api_key_and_allowed_origins_overrides_and_the_key_kept_out_of_errors_and_ray_env(monkeypatch, capsys):
    import argparse

    from engine.yaml_config import load_yaml

    config = load_yaml("configs/embedded.yaml", ServeConfig)
    assert (config.http.api_key, config.http.allowed_origins) == (None, None)  # default: no key, no CORS
    args = argparse.Namespace(
        host=None, port=None, speculative_method=None, num_speculative_tokens=None, speculative_policy=None,
        api_key="sk-cli-secret", allowed_origins=["https://app.example", "http://localhost:3000"])
    overridden = serve_app.apply_overrides(config, args)
    assert overridden.http.api_key == "sk-cli-secret"
    assert overridden.http.allowed_origins == ("https://app.example", "http://localhost:3000")
    with pytest.raises(ConfigError) as err:  # an empty key: named by its path, never echoed
        serve_app.apply_overrides(config, argparse.Namespace(**{**vars(args), "api_key": ""}))
    assert "$.http.api_key" in str(err.value)
    monkeypatch.setenv("SPECMOE_API_KEY", "sk-env-secret")
    monkeypatch.setenv("SPECMOE_TRITON", "0")
    env = serve_app.ray_env(config)  # Ray's runtime-env agent logs these
    assert env["SPECMOE_TRITON"] == "0" and "SPECMOE_API_KEY" not in env
    assert config.http.resolved_api_key() == "sk-env-secret"
    assert overridden.http.resolved_api_key() == "sk-cli-secret"  # the config's key wins
    monkeypatch.setenv("SPECMOE_API_KEY", "")
    assert config.http.resolved_api_key() is None  # empty: unset


def test_the_api_key_never_shows_in_a_repr_of_the_config_yet_still_authenticates(monkeypatch):
    """A config in a log line, a traceback or an f-string error message must not carry the key:
    repr, str and rich's pretty repr say that a key is set, never which; the value itself (what
    the ingress is built from and checks) is unchanged."""
    import hashlib

    from rich.pretty import pretty_repr
    from starlette.datastructures import Headers

    from actors.http_access import ApiKeyMiddleware
    from engine.yaml_config import load_yaml

    key = "sk-never-shown-0123"
    base = load_yaml("configs/embedded.yaml", ServeConfig)
    config = msgspec.convert({**msgspec.to_builtins(base), "http": {"api_key": key}}, ServeConfig)
    shown = [repr(config), str(config), repr(config.http), str(config.http), pretty_repr(config),
             f"{config.http!r}", pretty_repr(config.http)]
    assert all(key not in s for s in shown)
    assert all("api_key='<redacted>'" in s for s in shown[:4]), shown[2]
    assert "api_key=None" in repr(base.http)  # unset keys still say so
    assert repr(config.http).startswith("HttpConfig(host='127.0.0.1', port=8000, ")
    # the key itself is intact: as the ingress gets it (to_builtins) and as it checks it
    assert msgspec.to_builtins(config)["http"]["api_key"] == key == config.http.resolved_api_key()
    guard = ApiKeyMiddleware(None, hashlib.sha256(config.http.resolved_api_key().encode()).digest())
    assert guard.authorized(Headers({"authorization": f"Bearer {key}"}))
    assert not guard.authorized(Headers({"authorization": "Bearer <redacted>"}))
    monkeypatch.setenv("SPECMOE_API_KEY", key)  # from the environment: never part of the repr at all
    assert key not in repr(base) and base.http.resolved_api_key() == key


def test_deployment_options_carry_the_health_checks_to_serve():
    """Serve replaces a replica after 3 failed health checks in a row; at its defaults (every 10 s,
    30 s timeout) a hung verifier served nothing for ~105 s, so the deployments set their own."""
    from actors.config import DeploymentConfig
    from actors.deployments import _options

    opts = _options(DeploymentConfig(health_check_period_s=3.0, health_check_timeout_s=7.0))
    assert (opts["health_check_period_s"], opts["health_check_timeout_s"]) == (3.0, 7.0)
    default = _options(DeploymentConfig())
    assert (default["health_check_period_s"], default["health_check_timeout_s"]) == (2.0, 5.0)


def test_exponent_numbers_read_as_numbers(tmp_path):
    """YAML 1.2's 5e3 (PyYAML's YAML 1.1 read it as a string: "Expected `float | null`, got `str`")."""
    from engine.yaml_config import load_yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name: m\nengine:\n  model: x\n  scheduler:\n    slo_classes:\n"
                   "      fast: {ttft_ms: 5e3, tpot_ms: 2.5E1}\nexperts:\n  call_timeout_s: 1e1\n")
    config = load_yaml(cfg, ServeConfig)
    fast = config.engine.scheduler.slo_classes["fast"]
    assert (fast.ttft_ms, fast.tpot_ms, config.experts.call_timeout_s) == (5000.0, 25.0, 10.0)
