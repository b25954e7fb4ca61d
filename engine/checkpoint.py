"""Lazy reading of Hugging Face safetensors checkpoints by on-disk tensor name.

A process reads only the tensors it asks for (an expert actor loads only its experts), from a single
``model.safetensors`` or the shards listed in ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
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
        self._maps: dict[Path, tuple[torch.Tensor, int, dict]] = {}  # file -> (bytes, data start, header)
        self._where: dict[str, Path] = self._index()
        self.read: set[str] = set()  # names loaded or viewed so far (:meth:`unread`)

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

    def unread(self) -> list[str]:
        """Stored tensors nothing has loaded or viewed yet, sorted."""
        return sorted(self._where.keys() - self.read)

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
            CheckpointError: missing tensor, shape mismatch, integer data where floating-point
                ``dtype`` is asked for, or unreadable data.
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
        if dtype is not None and dtype.is_floating_point and (not tensor.dtype.is_floating_point
                                                              or tensor.element_size() == 1):
            # Integer or float8 weights are a broken or quantised export (scales elsewhere): a
            # silent cast computes garbage.
            raise CheckpointError(f"{path}: tensor {name!r} is stored as {tensor.dtype}, expected bfloat16, "
                                  f"float16 or float32 weights")
        self.read.add(name)
        return tensor.to(device=device, dtype=dtype or tensor.dtype)

    def view(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """A zero-copy, read-only view of one tensor in the memory-mapped file, stored dtype (the
        slow tier of an offloading expert store reads and converts it in one ``copy_``; never write
        to it). Follows the safetensors layout: an 8-byte little-endian header length, a JSON header
        of ``{name: {dtype, shape, data_offsets}}``, then the data.

        Raises:
            CheckpointError: missing tensor, shape mismatch, or a dtype torch cannot view.
        """
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        data, start, header = self._mapped(path)
        meta = header[name]
        if tuple(meta["shape"]) != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(meta['shape'])}, expected {tuple(shape)}")
        if meta["dtype"] not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {meta['dtype']}, which cannot be viewed")
        begin, end = meta["data_offsets"]
        self.read.add(name)
        return data[start + begin:start + end].view(_SAFETENSORS_DTYPES[meta["dtype"]]).view(tuple(shape))

    def _mapped(self, path: Path) -> tuple[torch.Tensor, int, dict]:
        entry = self._maps.get(path)
        if entry is None:
            with open(path, "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            (length,) = struct.unpack("<Q", mapping[:8])
            header = json.loads(mapping[8:8 + length])
            with warnings.catch_warnings():  # read-only buffer: views are only ever read
                warnings.simplefilter("ignore", UserWarning)
                entry = (torch.frombuffer(mapping, dtype=torch.uint8), 8 + length, header)
            self._maps[path] = entry
        return entry


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
