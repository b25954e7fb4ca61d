"""Triton rejection sampling (interpreter) against the torch reference: identical tokens and counts
for the same uniforms, on random and adversarial inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import rejection
from kernels.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample_reference
from kernels.rejection_triton import rejection_sample_triton
from tests.kernels.inputs import make_batch


def assert_same(args, block_v=None):
    out, num = rejection_sample_triton(*args, block_v=block_v)
    want_out, want_num = rejection_sample_reference(*args)
    assert torch.equal(num, want_num), (num, want_num)
    assert torch.equal(out, want_out), (out, want_out)
    # Placeholder padding after the num_accepted + 1 emitted tokens, and only there.
    emitted = torch.arange(out.shape[1])[None, :] <= num[:, None]
    assert bool((out[~emitted] == PLACEHOLDER_TOKEN_ID).all())
    return out, num


@pytest.mark.parametrize(
    "batch,k,vocab,block_v",
    [(9, 4, 50, None), (9, 4, 50, 16), (6, 1, 33, 8), (11, 5, 300, 64)],
)
def test_mixed_greedy_and_sampling_rows(batch, k, vocab, block_v):
    for seed in range(3):
        args = make_batch(batch, k, vocab, seed=seed, peaked=seed == 1)
        out, num = assert_same(args, block_v)
    assert num.max() > 0  # some drafts were accepted


def test_all_greedy_without_draft_probs():
    args = make_batch(10, 3, 40, seed=4, greedy_frac=1.0)
    args[2] = None
    assert_same(args)
    assert_same(args, block_v=8)


def test_all_sampling_and_no_drafts():
    assert_same(make_batch(10, 4, 64, seed=5, greedy_frac=0.0), block_v=16)
    assert_same(make_batch(4, 0, 33, seed=6), block_v=8)  # K = 0: only the bonus token


def test_adversarial_distributions():
    for seed in range(4):
        ids, n, q, p, au, su, greedy = make_batch(8, 3, 24, seed=10 + seed, peaked=True)
        # q == p: the residual is all zero (p is used instead) and nothing is rejected except by
        # rounding; one-hot q (n-gram drafter) with a sparse p: q(x) = 1 > p(x), zero-prob tokens.
        same = [ids, n, p[:, :3].clone(), p, au, su, greedy]
        assert_same(same, block_v=8)
        sparse_p = p * (torch.rand(p.shape, generator=torch.Generator().manual_seed(seed)) < 0.5)
        one_hot_q = torch.nn.functional.one_hot(ids.clamp(min=0), 24).float()
        out, _ = assert_same([ids, n, one_hot_q, sparse_p, au, su, greedy], block_v=8)
        # Uniforms at the top of [0, 1) and tied target maxima.
        assert_same([ids, n, q, torch.round(p * 4) / 4, au, torch.full_like(su, 0.99999994), greedy])


def test_q_zero_at_draft_token_accepts():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])  # the draft token 1 has q = 0: always accepted
    args = [torch.tensor([[1]]), torch.tensor([1]), q, p, torch.tensor([[0.99]]),
            torch.tensor([[0.5, 0.1]]), torch.tensor([False])]  # fmt: skip
    out, num = assert_same(args)
    assert num.tolist() == [1] and out.tolist() == [[1, 0]]  # bonus: cdf 0.2 > 0.1 * 1 at token 0


def test_dispatch_takes_triton_branch(triton_dispatch, monkeypatch):
    import kernels.rejection_triton as rt

    calls = []
    original = rt.rejection_sample_triton
    monkeypatch.setattr(rt, "rejection_sample_triton", lambda *a: calls.append(1) or original(*a))
    args = make_batch(6, 2, 20, seed=7)
    got = rejection.rejection_sample(*args)
    want = rejection_sample_reference(*args)
    assert calls and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
