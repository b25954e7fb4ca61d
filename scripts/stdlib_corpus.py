"""The Python-stdlib source corpus used to train the bundled tiny model pair.

This module is the ONE place that defines the held-out split: ``HELDOUT_MODULES`` is imported by
``train_tiny.py`` (which excludes those modules from training), by ``make_prompts.py`` (which draws
benchmark prompts only from them) and by the tests. Keep no copy of the list anywhere else.

A "module name" here is the top-level import name of a file under the stdlib directory: ``json``
for ``json/decoder.py``, ``argparse`` for ``argparse.py``. Each source file is one document.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Held-out top-level stdlib modules/packages, chosen by name (not at random) so the split is
# reproducible on any CPython 3.11 install. Together they are ~10% of the non-test stdlib source
# by bytes (train_tiny.py prints the exact share). A mix of big packages and single-file modules
# so the benchmark prompts cover several coding styles.
HELDOUT_MODULES: tuple[str, ...] = (
    "argparse",
    "configparser",
    "difflib",
    "email",
    "fractions",
    "http",
    "ipaddress",
    "json",
    "shutil",
    "statistics",
    "tarfile",
    "textwrap",
)

# Directory names that hold test suites (``test``, ``tests``, ``idlelib/idle_test``,
# ``lib2to3/tests``, ``ctypes/test`` ...). Tests are excluded everywhere: they are huge, repetitive
# and would dominate a 12 MB corpus.
TEST_DIR_NAMES: frozenset[str] = frozenset({"test", "tests", "idle_test"})

EXCLUDED_DIR_NAMES: frozenset[str] = frozenset({"site-packages", "__pycache__"})

EOT_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class SourceFile:
    """One stdlib source file.

    Attributes:
        relpath: path relative to the stdlib root, POSIX separators (e.g. ``"json/decoder.py"``).
        module: top-level module name (e.g. ``"json"``).
        text: full file contents, decoded as UTF-8.
    """

    relpath: str
    module: str
    text: str


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python stdlib."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_of(relpath: str) -> str:
    """Top-level module name for a stdlib-relative path: ``"email/mime/text.py"`` -> ``"email"``."""
    first = relpath.split("/", 1)[0]
    return first[:-3] if first.endswith(".py") else first


def _is_excluded(rel: Path) -> bool:
    """True for files inside site-packages, caches or any test directory."""
    dirs = rel.parts[:-1]
    return any(d in EXCLUDED_DIR_NAMES or d in TEST_DIR_NAMES for d in dirs)


def list_source_files(split: str, root: Path | None = None) -> list[SourceFile]:
    """All non-test stdlib ``*.py`` files of one split, sorted by relative path (deterministic).

    Args:
        split: ``"train"`` (everything not held out), ``"heldout"`` (only ``HELDOUT_MODULES``) or
            ``"all"``.
        root: stdlib directory; defaults to :func:`stdlib_root`.

    Files that are not valid UTF-8 are skipped (none are in CPython 3.11 outside test dirs), so
    every document round-trips through the byte-level tokenizer as text.
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    root = stdlib_root() if root is None else root
    heldout = set(HELDOUT_MODULES)
    out: list[SourceFile] = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if _is_excluded(rel) or not path.is_file():
            continue
        relpath = rel.as_posix()
        module = module_of(relpath)
        if split == "train" and module in heldout:
            continue
        if split == "heldout" and module not in heldout:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(SourceFile(relpath=relpath, module=module, text=text))
    return out


def heldout_share(train: list[SourceFile], heldout: list[SourceFile]) -> float:
    """Held-out fraction of the (train + held-out) corpus, in UTF-8 bytes (0..1)."""
    nbytes = lambda files: sum(len(f.text.encode("utf-8")) for f in files)  # noqa: E731
    h = nbytes(heldout)
    return h / (h + nbytes(train))
