"""N-gram prompt-lookup drafter and the base drafters, on hand-worked token lists."""

from __future__ import annotations

import pytest
import torch

from engine.drafters.base import Drafter, DraftProposal, DraftRequest, NoneDrafter
from engine.drafters.ngram import NgramDrafter


@pytest.mark.parametrize(
    "tokens, k, expected",
    [
        ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # suffix [1, 2] seen at 0: propose what followed
        ([1, 2, 3, 4, 1, 2], 10, [3, 4, 1, 2]),  # fewer than k follow the match
        ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 4, [9, 2, 3, 8]),  # longest n wins: [1, 2, 3] over [2, 3]
        ([5, 3, 7, 6, 3, 8, 4, 3], 2, [8, 4]),  # only n = 1 matches; the most recent [3] (at 4)
        ([1, 1, 1, 1], 5, [1]),  # most recent earlier match of [1, 1, 1] ends at 2
        ([5, 6, 7], 2, []),  # no earlier occurrence
        ([7], 3, []),
        ([], 3, []),
        ([1, 2, 1, 2], 0, []),
    ],
)
def test_ngram_lookup(tokens, k, expected):
    assert NgramDrafter().lookup(tokens, k) == expected


def test_min_and_max_n_limit_the_match():
    tokens = [1, 2, 3, 4, 9, 9, 4, 7, 2, 3, 4]
    # max_n = 4 finds [2, 3, 4] at 1..3 (followed by 9); max_n = 1 only matches [4], most recently at 6.
    assert NgramDrafter(1, 4).lookup(tokens, 2) == [9, 9]
    assert NgramDrafter(1, 1).lookup(tokens, 2) == [7, 2]
    # min_n = 2 ignores unigram matches.
    assert NgramDrafter(2, 4).lookup([5, 3, 7, 6, 3], 2) == []
    assert NgramDrafter(1, 4).lookup([5, 3, 7, 6, 3], 2) == [7, 6]
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)
    with pytest.raises(ValueError):
        NgramDrafter(0, 2)


def test_most_recent_occurrence_among_equal_length_matches():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert NgramDrafter().lookup(tokens, 1) == [30]


def test_ngram_as_a_drafter_batch():
    drafter = NgramDrafter()
    assert isinstance(drafter, Drafter)
    reqs = [DraftRequest("a", [1, 2, 3, 1, 2], 2), DraftRequest("b", [4, 5, 6], 3, 0.7, 5, 0.9, None)]
    proposals = drafter.propose(reqs)
    assert [p.token_ids for p in proposals] == [[3, 1], []]
    assert all(p.probs is None for p in proposals)  # deterministic: one-hot q
    drafter.release("a")


def test_none_drafter():
    drafter = NoneDrafter()
    assert isinstance(drafter, Drafter)
    assert drafter.propose([DraftRequest("a", [1, 2], 4, generator=torch.Generator())]) == [DraftProposal([])]
    drafter.release("unknown")
