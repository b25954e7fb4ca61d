"""Write a routing-skewed copy of an MoE checkpoint: every router gate zeroed.

    python scripts/skew_checkpoint.py checkpoints/stdlib-moe-target /tmp/skewed-target

With all gate logits equal, top-k routing takes the lowest expert ids (ties go to the lower
index), so every token of every MoE layer is routed to experts 0..k-1: the worst case of routing
skew, for the online replication test and benchmark (nothing else changes, so the output is still
the checkpoint's own, deterministic function of its weights).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def write_skewed_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Copy ``src`` to ``dst`` with every ``*.block_sparse_moe.gate.weight`` zeroed; returns ``dst``.

    Raises:
        ValueError: ``src`` has no router gate tensor (not a Mixtral-style MoE checkpoint).
    """
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    gates = 0
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
            continue
        tensors = load_file(str(f))
        for name in tensors:
            if name.endswith("block_sparse_moe.gate.weight"):
                tensors[name] = torch.zeros_like(tensors[name])
                gates += 1
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    if not gates:
        raise ValueError(f"{src}: no block_sparse_moe.gate.weight tensor to zero")
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args()
    print(write_skewed_checkpoint(args.src, args.dst))


if __name__ == "__main__":
    main()
