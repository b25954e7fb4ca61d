"""Draft allocations the controller scores (engine.spec_candidates), against their definition."""

import numpy as np
import pytest

from engine.spec_candidates import draft_candidates


@pytest.mark.parametrize("num_seqs,max_k,pipelined", [(1, 1, False), (3, 5, False), (7, 4, True)])
def test_every_candidate_is_one_length_for_its_first_sequences_and_its_totals_add_up(num_seqs, max_k, pipelined):
    rng = np.random.default_rng(num_seqs * 10 + max_k)
    caps = rng.integers(0, max_k + 1, size=num_seqs)
    gains = np.cumprod(rng.uniform(0.2, 1.0, size=(num_seqs, max_k)), axis=1)
    gains[np.arange(max_k) >= caps[:, None]] = 0.0
    ready = rng.uniform(0, 1, size=gains.shape) * (rng.random(gains.shape) < 0.5) if pipelined else None
    charged = rng.integers(0, 50, size=num_seqs).astype(float)
    cand = draft_candidates(gains, ready, charged)
    assert cand.lengths.shape == (1 + max_k * num_seqs, num_seqs)
    assert not cand.lengths[0].any() and cand.gain[0] == cand.drafted[0] == cand.passes[0] == 0
    work = (gains > 0) * (1.0 - (ready if pipelined else 0.0))
    for c, lengths in enumerate(cand.lengths):
        drafting = lengths > 0
        # One length for the batch: each drafting sequence drafts it, or its own cap if lower.
        assert all(lengths[r] == min(caps[r], lengths.max()) for r in np.flatnonzero(drafting))
        assert (lengths <= caps).all()
        assert cand.gain[c] == pytest.approx(sum(gains[r, :n].sum() for r, n in enumerate(lengths)))
        assert cand.drafted[c] == pytest.approx(sum(work[r, :n].sum() for r, n in enumerate(lengths)))
        assert cand.tokens[c] == lengths.sum()
        assert cand.caught[c] == pytest.approx(charged[drafting].sum())
        assert cand.passes[c] == pytest.approx(max([(np.arange(1, n + 1) * work[r, :n]).max(initial=0)
                                                    for r, n in enumerate(lengths)], default=0))
    # For each length, sequences join in order of gain per unit of draft work: every prefix is there.
    for k in range(1, max_k + 1):
        rows = cand.lengths[1 + (k - 1) * num_seqs: 1 + k * num_seqs]
        assert (np.diff((rows > 0).sum(1)) >= 0).all()
        assert (rows.max(1) <= k).all()


def test_a_sequence_whose_drafts_are_rarely_accepted_is_left_out_not_shortened():
    gains = np.cumprod(np.array([[0.95] * 4, [0.1] * 4, [0.9] * 4]), axis=1)
    cand = draft_candidates(gains, None, np.zeros(3))
    two_best = cand.lengths[1 + 3 * 3 + 1]  # length 4, the first two sequences
    assert two_best.tolist() == [4, 0, 4]
