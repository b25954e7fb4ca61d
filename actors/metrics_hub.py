"""Every replica's metrics in each scrape of ``/metrics``, whichever replica answers it.

Each ingress and verifier replica keeps its own Prometheus registry (request histograms in the
ingress, engine counters in the verifier). Serve routes a call to one replica of a deployment, so
the ingress asking "the verifier" for its metrics got one replica per scrape, and with several
replicas successive scrapes jumped between them (docs/OBSERVABILITY.md). A :class:`MetricsHub` (one
named Ray actor per application) is where the replicas meet for a scrape:

- every replica long-polls the hub (:meth:`MetricsHub.wait_scrape`, :class:`MetricsPublisher`);
- a scrape (:meth:`MetricsHub.scrape`, called by the ingress replica serving ``GET /metrics``)
  wakes them all; each renders its registry (off its event loop) and delivers the text;
- the scrape returns every live replica's latest text once all delivered or after
  ``timeout_s`` (a replica that did not answer in time is served from its last delivery), and the
  ingress renders them as one page, each series labelled ``replica``.

Rendering happens only when scraped, as before, so an unscraped server pays nothing. A replica
counts as live while it polled within ``forget_after_s``; a dead one drops out of the pages after
that (Prometheus then sees its series end, and ``sum(rate(...))`` stops counting it), one shutting
down at once. The hub is an ordinary actor owned by the ingress replica that made it; if it dies
with that replica, another ingress replica makes a new one at its next scrape or poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

KEEPALIVE_S = 10.0  # a publisher's poll returns after this long without a scrape, and polls again
FORGET_AFTER_S = 3 * KEEPALIVE_S  # a replica not heard from for this long is dropped from the pages
SCRAPE_TIMEOUT_S = 2.0  # a scrape waits this long at most for the replicas' fresh texts
RETRY_S = 1.0  # a publisher's pause after a failed poll (the hub gone: it is made again)
REPLICA_LABEL = "replica"


class MetricsHub:
    """The rendezvous of a scrape (Ray-free; :class:`HubRef` runs it as a named actor).

    Args:
        forget_after_s: a source (one replica) not heard from for this long is left out.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, forget_after_s: float = FORGET_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.forget_after_s, self._clock = forget_after_s, clock
        self._generation = 0  # scrapes started so far
        self._texts: dict[str, tuple[int, bytes]] = {}  # source -> (generation rendered for, text)
        self._last_seen: dict[str, float] = {}  # source -> when it last polled or delivered
        self._changed = asyncio.Condition()

    async def wait_scrape(self, source: str, seen_generation: int, timeout_s: float = KEEPALIVE_S) -> int:
        """A publisher's poll: returns the generation to render for once a scrape newer than
        ``seen_generation`` started, or ``seen_generation`` after ``timeout_s`` (poll again)."""
        self._last_seen[source] = self._clock()
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._generation > seen_generation), timeout_s)
            except TimeoutError:
                return seen_generation
            return self._generation

    async def deliver(self, source: str, generation: int, text: bytes) -> None:
        """``source``'s metrics page rendered for scrape ``generation``."""
        self._last_seen[source] = self._clock()
        async with self._changed:
            self._texts[source] = (generation, text)
            self._changed.notify_all()

    async def scrape(self, timeout_s: float = SCRAPE_TIMEOUT_S) -> list[tuple[str, bytes]]:
        """Start a scrape and return ``(source, text)`` of every live source: fresh where it
        delivered within ``timeout_s``, else its last delivery (none yet: left out)."""
        self._drop_silent()
        live = set(self._last_seen)
        async with self._changed:
            self._generation += 1
            generation = self._generation
            self._changed.notify_all()
            try:
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: all(self._texts.get(s, (0,))[0] >= generation for s in live)), timeout_s)
            except TimeoutError:
                late = sorted(s for s in live if self._texts.get(s, (0,))[0] < generation)
                log.warning("metrics of %s not delivered within %.1f s; their last pages are served", late, timeout_s)
        return [(s, self._texts[s][1]) for s in sorted(live) if s in self._texts]

    async def forget(self, source: str) -> None:
        """``source`` is shutting down: out of the pages now, and no scrape waits for it."""
        async with self._changed:
            self._last_seen.pop(source, None)
            self._texts.pop(source, None)
            self._changed.notify_all()

    def _drop_silent(self) -> None:
        """Leave out the sources not heard from for ``forget_after_s`` (killed replicas)."""
        now = self._clock()
        for source, seen in list(self._last_seen.items()):
            if now - seen > self.forget_after_s:
                del self._last_seen[source]
                self._texts.pop(source, None)


class HubRef:
    """The application's hub actor, looked up once and again after a failure (off the event loop:
    a GCS round trip).

    Args:
        namespace, app_name: where the hub is named.
        create: make the hub if there is none (the ingress replicas). The hub dies with the replica
            that made it, so verifier replicas, which autoscaling adds and removes most, only look it
            up (a lookup before any ingress made it fails, and the publisher tries again).
    """

    def __init__(self, namespace: str, app_name: str, create: bool = True) -> None:
        self.name, self.namespace, self.create = f"specmoe-metrics-hub-{app_name}", namespace, create
        self._handle = None

    async def get(self):
        if self._handle is None:
            self._handle = await asyncio.to_thread(self._lookup)
        return self._handle

    def reset(self) -> None:
        self._handle = None

    @property
    def current(self):
        """The handle looked up last (None: none, or it failed since)."""
        return self._handle

    def _lookup(self):
        import ray

        if not self.create:
            return ray.get_actor(self.name, self.namespace)  # ValueError while there is none
        return ray.remote(MetricsHub).options(name=self.name, namespace=self.namespace, get_if_exists=True,
                                              num_cpus=0).remote()


class MetricsPublisher:
    """A replica's side: poll the hub, render on each scrape, deliver; never raises.

    Args:
        source: this replica's name in the pages (the ``replica`` label), unique per replica.
        render: this replica's Prometheus text, rendered off the event loop.
        hub: the hub (:class:`HubRef`).
    """

    def __init__(self, source: str, render: Callable[[], Awaitable[bytes]], hub: HubRef) -> None:
        self.source, self._render, self.hub = source, render, hub
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start polling on the running event loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        """Leave the pages at once (the replica is shutting down: Serve calls its ``__del__``), so
        that scrapes neither wait for it nor serve its last page for ``FORGET_AFTER_S``."""
        if self._task is not None:
            self._task.cancel()
        hub = self.hub.current
        if hub is not None:
            try:
                hub.forget.remote(self.source)  # not awaited: a shutdown must not wait on metrics
            except Exception as e:
                log.debug("metrics publisher %s: forget: %s", self.source, e)

    async def _run(self) -> None:
        seen = 0
        while True:
            try:
                hub = await self.hub.get()
                generation = await hub.wait_scrape.remote(self.source, seen)
                if generation > seen:
                    seen = generation
                    await hub.deliver.remote(self.source, generation, await self._render())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the hub died with its owner, or rendering failed: retry
                log.debug("metrics publisher %s: %s: %s", self.source, type(e).__name__, e)
                self.hub.reset()
                seen = 0  # a new hub counts its scrapes from 0
                await asyncio.sleep(RETRY_S)


async def scrape_pages(hub: HubRef, timeout_s: float = SCRAPE_TIMEOUT_S) -> list | None:
    """Every replica's page for :func:`observability.render`, each labelled with its replica;
    None if the hub cannot be reached (never raises)."""
    try:
        handle = await hub.get()
        pages = await asyncio.wait_for(handle.scrape.remote(timeout_s), timeout_s + KEEPALIVE_S)
    except Exception as e:
        log.warning("metrics hub unavailable: %s: %s", type(e).__name__, e)
        hub.reset()
        return None
    return [(text, {REPLICA_LABEL: source}) for source, text in pages]
