"""``safe``: the decorator that keeps telemetry errors out of request code."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("observability")

F = TypeVar("F", bound=Callable[..., Any])

_LOG_INTERVAL_S = 60.0
_last_logged: dict[str, float] = {}


def safe(fn: F) -> F:
    """Wrap ``fn`` so an exception is logged (once per function per minute, so a broken metric
    on a hot path doesn't flood the logs) and ``None`` is returned instead."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:
            name = fn.__qualname__
            now = time.monotonic()
            if now - _last_logged.get(name, -_LOG_INTERVAL_S) >= _LOG_INTERVAL_S:
                _last_logged[name] = now
                logger.warning("observability: %s failed (suppressed for %.0f s)", name, _LOG_INTERVAL_S,
                               exc_info=True)
            return None

    return wrapper  # type: ignore[return-value]
