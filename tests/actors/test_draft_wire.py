"""The draft actor's wire format: a step's request and a greedy answer cross a compiled-graph
channel without pickling (Ray's channel serialiser pickles tuples and other non-msgpack types),
and a request round-trips."""

from __future__ import annotations

import torch

from actors.draft_server import _proposal_to_wire, requests_from_wire, requests_to_wire
from engine.drafters.base import DraftProposal, DraftRequest
from tests.helpers.fake_graph import assert_channel_native


def test_a_step_request_and_a_greedy_answer_cross_a_channel_unpickled_and_round_trip():
    features = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    requests = [DraftRequest("plain", [1, 2, 3], 4),
                DraftRequest("eagle", [4, 5, 6, 7, 8, 9], 2, features=features, features_start=1)]

    wire = requests_to_wire(requests, {"eagle": 2})  # two feature rows already shipped
    assert_channel_native([wire, ["finished-seq"], None], "draft request")
    answer = [_proposal_to_wire(DraftProposal((11, 12)), requests[0])]
    assert_channel_native(answer, "draft answer")

    back = requests_from_wire(wire)
    assert [(r.seq_id, r.token_ids, r.k) for r in back] == [("plain", [1, 2, 3], 4), ("eagle", [4, 5, 6, 7, 8, 9], 2)]
    assert back[0].features is None
    assert back[1].features_start == 2 and torch.equal(back[1].features, features[2:])
    assert answer[0]["token_ids"] == [11, 12] and answer[0]["probs"] is None
