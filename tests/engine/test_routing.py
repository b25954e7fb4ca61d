"""Top-k routing edge cases, checked against a brute-force per-token reference."""

import torch

from engine.model.moe import combine, dispatch
from kernels.routing import topk_routing_reference


def brute_force(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Per token: repeatedly take the max probability, lowest index among equals."""
    ids, weights = [], []
    for row in torch.softmax(logits.float(), -1):
        left, chosen = row.clone(), []
        for _ in range(top_k):
            best = max(range(len(left)), key=lambda e: (left[e].item(), -e))
            chosen.append(best)
            left[best] = -1.0
        w = row[chosen]
        weights.append(w / w.sum() if renormalize else w)
        ids.append(chosen)
    return torch.tensor(ids), torch.stack(weights)


def check(logits, top_k, renormalize=True):
    r = topk_routing_reference(logits, top_k, renormalize)
    ids, weights = brute_force(logits, top_k, renormalize)
    assert torch.equal(r.topk_ids, ids)
    assert torch.allclose(r.topk_weights, weights, atol=1e-7)
    assert all(len(set(row)) == top_k for row in r.topk_ids.tolist())  # never an expert twice
    assert torch.equal(r.expert_counts, torch.bincount(ids.flatten(), minlength=logits.shape[1]))
    flat = r.topk_ids.flatten()[r.sorted_slots]
    assert torch.equal(flat, flat.sort().values)
    return r


def test_all_router_logits_negative():
    logits = -torch.rand(9, 8) * 50 - 1
    r = check(logits, 2)
    assert torch.allclose(r.topk_weights.sum(-1), torch.ones(9))


def test_exact_ties_go_to_lower_index():
    logits = torch.zeros(5, 6)
    r = check(logits, 3)
    assert r.topk_ids.tolist() == [[0, 1, 2]] * 5
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert check(logits, 2, renormalize=False).topk_ids.tolist() == [[1, 2]]


def test_one_expert_receives_every_token_and_another_none():
    logits = torch.full((11, 4), -5.0)
    logits[:, 2] = 10.0
    logits[:, 0] = 1.0
    r = check(logits, 2)
    assert r.expert_counts.tolist() == [11, 0, 11, 0]
    assert r.topk_ids[:, 0].tolist() == [2] * 11


def test_dispatch_combine_roundtrip_top1():
    hidden = torch.randn(6, 4)
    r = topk_routing_reference(torch.randn(6, 3), 1, renormalize=True)
    plan = dispatch(hidden, r)
    # With top-1 and renormalisation every weight is 1, so combine(dispatch(x)) == x.
    assert torch.equal(combine(plan.hidden * plan.weights[:, None], plan.token_index, 6), hidden)
