"""Type checks for msgspec Structs built by hand (``SamplingParams(...)``, ``EngineArgs(...)``).

msgspec checks a Struct's field types when it decodes or converts one, not when code calls the
constructor, so a hand-built ``SamplingParams(max_tokens=3.7)`` would travel into a step and fail
there, taking the step's other requests with it. :func:`check_field_types` applies the same
conversion msgspec's decoder would (an int is a valid float; a bool is not an int) at
construction, so a wrong type is refused up front, naming the field.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import msgspec


def check_field_types(obj: msgspec.Struct, error: Callable[[str, str], Exception]) -> None:
    """Convert every field of ``obj`` to its annotated type in place (``3`` -> ``3.0`` for a float
    field; a dict for a nested Struct field becomes that Struct).

    Raises:
        what ``error(field_name, message)`` returns, for the first field whose value has the wrong
        type (message: msgspec's, e.g. "Expected `int`, got `float`").
    """
    for field in _fields(type(obj)):
        value = getattr(obj, field.name)
        try:
            setattr(obj, field.name, msgspec.convert(value, field.type))
        except msgspec.ValidationError as e:
            raise error(field.name, str(e)) from None


@functools.cache
def _fields(cls: type) -> tuple:
    """``msgspec.structs.fields(cls)``, resolved once per class (it re-reads the type hints:
    ~140 us a call; a whole SamplingParams construction is ~20 us with it cached)."""
    return msgspec.structs.fields(cls)
