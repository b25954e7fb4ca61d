"""The EAGLE-3 head behind the draft actor (in-process DraftServer behind a fake handle, no Ray):
features travel as deltas, and an actor that lost them answers ``miss`` and gets the whole history."""

from __future__ import annotations

import pytest
import torch

from actors import draft_server
from actors.draft_server import DraftActorSpec, DraftServer, RemoteDrafter
from engine.drafters.base import DraftRequest
from engine.drafters.eagle import EagleDrafter
from engine.loader import load_model
from engine.model.eagle3 import Eagle3Head
from tests.helpers.fake_ray import FakeActor, FakeRay
from tests.helpers.tiny_checkpoints import make_eagle3_head


class RecordingDrafter(RemoteDrafter):
    """Each actor is an in-process eagle3 DraftServer; every call's wire is recorded."""

    def _make(self):
        s = self.spec
        return FakeActor(DraftServer(s.draft_model, max_seqs=4, method="eagle3", target_model=s.target_model), "ok")

    def _call(self, request):
        self.calls = getattr(self, "calls", []) + [request[0]]
        return super()._call(request)


@pytest.fixture
def setup(monkeypatch, tiny_checkpoints, tmp_path):
    monkeypatch.setattr(draft_server, "ray", FakeRay())
    monkeypatch.setattr(draft_server, "kill_actor", lambda handle: setattr(handle, "behaviour", "killed"))
    target_dir = tiny_checkpoints["mixtral"][0]
    make_eagle3_head(tmp_path / "head", seed=4)
    spec = DraftActorSpec(str(tmp_path / "head"), "float32", "cpu", 4, None, None, "t-eagle", "specmoe",
                          method="eagle3", target_model=str(target_dir), feature_layers=(0, 1, 2))
    target = load_model(target_dir)
    local = EagleDrafter(Eagle3Head(tmp_path / "head", target.config, target.model.embed), 4)
    return RecordingDrafter(spec, timeout_s=5.0), local


def _step(n: int, feats: torch.Tensor) -> list[DraftRequest]:
    tokens = [(7 * i) % 120 + 1 for i in range(n)]
    return [DraftRequest("s", tokens, 3, features=feats[: n - 1]),
            DraftRequest("t", tokens[:5], 2, temperature=0.8, generator=torch.Generator().manual_seed(1),
                         features=feats[:4])]


def test_features_travel_as_deltas_and_a_new_actor_gets_the_whole_history(setup):
    remote, local = setup
    feats = torch.randn(20, 96, generator=torch.Generator().manual_seed(0))
    for n, shipped_rows in ((10, [9, 4]), (13, [3, 1])):
        got, want = remote.propose(_step(n, feats)), local.propose(_step(n, feats))
        assert [p.token_ids for p in got] == [p.token_ids for p in want]
        torch.testing.assert_close(got[1].probs, want[1].probs, rtol=0, atol=0)
        assert [w["features_shape"][0] for w in remote.calls[-1]] == shipped_rows
    assert remote.num_failures == 0
    remote._recreate()  # a new actor: its cache is empty, so the delta is refused and resent whole
    calls_before = len(remote.calls)
    got, want = remote.propose(_step(15, feats)), local.propose(_step(15, feats))
    assert [p.token_ids for p in got] == [p.token_ids for p in want]
    assert len(remote.calls) == calls_before + 2
    assert [w["features_start"] for w in remote.calls[-2]] == [12, 3]
    assert [(w["seq_id"], w["features_start"], w["features_shape"][0]) for w in remote.calls[-1]] == \
        [("s", 0, 14), ("t", 0, 4)]
