"""The metrics hub (``actors/metrics_hub.py``) without Ray: every replica's page in each scrape,
fresh when it answers in time, its last one when not, none once it is gone; publishers that
survive a failing hub."""

import asyncio
import time
from types import SimpleNamespace

from actors import metrics_hub
from actors.metrics_hub import MetricsHub, MetricsPublisher, scrape_pages


class _Remote:
    """A Ray actor method as a caller sees it: ``.remote(...)`` submits the call and gives an
    awaitable, which fails once its actor (``hub``) is dead."""

    def __init__(self, hub: MetricsHub, name: str) -> None:
        self.hub, self.fn = hub, getattr(hub, name)

    async def _call(self, *args):
        if getattr(self.hub, "dead", False):
            raise ConnectionError("actor died")
        return await self.fn(*args)

    def remote(self, *args):
        return asyncio.ensure_future(self._call(*args))  # submitted at once, as Ray does


class _Ref:
    """:class:`HubRef` over an in-process hub (looked up once, again after a reset);
    ``failures`` lookups fail first."""

    def __init__(self, hub: MetricsHub, failures: int = 0) -> None:
        self.hub, self.failures, self.lookups, self.resets = hub, failures, 0, 0
        self._handle = None

    async def get(self):
        if self._handle is None:
            self.lookups += 1
            if self.failures:
                self.failures -= 1
                raise ConnectionError("hub gone")
            self._handle = SimpleNamespace(**{n: _Remote(self.hub, n)
                                              for n in ("wait_scrape", "deliver", "scrape", "forget")})
        return self._handle

    def reset(self) -> None:
        self.resets += 1
        self._handle = None

    @property
    def current(self):
        return self._handle


class _Page:
    """A replica's registry: each render is one more scrape seen."""

    def __init__(self, name: str, block: asyncio.Event | None = None) -> None:
        self.name, self.renders, self.block = name, 0, block

    async def render(self) -> bytes:
        if self.block is not None and self.renders:  # answers the first scrape only, then hangs
            await self.block.wait()
        self.renders += 1
        return f"# TYPE scrapes counter\nscrapes_total{{page=\"{self.name}\"}} {self.renders}\n".encode()


async def _polled(hub: MetricsHub, num_sources: int = 1) -> None:
    """Until ``num_sources`` publishers polled ``hub`` (2 s at most)."""
    for _ in range(200):
        if len(hub._last_seen) >= num_sources:
            return
        await asyncio.sleep(0.01)


async def _publishing(hub: MetricsHub, *pages: _Page) -> list[MetricsPublisher]:
    publishers = [MetricsPublisher(p.name, p.render, _Ref(hub)) for p in pages]
    for p in publishers:
        p.start()
    await _polled(hub, len(pages))
    return publishers


def _stop(publishers: list[MetricsPublisher]) -> None:
    for p in publishers:
        p._task.cancel()


def test_a_scrape_gets_every_replicas_fresh_page_and_nothing_renders_unscraped():
    async def run():
        hub, a, b = MetricsHub(), _Page("verifier-a"), _Page("verifier-b")
        publishers = await _publishing(hub, a, b)
        await asyncio.sleep(0.05)
        assert a.renders == b.renders == 0  # an unscraped server renders nothing
        first = await hub.scrape(timeout_s=5.0)
        second = await hub.scrape(timeout_s=5.0)
        _stop(publishers)
        return first, second

    first, second = asyncio.run(run())
    assert [s for s, _ in first] == ["verifier-a", "verifier-b"]
    assert [t.decode().split()[-1] for _, t in first] == ["1", "1"]
    assert [t.decode().split()[-1] for _, t in second] == ["2", "2"]  # rendered again per scrape


def test_a_replica_that_does_not_answer_in_time_is_served_from_its_last_page():
    async def run():
        hub, slow = MetricsHub(), _Page("verifier-slow", block=asyncio.Event())
        publishers = await _publishing(hub, _Page("ingress-x"), slow)
        await hub.scrape(timeout_s=5.0)
        start = time.monotonic()
        pages = dict(await hub.scrape(timeout_s=0.2))
        waited_s = time.monotonic() - start
        slow.block.set()
        _stop(publishers)
        return pages, waited_s

    pages, waited_s = asyncio.run(run())
    assert 0.2 <= waited_s < 2.0
    assert pages["ingress-x"].decode().split()[-1] == "2"
    assert pages["verifier-slow"].decode().split()[-1] == "1"  # its page of the first scrape


def test_a_replica_not_heard_from_is_forgotten():
    now = [100.0]

    async def run():
        hub = MetricsHub(forget_after_s=30.0, clock=lambda: now[0])
        assert await hub.wait_scrape("verifier-dead", 0, 0.01) == 0  # polls once (a keepalive), then dies
        await hub.deliver("verifier-dead", 0, b"# TYPE x counter\nx_total 1\n")
        now[0] += 29.0
        kept = await hub.scrape(timeout_s=0.05)
        now[0] += 2.0
        return kept, await hub.scrape(timeout_s=0.05)

    kept, forgotten = asyncio.run(run())
    assert [s for s, _ in kept] == ["verifier-dead"]
    assert forgotten == []


def test_a_replica_shutting_down_leaves_the_pages_at_once():
    """Serve calls a replica's ``__del__`` on a downscale: its page goes, and no scrape waits the
    full timeout for it until it would be forgotten."""
    async def run():
        hub, leaving = MetricsHub(), _Page("verifier-b")
        publishers = await _publishing(hub, _Page("verifier-a"), leaving)
        await hub.scrape(timeout_s=5.0)
        publishers[1].stop()
        await asyncio.sleep(0.05)  # the forget call is not awaited by stop()
        start = time.monotonic()
        pages = await hub.scrape(timeout_s=5.0)
        waited_s = time.monotonic() - start
        _stop(publishers[:1])
        return pages, waited_s

    pages, waited_s = asyncio.run(run())
    assert [s for s, _ in pages] == ["verifier-a"] and waited_s < 1.0


def test_a_publisher_looks_the_hub_up_again_after_a_failure(monkeypatch):
    monkeypatch.setattr(metrics_hub, "RETRY_S", 0.01)

    async def run():
        hub, page = MetricsHub(), _Page("verifier-a")
        ref = _Ref(hub, failures=2)
        publisher = MetricsPublisher(page.name, page.render, ref)
        publisher.start()
        await _polled(hub)
        pages = await hub.scrape(timeout_s=5.0)
        publisher._task.cancel()
        return ref, pages

    ref, pages = asyncio.run(run())
    assert ref.lookups == 3 and ref.resets == 2
    assert [s for s, _ in pages] == ["verifier-a"]


def test_a_hub_that_died_is_replaced_and_its_successor_gets_every_page(monkeypatch):
    """The hub dies with the replica that made it; the others make a new one, whose scrapes count
    from 0 again, and their pages reach it."""
    monkeypatch.setattr(metrics_hub, "RETRY_S", 0.01)

    async def run():
        first, page = MetricsHub(), _Page("verifier-a")
        ref = _Ref(first)
        publisher = MetricsPublisher(page.name, page.render, ref)
        publisher.start()
        await _polled(first)
        for _ in range(3):
            await first.scrape(timeout_s=5.0)
        first.dead, ref.hub = True, MetricsHub()
        async with first._changed:  # wake the poll on the dead hub: its next call fails
            first._generation += 1
            first._changed.notify_all()
        await _polled(ref.hub)
        pages = await ref.hub.scrape(timeout_s=5.0)
        publisher._task.cancel()
        return pages

    pages = asyncio.run(run())
    assert [s for s, _ in pages] == ["verifier-a"]
    assert int(pages[0][1].decode().split()[-1]) > 3  # rendered again, for the new hub's first scrape


def test_scraped_pages_are_labelled_by_replica_and_an_unreachable_hub_gives_none():
    async def run():
        hub = MetricsHub()
        publishers = await _publishing(hub, _Page("verifier-a"))
        pages = await scrape_pages(_Ref(hub), timeout_s=5.0)
        _stop(publishers)
        return pages, await scrape_pages(_Ref(hub, failures=1), timeout_s=0.1)

    pages, unreachable = asyncio.run(run())
    assert [labels for _, labels in pages] == [{"replica": "verifier-a"}]
    assert unreachable is None


def test_a_scrape_with_no_live_replica_returns_at_once():
    async def run():
        hub = MetricsHub()
        start = time.monotonic()
        pages = await hub.scrape(timeout_s=5.0)
        return pages, time.monotonic() - start

    pages, waited_s = asyncio.run(run())
    assert pages == [] and waited_s < 1.0
