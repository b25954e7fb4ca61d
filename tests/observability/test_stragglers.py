"""StragglerDetector's rule (strict multiple x median AND floor) and the router's latency EWMA."""

import math

import pytest

from observability import StragglerDetector


@pytest.mark.parametrize(("latencies", "expected"), [
    ({0: 1.0, 1: 2.0, 2: 30.0}, {2}),            # median 2 -> threshold max(6, 5) = 6
    ({0: 1.0, 1: 1.0, 2: 4.0}, set()),            # 4 > 3 x median 1, but not above the 5 ms floor
    ({0: 1.0, 1: 1.0, 2: 5.0}, set()),            # exactly at the floor: strict, not flagged
    ({0: 2.0, 1: 2.0, 2: 6.0, 3: 2.0}, set()),    # median 2 (ties) -> threshold 6; 6 is not > 6
    ({0: 2.0, 1: 2.0, 2: 6.5, 3: 2.0}, {2}),
    ({0: 10.0, 1: 10.0, 2: 30.0}, set()),         # exactly 3 x median: not flagged
    ({0: 10.0, 1: 10.0, 2: 30.001}, {2}),
    ({0: 10.0, 1: 10.0, 2: 50.0, 3: 50.0}, set()),  # even count: median (10+50)/2 = 30, 50 < 90
    ({0: 1.0, 1: 1.0, 2: 1.0, 3: 40.0, 4: 40.0}, {3, 4}),  # tied stragglers are both flagged
    ({0: 7.0, 1: 7.0, 2: 7.0}, set()),            # all equal
    ({"a": 100.0}, set()),                         # a single call: nothing to compare against
    ({}, set()),
])
def test_median_rule(latencies, expected):
    assert StragglerDetector(multiple=3.0, floor_ms=5.0).flag(latencies) == expected


def test_two_calls_median_is_their_mean():
    # median of (a, b) is (a+b)/2, so b > m (a+b)/2 is impossible for m >= 2: never flagged.
    assert StragglerDetector(3.0, 0.0).flag({0: 0.0, 1: 1000.0}) == set()
    assert StragglerDetector(2.0, 0.0).flag({0: 0.0, 1: 1000.0}) == set()  # 1000 > 1000 is false
    # with m < 2 the slower call can be flagged: median 55, threshold 1.5 x 55 = 82.5 < 100
    assert StragglerDetector(1.5, 5.0).flag({0: 10.0, 1: 100.0}) == {1}
    assert StragglerDetector(1.5, 5.0).flag({0: 10.0, 1: 20.0}) == set()  # 20 < 22.5


def test_invalid_latencies_ignored_and_counts_kept_per_layer_and_expert():
    det = StragglerDetector()
    assert det.flag({0: 1.0, 1: math.nan, 2: -3.0, 3: 1.0, 4: 20.0, 5: "x"}, layer=7) == {4}
    assert det.flag({0: 1.0, 1: 1.0, 4: 20.0}, layer=7) == {4}
    assert det.flag({0: 1.0, 1: 1.0, 4: 20.0}, layer=2) == {4}
    assert det.flag({0: 1.0, 1: 1.0, 2: 1.0}, layer=2) == set()
    assert det.counts() == {(7, 4): 2, (2, 4): 1}
    assert det.num_dispatches == 4
    assert det.flag(None) == set()  # bad input: empty, no exception
    det.reset()
    assert det.counts() == {} and det.num_dispatches == 0


def test_constructor_validates():
    with pytest.raises(ValueError):
        StragglerDetector(multiple=0)


def test_replica_latency_ewma_steers_the_router_to_the_faster_replica():
    from actors.expert_config import ExpertPoolConfig
    from actors.expert_pool import Replica
    from actors.replica_choice import choose

    slow, fast = Replica(0, 0, 0, "slow", None), Replica(0, 1, 0, "fast", None)
    for r, samples in ((slow, (10.0, 20.0, 5.0)), (fast, (12.0,))):
        for ms in samples:
            r.stats.observe_latency(ms, alpha=0.5)
    assert (slow.ewma_latency_ms, fast.ewma_latency_ms) == (10.0, 12.0)  # 10 -> 15 -> 10; first sample sets it
    slow.observe_latency(30.0)  # default alpha 0.2: 0.2 * 30 + 0.8 * 10
    assert slow.ewma_latency_ms == 14.0
    config = ExpertPoolConfig(split_min_rows=0)
    assert choose([slow, fast], 8, config, {}) == [fast]  # nothing in flight: the lower latency wins
    fast.begin(8, 0.0)  # one call in flight on the fast one: (1 + 1) x 12 ms > 14 ms
    assert choose([slow, fast], 8, config, {}) == [slow]
