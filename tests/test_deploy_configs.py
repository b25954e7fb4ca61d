"""The Serve config file and the KubeRay manifests: each is a valid Ray Serve config (Ray's own
schema) whose application args are a valid ServeConfig (ours), whose autoscaling actually scales,
and whose cluster has what the app asks for. Also the builder's own validation (field paths)."""

from pathlib import Path

import msgspec
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

import serve_app
from actors.config import ServeConfig
from engine.errors import ConfigError

KUBERAY = sorted(Path("deploy/kuberay").glob("*.yaml"))
DEPLOYMENTS = {"ingress", "verifier"}


def _check_serve_config(doc: dict) -> list[ServeConfig]:
    """Validate a Serve config file's dict; return each application's ServeConfig."""
    ServeDeploySchema.model_validate(doc)  # Ray's schema: applications[], deployments[], autoscaling
    configs = []
    for app in doc["applications"]:
        assert app["import_path"] == "serve_app:build_app"
        config = msgspec.convert(app["args"], ServeConfig)
        sched = config.engine.scheduler
        deployments = {d["name"]: d for d in app["deployments"]}
        assert set(deployments) == DEPLOYMENTS
        for name, d in deployments.items():
            auto = d["autoscaling_config"]
            # Serve scales on ongoing requests per replica vs the target: a target at or above the
            # cap (Ray Serve LLM's 1e9 defaults) never scales.
            assert 1 <= auto["target_ongoing_requests"] < d["max_ongoing_requests"], name
            assert 1 <= auto["min_replicas"] < auto["max_replicas"], name
        verifier = deployments["verifier"]
        assert verifier["max_ongoing_requests"] == sched.max_num_seqs + sched.max_waiting
        assert verifier["autoscaling_config"]["target_ongoing_requests"] <= sched.max_num_seqs
        configs.append(config)
    return configs


def test_serve_yaml_is_a_valid_serve_config_that_builds():
    doc = yaml.safe_load(open("configs/serve.yaml"))
    (config,) = _check_serve_config(doc)
    app = serve_app.build_app(doc["applications"][0]["args"])  # binds; starts nothing
    assert type(app).__name__ == "Application"
    embedded = msgspec.to_builtins(serve_app.load_yaml("configs/embedded.yaml", ServeConfig))
    same = msgspec.to_builtins(config)
    for key in ("model_name", "engine", "experts"):  # the same model and engine as `make serve`
        assert same[key] == embedded[key], key


def test_build_app_args_errors_name_the_field_path():
    good = {"model_name": "m", "engine": {"model": "checkpoints/stdlib-moe-target"}}
    with pytest.raises(ConfigError, match=r"\$\.experts\.replicas"):
        serve_app.build_app({**good, "experts": {"replicas": "two"}})
    with pytest.raises(ConfigError, match=r"\$\.verifier"):
        serve_app.build_app({**good, "verifier": {"num_replicas": 0}})
    with pytest.raises(ConfigError, match="unknown field `colour`"):
        serve_app.build_app({**good, "colour": "red"})
    with pytest.raises(ConfigError, match="engine.model.*no/such"):
        serve_app.build_app({**good, "engine": {"model": "no/such"}})


@pytest.mark.parametrize("path", KUBERAY, ids=[p.name for p in KUBERAY])
def test_kuberay_manifest_embeds_a_valid_app_and_a_cluster_that_fits_it(path):
    manifest = yaml.safe_load(path.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    (config,) = _check_serve_config(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["authOptions"]["mode"] == "token"
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = cluster["workerGroupSpecs"]
    assert all(g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] and g["maxReplicas"] > 1 for g in groups)
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]] + [
        g["template"]["spec"]["containers"][0] for g in groups]
    for c in containers:  # traces reach the collector from every process
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" in {e["name"] for e in c["env"]}
        # the proxy (on any node) takes the HTTP -> ingress half of the app's serve_transport
        proxy_grpc = {e["name"]: e["value"] for e in c["env"]}.get("RAY_SERVE_PROXY_USE_GRPC", "0")
        assert proxy_grpc == ("1" if config.serve_transport == "grpc" else "0"), c["name"]
        # Serve's gRPC hops pass a message as large as the embedded start lets through
        assert {e["name"]: e["value"] for e in c["env"]}.get(serve_app.GRPC_MAX_MESSAGE_ENV) == str(
            serve_app.GRPC_MAX_MESSAGE_BYTES), c["name"]
    wants_gpu = config.engine.device == "cuda"
    gpu_groups = [g for g in groups if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    assert bool(gpu_groups) == wants_gpu
    for g in gpu_groups:
        tolerations = g["template"]["spec"].get("tolerations", [])
        assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
        advertised = yaml.safe_load(yaml.safe_load(g["rayStartParams"]["resources"]))  # '"{...}"' quoting
        assert set(config.experts.resources) <= set(advertised)
    if wants_gpu:
        assert config.experts.num_gpus > 0 and config.draft.num_gpus > 0 and config.experts.resources
