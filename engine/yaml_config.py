"""Typed YAML configs: decode with msgspec so every error names its field path."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

from engine.errors import ConfigError

T = TypeVar("T")


def load_yaml(path: str | Path, schema: type[T]) -> T:
    """Read ``path`` as ``schema`` (a msgspec Struct with ``forbid_unknown_fields``).

    Raises:
        ConfigError: missing file, invalid YAML, an unknown field, a wrong type or an out-of-range
            value; the message names the file and the field path (e.g. ``$.scheduler.max_num_seqs``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return msgspec.yaml.decode(path.read_bytes(), type=schema)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from e
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: invalid YAML ({e})") from e
    except (ValueError, TypeError) as e:  # raised by a Struct's __post_init__, which names its field
        raise ConfigError(f"{path}: {e}") from e
