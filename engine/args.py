"""Engine configuration (a msgspec Struct, so YAML configs are validated with field paths)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from engine.checkpoint import CheckpointReader
from engine.drafters.base import Drafter, NoneDrafter
from engine.drafters.ngram import NgramDrafter
from engine.errors import ConfigError
from engine.field_types import check_field_types
from engine.loader import (
    LoadedModel,
    auto_dtype,
    check_device_kind,
    load_model,
    load_tokenizer,
    resolve_dtype,
)
from engine.sampling_params import MAX_SPECULATIVE_TOKENS
from engine.scheduler import SchedulerConfig
from engine.spec_controller import SpeculativePolicy

if TYPE_CHECKING:
    from engine.config import ModelConfig

DEFAULT_K = 4


class EngineArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What to load and how to run it.

    Attributes:
        model: target checkpoint directory.
        draft_model: draft checkpoint directory (needed by ``speculative_method="draft"``), or the
            EAGLE-3 head directory with ``"eagle3"`` (:mod:`engine.model.eagle3`).
        speculative_method: "draft", "eagle3", "ngram" or None (plain decoding). Defaults to
            "draft" when a draft model is given.
        num_speculative_tokens: default draft length k (0..16); None means 4 with a method. With
            the adaptive policy it is the most a sequence drafts.
        speculative_policy: "adaptive" (default) chooses each sequence's draft length per step,
            0 included, to maximise emitted tokens per second (engine/spec_controller.py);
            "fixed" always drafts k.
        pipelined_drafting: with a draft model, draft each greedy sequence's next window while the
            target verifies this one, on the assumption that it is fully accepted
            (engine/drafters/pipelined.py); off by default.
        dtype: "float32", "bfloat16" or "float16"; "auto": the target checkpoint's own (vLLM's
            default; :func:`engine.loader.auto_dtype`).
        device: torch device string, e.g. "cpu" or "cuda".
        max_model_len: context window; None uses the target's ``max_position_embeddings``.
        ngram_min_n, ngram_max_n: n-gram sizes of the prompt-lookup drafter.
        skip_tokenizer_init: load no tokenizer (the checkpoint may lack ``tokenizer.json``):
            prompts must be token ids, outputs are token ids with empty text, and stop strings are
            refused (vLLM's option). Draft models never load one.
        compile: run the target's and the draft model's per-layer dense parts (norms, projections,
            RoPE) under ``torch.compile``; off by default: it did not pay with the bundled
            checkpoints on a 2-core CPU, nor on an H200 with Mixtral-shaped layers (TPOT 3.87 vs
            3.04 ms at batch 1; docs/BENCHMARKS.md). Needs a C++ compiler on CPU, Triton on CUDA;
            the first forward of each new shape class compiles (seconds).
        scheduler: batching limits.
    """

    model: str
    draft_model: str | None = None
    speculative_method: Literal["draft", "eagle3", "ngram"] | None = None
    num_speculative_tokens: int | None = None
    speculative_policy: SpeculativePolicy = "adaptive"
    pipelined_drafting: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    skip_tokenizer_init: bool = False
    compile: bool = False
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        # Paths may come as pathlib objects; every other field must have its annotated type.
        for name in ("model", "draft_model"):
            if isinstance(path := getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(path))
        check_field_types(self, lambda name, message: ConfigError(f"{name}: {message}"))
        if self.dtype != "auto":  # "auto" needs the checkpoint: resolve_auto_dtype, at start-up
            resolve_dtype(self.dtype)  # a bad name fails here, not in every replica that loads the model
        check_device_kind(self.device)
        if self.speculative_method is None and self.draft_model is not None:
            self.speculative_method = "draft"
        if self.speculative_method in ("draft", "eagle3") and self.draft_model is None:
            raise ConfigError(f"draft_model: speculative_method {self.speculative_method!r} needs draft_model")
        if self.speculative_method == "ngram" and self.draft_model is not None:
            raise ConfigError(f"draft_model: speculative_method 'ngram' drafts from the prompt and uses no draft "
                              f"model, got {self.draft_model!r}")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_K if self.speculative_method else 0
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens: must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                              f"got {self.num_speculative_tokens}")
        if self.num_speculative_tokens and self.speculative_method is None:
            # vLLM too refuses a draft length without a way to draft (else: plain decoding, silently)
            raise ConfigError(f"num_speculative_tokens: {self.num_speculative_tokens} needs a speculative_method "
                              f"(draft, eagle3 or ngram); plain decoding takes 0")
        if self.pipelined_drafting and self.speculative_method != "draft":
            raise ConfigError("pipelined_drafting: needs speculative_method 'draft' (a draft model drafts ahead)")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ConfigError("ngram_min_n/ngram_max_n: need 1 <= ngram_min_n <= ngram_max_n")

    def resolve_auto_dtype(self) -> None:
        """``dtype="auto"`` (vLLM's default) becomes the target checkpoint's own
        (:func:`engine.loader.auto_dtype`); called once where a start-up has the checkpoint's
        final path, so every replica and actor loads the same dtype."""
        if self.dtype == "auto":
            self.dtype = auto_dtype(self.model)

    def check_checkpoints(self, section: str = "") -> ModelConfig:
        """The named checkpoints against this config, without loading weights: the target's and
        the draft's config.json parse, they share a vocabulary, an EAGLE-3 head fits the target,
        ``max_model_len`` fits the target's window, every checkpoint's safetensors headers read,
        and the target's tokenizer parses (unless ``skip_tokenizer_init``); a ``dtype`` of "auto"
        is resolved. A start-up calls this so a mismatch is one error, not a failure in every
        replica that loads the models (a truncated safetensors file or a missing tokenizer.json
        used to fail each replica three times, after Ray and Serve had started, behind a generic
        "did not deploy"). Returns the target's config (for the start-up's other checks).
        ``section``: the field path's prefix in messages (``"engine."`` in a serve config).

        Raises:
            CheckpointError: a missing or unparsable config.json, tokenizer.json or safetensors
                file (the file named).
            ConfigError: an unsupported or mismatched checkpoint (the file and field named), or
                ``max_model_len`` outside ``[2, max_position_embeddings]``.
        """
        from engine.config import context_window

        target = _model_config(self.model, f"{section}model")
        self.resolve_auto_dtype()
        context_window(self.max_model_len, target.max_position_embeddings, f"{section}max_model_len")
        CheckpointReader(self.model)  # reads every file's header: raises on a missing, truncated or corrupt one
        if not self.skip_tokenizer_init:
            load_tokenizer(Path(self.model))
        if self.speculative_method == "eagle3":
            from engine.model.eagle3 import load_eagle3_config

            load_eagle3_config(Path(self.draft_model), target)
        elif self.speculative_method == "draft":
            draft = _model_config(self.draft_model, f"{section}draft_model")
            _check_draft_vocab(draft.vocab_size, target.vocab_size, f"{section}draft_model")
        if self.speculative_method in ("eagle3", "draft"):
            CheckpointReader(self.draft_model)
        return target

    def build_drafter(self, target: LoadedModel, max_model_len: int) -> Drafter:
        """The drafter this config names, sized like the target's scheduler."""
        if self.speculative_method == "ngram":
            return NgramDrafter(self.ngram_min_n, self.ngram_max_n)
        if self.speculative_method == "eagle3":
            from engine.drafters.eagle import EagleDrafter
            from engine.model.eagle3 import Eagle3Head

            head = Eagle3Head(self.draft_model, target.config, target.model.embed, resolve_dtype(self.dtype), self.device)
            return EagleDrafter(head, self.scheduler.max_num_seqs, max_model_len)
        if self.speculative_method == "draft":
            from engine.drafters.draft_model import DraftModelDrafter

            draft = load_model(self.draft_model, self.dtype, self.device, skip_tokenizer_init=True,
                               compile=self.compile)
            _check_draft_vocab(draft.config.vocab_size, target.config.vocab_size)
            drafter = DraftModelDrafter(draft, self.scheduler.max_num_seqs, max_model_len)
            if self.pipelined_drafting:
                from engine.drafters.pipelined import PipelinedDrafter

                return PipelinedDrafter(drafter)
            return drafter
        return NoneDrafter()


def _check_draft_vocab(draft_vocab_size: int, target_vocab_size: int, field: str = "draft_model") -> None:
    if draft_vocab_size != target_vocab_size:
        raise ConfigError(f"{field}: vocab size {draft_vocab_size} differs from the "
                          f"target's {target_vocab_size} (they must share a tokenizer)")


def _model_config(path: str, field: str) -> ModelConfig:
    """``load_model_config(path)`` with the config field that named it in any ConfigError."""
    from engine.config import load_model_config

    try:
        return load_model_config(path)
    except ConfigError as e:
        raise ConfigError(f"{field}: {path}: {e}") from None
