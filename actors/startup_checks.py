"""Start-up checks of a serve config that need more than the config: the target checkpoint's
model config, or the Ray node the embedded server starts on (``serve_app.start`` runs them before
anything is deployed, so a mistake is one line naming the field, not failed replicas)."""

from __future__ import annotations

from actors.config import ServeConfig
from engine.config import ModelConfig


class StartupError(RuntimeError):
    """The server cannot start; the message says why."""


def check_experts(config: ServeConfig, model: ModelConfig) -> None:
    """What the ``experts`` section can only be checked against the target (``model``), here rather
    than in every expert actor: groups named in ``hot_expert_replicas`` exist, and a byte budget of
    resident experts holds one layer's held experts plus the pinned ones."""
    x = config.experts
    num_groups = -(-model.moe.num_experts // x.experts_per_actor)
    for group in x.hot_expert_replicas:
        if group >= num_groups:
            raise StartupError(f"experts.hot_expert_replicas: group {group} does not exist ({model.moe.num_experts} "
                               f"experts, {x.experts_per_actor} per actor: groups 0-{num_groups - 1})")
    if x.max_resident_bytes is None:
        return
    from engine.loader import resolve_dtype
    from engine.model.moe import expert_entry_bytes

    entry_bytes = expert_entry_bytes(model, resolve_dtype(config.engine.dtype))
    entries = min(x.experts_per_actor, model.moe.num_experts) + x.pinned_hot_experts
    if x.max_resident_bytes < entries * entry_bytes:
        raise StartupError(f"experts.max_resident_bytes must be >= {entries * entry_bytes} (one layer's "
                           f"{entries} held and pinned experts of {entry_bytes} bytes), got {x.max_resident_bytes}")


def check_fits_this_machine(config: ServeConfig, resources: dict[str, float]) -> None:
    """On the embedded Ray (this machine alone, no autoscaler): an actor asking for more CPUs or
    GPUs than the node has would wait forever for a place (Serve logs that every 30 s and the start
    hangs). ``resources``: ``ray.cluster_resources()``."""
    asks = {"verifier": config.verifier, "ingress": config.ingress, "draft": config.draft}
    for section, ask in asks.items():
        for field, name in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
            if getattr(ask, field) > resources.get(name, 0.0):
                raise StartupError(f"{section}.{field} = {getattr(ask, field):g}, but this machine's Ray has "
                                   f"{resources.get(name, 0.0):g} {name}s: the replica could never be placed")
    if config.experts.num_gpus > resources.get("GPU", 0.0):
        raise StartupError(f"experts.num_gpus = {config.experts.num_gpus:g}, but this machine's Ray has "
                           f"{resources.get('GPU', 0.0):g} GPUs: the expert actors could never be placed")
