"""specmoe's version, as ``GET /version`` answers it (vLLM's route) and the app carries it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _installed_version() -> str:
    """The installed package's version (pyproject.toml's), or ``dev`` where the sources run
    uninstalled (a Serve ``working_dir``), as vLLM falls back when it has no version file."""
    try:
        return version("specmoe")
    except PackageNotFoundError:
        return "dev"


VERSION = _installed_version()
