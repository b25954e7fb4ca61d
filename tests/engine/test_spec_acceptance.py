"""Acceptance estimates (engine.spec_acceptance) against a sequential reference of the same rule."""

import numpy as np
import pytest

from engine.spec_acceptance import AcceptanceEstimates


class _Reference:
    """The rule one verification at a time: decay the seen positions, count tries and hits."""

    def __init__(self, max_k: int, decay: float) -> None:
        self.accepted, self.tried, self.decay = np.zeros(max_k), np.zeros(max_k), decay

    def observe(self, drafted: int, accepted: int) -> None:
        seen = min(drafted, accepted + 1)
        self.accepted[:seen] *= self.decay
        self.tried[:seen] *= self.decay
        self.tried[:seen] += 1.0
        self.accepted[:accepted] += 1.0


def _shrunk(ref: _Reference, target: np.ndarray, w: float) -> np.ndarray:
    return (ref.accepted + w * target) / (ref.tried + w)


@pytest.mark.parametrize("max_k", [1, 5, 7])
def test_batched_observations_equal_one_at_a_time(max_k):
    rng = np.random.default_rng(max_k)
    prior, w, g_decay, s_decay = 0.6, 3.0, 0.97, 0.9
    est = AcceptanceEstimates(max_k, prior, w, g_decay, s_decay)
    glob_ref, seqs_ref = _Reference(max_k, g_decay), {}
    live = [f"s{i}" for i in range(23)]
    for step in range(60):
        ids = list(rng.choice(live, size=int(rng.integers(1, len(live))), replace=False))
        drafted = rng.integers(1, max_k + 1, size=len(ids))
        accepted = [int(rng.integers(0, d + 1)) for d in drafted]
        est.observe_many(ids, drafted.tolist(), accepted)
        for sid, d, a in zip(ids, drafted, accepted):
            glob_ref.observe(int(d), a)
            seqs_ref.setdefault(sid, _Reference(max_k, s_decay)).observe(int(d), a)
        if step % 7 == 3:  # a sequence finishes, a new one joins
            gone = live.pop(int(rng.integers(len(live))))
            est.release(gone)
            seqs_ref.pop(gone, None)
            live.append(f"new{step}")
    expected_glob, prev = np.empty(max_k), prior
    for j in range(max_k):
        prev = expected_glob[j] = (glob_ref.accepted[j] + w * prev) / (glob_ref.tried[j] + w)
    glob = est.server_wide()
    np.testing.assert_allclose(glob, expected_glob, rtol=1e-12)
    got = est.of_sequences(live, glob)
    for row, sid in zip(got, live):
        want = _shrunk(seqs_ref[sid], glob, w) if sid in seqs_ref else glob
        np.testing.assert_allclose(row, want, rtol=1e-12)
    assert not np.allclose(got, glob)  # observed sequences moved away from the server-wide figure


def test_a_released_sequence_starts_again_from_the_server_wide_estimate():
    est = AcceptanceEstimates(4, 0.6, 3.0, 0.99, 0.9)
    est.observe_many(["a", "b"], [4, 2], [0, 2])
    est.release("a")
    glob = est.server_wide()
    np.testing.assert_allclose(est.of_sequence("a", glob), glob, rtol=1e-12)  # its rejections are gone
    np.testing.assert_allclose(est.of_sequence("b", glob)[:2], (1 + 3.0 * glob[:2]) / (1 + 3.0), rtol=1e-12)
    assert glob[0] < 0.6  # the server-wide estimate keeps a's rejection at position 0
