"""One Prometheus text page from several sources: this process's registries plus text fetched
from other components (e.g. the ingress serving the verifier's ``render()`` output).

Families with the same name from different sources are merged into one (one HELP/TYPE block,
as the format requires); a series (same sample name and labels) present in more than one source
is kept from the FIRST source only, so list the authoritative source first. ``*_created``
samples are left out: they double the series count and nothing here reads them. A source given
as ``(source, labels)`` has ``labels`` added to every series (e.g. the replica it came from, so
the pages of several replicas merge into one without a series of one hiding another's).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

logger = logging.getLogger("observability")

# The classic text format (what generate_latest writes), which every Prometheus accepts.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Source = Collector | bytes | str
Labelled = tuple[Source, dict[str, str]]


def _families(source: Source | Labelled) -> Iterable:
    if isinstance(source, tuple):
        source, labels = source
        families = _families(source)
        for fam in families:
            fam.samples = [s._replace(labels={**s.labels, **labels}) for s in fam.samples]
        return families
    if isinstance(source, bytes):
        source = source.decode("utf-8", errors="replace")
    if isinstance(source, str):
        return list(text_string_to_metric_families(source))
    return list(source.collect())


class _Merged(Collector):
    """A collector that replays already-collected families (what generate_latest needs)."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


def render(*sources: Source | Labelled) -> bytes:
    """Prometheus text (serve with ``CONTENT_TYPE``) of all ``sources``: ``CollectorRegistry``
    objects and/or text/bytes produced by another process's ``render``, each alone or with labels
    to add to its series (``(source, {"replica": "..."})``). A source that fails to
    collect or parse is skipped (logged). Never raises."""
    merged: dict[str, object] = {}
    seen_series: set[tuple[str, tuple]] = set()
    for i, source in enumerate(sources):
        try:
            families = _families(source)
        except Exception:
            logger.warning("metrics source #%d could not be read; skipped", i, exc_info=True)
            continue
        for fam in families:
            try:
                target = merged.get(fam.name)
                if target is None:
                    target = merged[fam.name] = _empty_like(fam)
                elif target.type != fam.type:
                    logger.warning("metric %s is %s in one source and %s in another; keeping the first",
                                   fam.name, target.type, fam.type)
                    continue
                created = fam.name + "_created"
                for s in fam.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    if s.name == created or key in seen_series:
                        continue
                    seen_series.add(key)
                    target.samples.append(s)
            except Exception:
                logger.warning("metric family from source #%d skipped", i, exc_info=True)
    try:
        return generate_latest(_Merged([f for f in merged.values() if f.samples]))
    except Exception:
        logger.warning("rendering metrics failed", exc_info=True)
        return b""


def _empty_like(fam):
    from prometheus_client.metrics_core import Metric

    out = Metric(fam.name, fam.documentation, fam.type, getattr(fam, "unit", ""))
    out.samples = []
    return out
