"""Typed YAML configs: decode with msgspec so every error names its field path."""

from __future__ import annotations

import copy
import datetime
import re
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


# YAML 1.2 (and JSON) read 5e3 and 1e-3 as numbers; PyYAML's YAML 1.1 rules want a dot (5.0e+3)
# and read them as strings, so `ttft_ms: 5e3` was "Expected `float | null`, got `str`".
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"))


def load_yaml(path: str | Path, schema: type[T]) -> T:
    """Read ``path`` as ``schema`` (a msgspec Struct with ``forbid_unknown_fields``).

    Raises:
        ConfigError: missing file (or a directory), invalid YAML (a key given twice included), an unknown field, a wrong type or an out-of-range
            value; the message names the file and the field path (e.g. ``$.scheduler.max_num_seqs``).
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        tree = yaml.load(path.read_bytes(), _UniqueKeyLoader)
    except (yaml.YAMLError, ValueError, LookupError, AttributeError, TypeError) as e:  # as msgspec.yaml
        raise ConfigError(f"{path}: invalid YAML ({e})") from e
    if tree is None:
        raise ConfigError(f"{path}: the file is empty (expected the fields of {schema.__name__})")
    try:
        return _convert(tree, schema)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {_with_dict_keys(tree, schema, str(e))}") from e
    except (ValueError, TypeError) as e:  # raised by a Struct's __post_init__, which names its field
        raise ConfigError(f"{path}: {e}") from e


def _convert(tree: object, schema: type[T]) -> T:
    """What msgspec.yaml.decode does after its own yaml.load."""
    return msgspec.convert(tree, schema, builtin_types=(datetime.datetime, datetime.date))


_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _with_dict_keys(tree: object, schema: type, message: str) -> str:
    """``message`` with each ``[...]`` of its path (msgspec does not keep a dict entry's key)
    replaced by the key: the entry that alone, its dict's other entries left out, raises the same
    error (e.g. ``$.engine.scheduler.slo_classes.interactive``). Unchanged if none does."""
    head, sep, path = message.rpartition(" - at `$")
    if not sep or "[...]" not in path:
        return message
    path = path.rstrip("`")
    trail: list = []  # keys and indexes from the root to the current node
    for m in _SEGMENT.finditer(path):
        name, index = m.groups()
        if index != "...":
            trail.append(name if name is not None else int(index))
            continue
        key = _failing_key(tree, schema, trail, message)
        if key is None:
            return message
        trail.append(key)
    named = "".join(f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]" for k in trail)
    return f"{head} - at `${named}`"


def _failing_key(tree: object, schema: type, trail: list, message: str) -> object | None:
    """The key of the dict at ``trail`` whose entry alone raises ``message``, or None."""
    node = tree
    for k in trail:
        node = node[k]
    if not isinstance(node, dict):
        return None
    for key, value in node.items():
        trial = copy.deepcopy(tree)
        parent = trial
        for k in trail:
            parent = parent[k]
        parent.clear()
        parent[key] = value
        try:
            _convert(trial, schema)
        except msgspec.ValidationError as e:
            if str(e) == message:
                return key
        except (ValueError, TypeError):  # another rule (e.g. a default class now missing) fired first
            continue
    return None
