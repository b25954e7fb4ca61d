"""Transport-free decoder-only transformer with a pluggable MoE expert executor."""

from engine.model.batch import ForwardBatch
from engine.model.moe import ExpertExecutor, ExpertStore, LocalExpertExecutor
from engine.model.transformer import Transformer

__all__ = ["ExpertExecutor", "ExpertStore", "ForwardBatch", "LocalExpertExecutor", "Transformer"]
