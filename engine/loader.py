"""Load a checkpoint directory into a ready model, tokenizer and generation settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from engine.chat_template import ChatTemplateSource, read_chat_template
from engine.checkpoint import CheckpointReader
from engine.config import ModelConfig, load_model_config, read_config_json
from engine.errors import CheckpointError, ConfigError
from engine.model import ExpertExecutor, ExpertStore, LocalExpertExecutor, Transformer
from engine.model.names import expert_names

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_dtype(model: str) -> str:
    """vLLM's ``dtype="auto"``: the checkpoint's own dtype (``config.json``'s ``torch_dtype``, or
    ``dtype`` in newer transformers) where it is one of :data:`DTYPES`, else ``"float32"``.

    Raises:
        CheckpointError: ``model`` has no readable config.json.
    """
    raw = read_config_json(Path(model), "a Hugging Face checkpoint directory")
    name = raw.get("torch_dtype") or raw.get("dtype")
    return name if name in DTYPES else "float32"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` or a torch dtype; raises ConfigError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def check_device_kind(device: str) -> None:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (the engine's kernels and KV cache run on CPU or CUDA);
    raises ConfigError otherwise. Whether a CUDA device exists is the start-up's check, where the
    model runs, not the config's."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device: {device!r} is not 'cpu', 'cuda' or 'cuda:N'")


def check_device_present(device: str, field: str = "device") -> None:
    """A CUDA ``device`` must exist where the model loads (checked before any weight is read).

    Raises:
        ConfigError: ``device`` is CUDA and torch sees no CUDA device, or ``cuda:N`` names a device
            this machine lacks; the message starts with ``field``.
    """
    index = torch.device(device).index if device.startswith("cuda") else None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{field}: {device!r}, but torch sees no CUDA device on this machine (torch "
                          f"{torch.__version__}); use device: cpu")
    if index is not None and index >= torch.cuda.device_count():
        raise ConfigError(f"{field}: {device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")


@dataclass
class LoadedModel:
    """A model with what serving it needs."""

    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer | None  # None with skip_tokenizer_init: token ids in, token ids out
    reader: CheckpointReader
    chat_template: ChatTemplateSource | None  # None with skip_tokenizer_init

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every end-of-sequence id (``generation_config.json`` may list several, e.g. Llama 3's
        ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``): any of them ends a sequence, as in
        transformers' ``generate``."""
        return frozenset(self.config.eos_token_ids)


def load_tokenizer(path: Path) -> tuple[Tokenizer, ChatTemplateSource]:
    """``tokenizer.json`` and the checkpoint's chat template (:func:`read_chat_template`)."""
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (pass skip_tokenizer_init to serve token ids only)")
    try:
        tokenizer = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise CheckpointError(f"{tok_file}: cannot be parsed ({e})") from e
    return tokenizer, read_chat_template(path)


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids, as ``tokenizer.encode(text, add_special_tokens=...).ids``, without
    holding the GIL meanwhile (``add_special_tokens``: the tokenizer's post-processor's, e.g. a BOS).

    ``Tokenizer.encode`` holds the GIL for the whole encoding (measured: 2.9 s for a 3.8 MB prompt,
    during which an event loop calling it through a thread answered nothing); ``encode_batch``
    releases it and gives the same ids.
    """
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def special_tokens_for(chat: bool, requested: bool | None = None) -> bool:
    """Whether a prompt gets the tokenizer's special tokens (a BOS), vLLM's ``add_special_tokens``:
    as ``requested``, else yes for a completion's prompt and no for a rendered chat, whose template
    writes its own (both gave Llama-3-like templates two BOS tokens)."""
    return requested if requested is not None else not chat


def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most characters one token can stand for, or None where no such bound holds.

    A byte-level BPE without a normalizer (GPT-2, Llama 3, Qwen) covers every byte of the text
    with tokens of known bytes, so a text of ``n`` characters (at least ``n`` UTF-8 bytes) has at
    least ``n / max token bytes`` tokens: a prompt can be refused as too long before it is
    tokenised (a 3.8 MB prompt took 2.9 s of CPU to tokenise only to be refused). Tokenizers that
    can map a span of any length to one token (WordPiece's or a fused BPE's unknown token) or
    that normalise the text first get None.
    """
    pre = tokenizer.pre_tokenizer
    if tokenizer.normalizer is not None or not isinstance(tokenizer.model, models.BPE) \
            or not isinstance(pre, pre_tokenizers.ByteLevel):
        return None
    # Special tokens' text counts too (the prompt may spell them); a token that ends inside a
    # character decodes to U+FFFD, 3 bytes, never fewer than its own.
    return max(len(tokenizer.decode([i], skip_special_tokens=False).encode())
               for i in range(tokenizer.get_vocab_size(with_added_tokens=True)))


def check_every_tensor_used(reader: CheckpointReader, config: ModelConfig, experts_elsewhere: bool) -> None:
    """After loading: a stored tensor the model never read means the config does not describe the
    checkpoint (more layers than ``num_hidden_layers``, MLP or other biases the architecture lacks),
    and ignoring it gave output unlike transformers' for the same weights.

    Args:
        experts_elsewhere: the routed experts are loaded by another executor (expert actors, an
            offloading store), so their tensors are not expected to be read here.

    Raises:
        ConfigError: tensors of layers past ``config.num_hidden_layers`` (named with the first one).
        CheckpointError: any other unread tensor (the first few named).
    """
    skipped = set()
    if experts_elsewhere and config.moe is not None:
        skipped = {name for layer in config.moe.sparse_layers for e in range(config.moe.num_experts)
                   for name in expert_names(config, layer, e)}
    unused = [n for n in reader.unread() if n not in skipped and not n.endswith("rotary_emb.inv_freq")
              and not (config.tie_word_embeddings and n == "lm_head.weight")]
    beyond = [n for n in unused if _layer_index(n) >= config.num_layers]
    if beyond:
        raise ConfigError(f"config.num_hidden_layers: {config.num_layers}, but the checkpoint has tensors of "
                          f"later layers (e.g. {beyond[0]!r})")
    if unused:
        raise CheckpointError(f"{reader.dir}: {len(unused)} tensor(s) the {config.architecture} model does not "
                              f"use, e.g. {unused[:3]}: the config does not describe this checkpoint (or it has "
                              f"a feature specmoe lacks)")


def _layer_index(name: str) -> int:
    """``i`` of a ``model.layers.{i}.`` tensor name, -1 for any other name."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    experts: ExpertExecutor | None = None,
    skip_tokenizer_init: bool = False,
    compile: bool = False,
) -> LoadedModel:
    """Load a checkpoint; MoE experts run in-process unless another executor is given.

    Args:
        skip_tokenizer_init: load no tokenizer (``tokenizer.json`` may be absent): the model then
            takes token-id prompts and produces token ids with empty text (vLLM's option).
        compile: the layers' dense parts under ``torch.compile`` (see :class:`engine.model.Transformer`).

    Raises:
        CheckpointError / ConfigError: see :class:`CheckpointReader` and :func:`load_model_config`;
            ConfigError also for a CUDA ``device`` this machine lacks (:func:`check_device_present`).
    """
    path = Path(path)
    if not path.is_dir():
        what = "is a file; pass its directory" if path.is_file() else "does not exist"
        raise CheckpointError(f"checkpoint directory {str(path)!r} {what}")
    torch_dtype = resolve_dtype(dtype)
    check_device_present(device)
    config = load_model_config(path)
    reader = CheckpointReader(path)
    experts_elsewhere = experts is not None
    if config.is_moe and experts is None:
        store = ExpertStore(reader, config, dtype=torch_dtype, device=device)
        store.load_all()
        experts = LocalExpertExecutor(store)
    model = Transformer(config, reader, experts, torch_dtype, device, compile)
    check_every_tensor_used(reader, config, experts_elsewhere)
    tokenizer, template = (None, None) if skip_tokenizer_init else load_tokenizer(path)
    return LoadedModel(path, config, model, tokenizer, reader, template)
