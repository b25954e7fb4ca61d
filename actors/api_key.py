"""The API key of the serve config (``http.api_key``, vLLM's ``--api-key``): where it comes from,
and that a printed config never shows it."""

from __future__ import annotations

import os
from collections.abc import Iterator

API_KEY_ENV = "SPECMOE_API_KEY"  # vLLM's VLLM_API_KEY: the key when http.api_key is not set
REDACTED = "<redacted>"


class ApiKeyHolder:
    """Mixin of the msgspec Struct with the ``api_key`` field (:class:`actors.config.HttpConfig`),
    listed before ``msgspec.Struct`` in its bases.

    A config ends up in log lines, tracebacks and f-string error messages by its repr, so repr,
    str and rich's pretty repr show a set key as ``'<redacted>'``; the field itself (what
    ``msgspec.to_builtins`` hands the ingress) keeps the key.
    """

    __slots__ = ()  # a msgspec Struct takes only slot-less mixins

    def resolved_api_key(self) -> str | None:
        """``api_key``, else ``$SPECMOE_API_KEY`` (empty: unset), else None (no key needed)."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None

    def __rich_repr__(self) -> Iterator[tuple[str, object]]:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            yield name, REDACTED if name == "api_key" and value is not None else value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in self.__rich_repr__())})"
