"""An in-process stand-in for :class:`actors.compiled_graph.ActorGraph`, for router tests without
a Ray cluster (tests/actors/test_replica_choice.py): members are fake actor handles over
in-process ExpertWorkers (tests/helpers/fake_ray.py), and an execution runs every member's
``forward_graph`` in-process."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgpack

from actors.graph_records import GraphStats


def assert_channel_native(payload, what: str) -> None:
    """``payload`` goes through a graph channel without pickling: Ray 2.60's channel serialiser
    is msgpack with strict types, which pickles every object msgpack does not take as it is (a
    tuple among them), at ~15 us a message on each side."""
    try:
        msgpack.packb(payload, use_bin_type=True, strict_types=True)
    except TypeError as e:
        raise AssertionError(f"the graph {what} would be pickled: {e}") from e


class FakeGraph:
    """The :class:`actors.compiled_graph.ActorGraph` surface the router uses: built at once on
    request; an execution runs every member's ``forward_graph`` in-process (a delayed member's
    worker sleeps its delay, as the real actor would)."""

    building = parked = False
    park_when_built = False

    def __init__(self, members) -> None:
        self._members_fn, self.members, self.rebuilds, self.executions = members, [], 0, 0
        self.stats = GraphStats()

    def bound(self) -> list:
        return list(self.members)

    def retire(self) -> None:
        self.members = []

    @property
    def live(self) -> bool:
        return bool(self.members)

    def request_build(self) -> None:
        if not self.members:
            self.members = self._members_fn()[0]
            self.stats.builds += 1

    def rebuild(self) -> None:
        self.members, self.rebuilds = [], self.rebuilds + 1

    def fits(self, payload_bytes: int) -> bool:
        return True  # these layers are small

    inflight = 0  # executions run at wait: none is ever out between two layers

    def wake(self) -> None:
        pass  # never parked

    def build_now(self) -> None:
        self.request_build()

    def submit(self, request):
        # run at wait: the members' order is what the test checks
        return SimpleNamespace(build=self.stats.builds, request=request, late=False, timed_out=False)

    fail_next = False  # the next execution fails (a member died): the graph is dropped

    def wait(self, submitted, hedge_after_s=None):
        if not self.members or submitted.build != self.stats.builds:
            return None  # the graph it went to was dropped, as the real one
        if self.fail_next:
            self.members, self.fail_next = [], False
            self.stats.failures += 1
            return None
        start = time.monotonic()
        out = self.execute(submitted.request)
        if hedge_after_s is not None and time.monotonic() - start > hedge_after_s:
            self.members, submitted.late = [], True  # dropped at the deadline, as the real one
            self.stats.late += 1
            return None
        return out

    def execute(self, request):
        self.executions += 1
        assert_channel_native(request, "request")
        out = []
        for i, m in enumerate(self.members):
            m.handle.calls.append(("forward_graph", ()))
            m.handle.target.delay_s = m.handle.delay_s
            out.append(m.handle.target.forward_graph(request, i))
            assert_channel_native(out[-1], "answer")
        return out

    def close(self) -> None:
        pass
