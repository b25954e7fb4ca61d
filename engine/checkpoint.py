"""Lazy reading of Hugging Face safetensors checkpoints by on-disk tensor name.

A process reads only the tensors it asks for (an expert actor loads only its experts), from a single
``model.safetensors`` or the shards listed in ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import CheckpointError


class CheckpointReader:
    """Maps tensor names to shard files and loads tensors on demand.

    Args:
        checkpoint_dir: directory with ``*.safetensors`` (+ optional ``model.safetensors.index.json``).

    Raises:
        CheckpointError: no safetensors file, an index naming a missing shard, or a corrupt or
            truncated file (the message names the file).
    """

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.dir = Path(checkpoint_dir)
        self._files: dict[Path, object] = {}
        self._where: dict[str, Path] = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            where = {name: self.dir / shard for name, shard in weight_map.items()}
            for shard in set(where.values()):
                if not shard.is_file():
                    raise CheckpointError(f"{index}: shard {shard.name} is listed but missing")
            return where
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors file")
        return {name: f for f in files for name in self._open(f).keys()}

    def _open(self, path: Path):
        handle = self._files.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from e
            self._files[path] = handle
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(
        self,
        name: str,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Load one tensor.

        Args:
            name: on-disk name, e.g. ``model.layers.0.block_sparse_moe.experts.3.w1.weight``.
            shape: expected shape; a mismatch is an error naming both shapes.
            dtype: cast to this dtype (None keeps the stored one).
            device: where the tensor goes.

        Raises:
            CheckpointError: missing tensor, shape mismatch, or unreadable data.
        """
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        try:
            tensor = self._open(path).get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from e
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
            )
        return tensor.to(device=device, dtype=dtype or tensor.dtype)
