"""Typed YAML configs: decode with msgspec so every error names its field path."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TypeVar

import msgspec
import yaml

from engine.errors import ConfigError

T = TypeVar("T")


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """PyYAML's safe loader (msgspec.yaml's), refusing a key given twice in one mapping: YAML
    forbids it, and PyYAML would keep the last silently (a second ``engine:`` section would
    replace the first one whole)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path, schema: type[T]) -> T:
    """Read ``path`` as ``schema`` (a msgspec Struct with ``forbid_unknown_fields``).

    Raises:
        ConfigError: missing file, invalid YAML (a key given twice included), an unknown field, a wrong type or an out-of-range
            value; the message names the file and the field path (e.g. ``$.scheduler.max_num_seqs``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        tree = yaml.load(path.read_bytes(), _UniqueKeyLoader)
    except (yaml.YAMLError, ValueError, LookupError, AttributeError, TypeError) as e:  # as msgspec.yaml
        raise ConfigError(f"{path}: invalid YAML ({e})") from e
    if tree is None:
        raise ConfigError(f"{path}: the file is empty (expected the fields of {schema.__name__})")
    try:  # what msgspec.yaml.decode does after its own yaml.load
        return msgspec.convert(tree, schema, builtin_types=(datetime.datetime, datetime.date))
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from e
    except (ValueError, TypeError) as e:  # raised by a Struct's __post_init__, which names its field
        raise ConfigError(f"{path}: {e}") from e
