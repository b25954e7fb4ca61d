"""Speculative verification reference: exact hand-computed cases and distribution preservation.

The statistical tests run the whole speculative step many times as one batch (draft sampled from
q by inverse CDF, then verification) and chi-square-test the emitted tokens against the target p
at significance 1e-3. Everything is seeded, so each test is deterministic; the power tests show the
same statistic rejects deliberately broken acceptance/recovery rules.
"""

from __future__ import annotations

import pytest
import torch

from engine.sampling import compute_probs
from kernels.rejection import (
    PLACEHOLDER_TOKEN_ID as PAD,
)
from kernels.rejection import (
    inverse_cdf_sample,
    rejection_sample,
    rejection_sample_reference,
)

ALPHA = 1e-3
TRIALS = 40_000


# ----------------------------------------------------------------------------- helpers

def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """Upper-alpha chi-square quantile by bisection on the CDF P(df/2, x/2) (no scipy needed)."""
    a = torch.tensor(df / 2, dtype=torch.float64)
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if torch.special.gammainc(a, torch.tensor(mid / 2, dtype=torch.float64)).item() < 1 - alpha:
            lo = mid
        else:
            hi = mid
    return hi


def chi2_statistic(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """Pearson statistic of ``tokens`` against ``p`` and its critical value.

    Bins where p is 0 must be empty (asserted); they carry no degree of freedom.
    """
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens emitted outside p's support: {counts.tolist()}"
    expected = p.double()[support] / p.double()[support].sum() * tokens.numel()
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, chi2_critical(int(support.sum()) - 1)


def run_spec_step(target: torch.Tensor, draft: torch.Tensor, trials: int, seed: int, verify=None):
    """One speculative step with K = draft.shape[0] tokens, repeated ``trials`` times as a batch.

    target: (K + 1, V) p rows; draft: (K, V) q rows (context independent, so a row's draft tokens
    are independent draws). Returns (output_token_ids, num_accepted).
    """
    verify = verify or rejection_sample_reference
    k, vocab = draft.shape
    gen = torch.Generator().manual_seed(seed)
    u_draft = torch.rand(trials, k, generator=gen)
    drafts = torch.stack(
        [inverse_cdf_sample(draft[j].expand(trials, vocab), u_draft[:, j]) for j in range(k)], dim=1)
    return verify(
        drafts,
        torch.full((trials,), k, dtype=torch.int64),
        draft.expand(trials, k, vocab),
        target.expand(trials, k + 1, vocab),
        torch.rand(trials, k, generator=gen),
        torch.rand(trials, k + 1, generator=gen),
        torch.zeros(trials, dtype=torch.bool),
    )


def _probs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


P_MAIN = [0.3, 0.25, 0.2, 0.15, 0.1, 0.0]
P_GEN = [0.05, 0.4, 0.1, 0.25, 0.2, 0.0]
Q_GEN = [0.3, 0.1, 0.2, 0.1, 0.1, 0.2]
P_BONUS = [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]


def _truncated_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Target p and draft q from compute_probs with different temperature/top-k/top-p."""
    target_logits = torch.tensor([[2.0, 1.5, 0.3, 1.1, -0.5, 0.9]])
    draft_logits = torch.tensor([[1.2, 1.9, 0.8, 0.2, 0.1, 1.0]])
    p = compute_probs(target_logits, torch.tensor([0.7]), torch.tensor([4]), torch.tensor([0.8]))[0]
    q = compute_probs(draft_logits, torch.tensor([1.3]), torch.tensor([0]), torch.tensor([0.9]))[0]
    return p, q


def _case(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "q_equals_p":
        return _probs(P_MAIN)[0], _probs(P_MAIN)[0]
    if name == "disjoint":
        return _probs([0.5, 0.3, 0.2, 0, 0, 0])[0], _probs([0, 0, 0, 0.2, 0.3, 0.5])[0]
    if name == "one_hot_q":
        return _probs(P_MAIN)[0], _probs([0, 0, 1, 0, 0, 0])[0]
    if name == "one_hot_q_outside_p":
        return _probs(P_MAIN)[0], _probs([0, 0, 0, 0, 0, 1])[0]
    if name == "general":
        return _probs(P_GEN)[0], _probs(Q_GEN)[0]
    if name == "compute_probs_truncated":
        return _truncated_pair()
    raise KeyError(name)


CASES = ["q_equals_p", "disjoint", "one_hot_q", "one_hot_q_outside_p", "general", "compute_probs_truncated"]


# ----------------------------------------------------------------------------- inverse CDF

def test_inverse_cdf_sample_thresholds_and_zero_probability_tokens():
    probs = _probs([0.0, 0.5, 0.0, 0.5, 0.0])
    pick = lambda u: inverse_cdf_sample(probs, torch.tensor([u])).item()  # noqa: E731
    assert pick(0.0) == 1  # a leading zero-probability token is never returned
    assert pick(0.49) == 1
    assert pick(0.5) == 3  # cdf must be strictly greater than the threshold
    assert pick(0.999) == 3
    assert pick(1.0) == 3  # threshold at the total: falls back to the last nonzero token


def test_inverse_cdf_sample_unnormalised_rows_and_batch():
    probs = _probs([2.0, 6.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0])
    ids = inverse_cdf_sample(probs, torch.tensor([0.25, 0.5, 0.9]))
    # Row 0: threshold 2.5 on cdf [2, 8, 8, 10] -> 1. Row 1 has no mass -> PAD. Row 2 -> 2.
    assert ids.tolist() == [1, PAD, 2]
    assert ids.dtype == torch.int64


# ----------------------------------------------------------------------------- greedy exact

def _greedy_target() -> torch.Tensor:
    """(1, 4, 5) target rows with argmaxes [2, 0, 4, 1]; row 1 ties tokens 0 and 3."""
    return _probs(
        [0.1, 0.2, 0.4, 0.2, 0.1],
        [0.35, 0.1, 0.1, 0.35, 0.1],
        [0.1, 0.1, 0.1, 0.2, 0.5],
        [0.1, 0.6, 0.1, 0.1, 0.1],
    )[None]


@pytest.mark.parametrize(
    "drafts, n, expected_out, expected_acc",
    [
        ([2, 0, 4], 3, [2, 0, 4, 1], 3),  # all accepted -> bonus argmax of the last row
        ([3, 0, 4], 3, [2, PAD, PAD, PAD], 0),  # first rejected -> recovered argmax
        ([2, 0, 1], 3, [2, 0, 4, PAD], 2),  # last rejected
        ([2, 3, 4], 3, [2, 0, PAD, PAD], 1),  # middle rejected; tie 0/3 resolves to 0
        ([2, 0, 4], 2, [2, 0, 4, PAD], 2),  # n = 2: the third draft is ignored, bonus t_2
        ([PAD, PAD, PAD], 0, [2, PAD, PAD, PAD], 0),  # n = 0 -> one target token
    ],
)
def test_greedy_verification(drafts, n, expected_out, expected_acc):
    out, acc = rejection_sample_reference(
        torch.tensor([drafts]), torch.tensor([n]), None, _greedy_target(),
        torch.rand(1, 3), torch.rand(1, 4), torch.tensor([True]))
    assert out.tolist() == [expected_out]
    assert acc.tolist() == [expected_acc]


def test_greedy_ignores_draft_probs_and_uniforms():
    garbage_q = torch.full((1, 3, 5), 7.0)
    out, acc = rejection_sample_reference(
        torch.tensor([[2, 0, 4]]), torch.tensor([3]), garbage_q, _greedy_target(),
        torch.full((1, 3), 0.999), torch.zeros(1, 4), torch.tensor([True]))
    assert out.tolist() == [[2, 0, 4, 1]] and acc.tolist() == [3]


def test_draft_probs_none_requires_all_greedy():
    with pytest.raises(ValueError, match="greedy"):
        rejection_sample_reference(
            torch.tensor([[2, 0, 4]]), torch.tensor([3]), None, _greedy_target(),
            torch.rand(1, 3), torch.rand(1, 4), torch.tensor([False]))


def test_shape_errors():
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample_reference(torch.zeros(1, 3, dtype=torch.int64), torch.tensor([3]), None,
                                   torch.rand(1, 3, 5), torch.rand(1, 3), torch.rand(1, 4),
                                   torch.tensor([True]))


# ----------------------------------------------------------------------------- seeded sampling exact

def test_sampling_verification_hand_computed():
    """Five rows, K = 3, V = 4; every accept/reject and recovered token worked out by hand."""
    p = _probs([0.2, 0.3, 0.4, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4])
    q = _probs([0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0])
    q_zero_at_3 = _probs([0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0])
    drafts = torch.tensor([[1, 0, 2], [2, 3, 0], [1, 1, PAD], [PAD, PAD, PAD], [3, PAD, PAD]])
    n = torch.tensor([3, 3, 2, 0, 1])
    draft_probs = torch.stack([q, q, q, q, q_zero_at_3])
    accept_u = torch.tensor([
        [0.4, 0.7, 0.0],  # 0.3/0.6 = 0.5 > 0.4 accept; 0.1/0.25 = 0.4 <= 0.7 reject
        [0.99, 0.99, 0.49],  # ratios 2, 1.6, 0.5 -> all accepted
        [0.5, 0.0, 0.0],  # ratio 0.5, u = 0.5: strict inequality rejects
        [0.0, 0.0, 0.0],
        [0.99, 0.0, 0.0],  # q(3) = 0 accepts whatever u is
    ])
    sample_u = torch.tensor([
        [0.0, 0.3, 0.0, 0.0],  # residual [0, 0, .05, .15], threshold .06 -> token 3
        [0.0, 0.0, 0.0, 0.5],  # bonus from p_3: cdf [.1, .3, .6, 1], threshold .5 -> token 2
        [0.5, 0.0, 0.0, 0.0],  # residual [.1, 0, .2, 0], threshold .15 -> token 2
        [0.05, 0.0, 0.0, 0.0],  # n = 0: bonus from p_0, threshold .05 -> token 0
        [0.0, 0.95, 0.0, 0.0],  # bonus from p_1: threshold .95 -> token 3
    ])
    out, acc = rejection_sample_reference(
        drafts, n, draft_probs, p.expand(5, 4, 4), accept_u, sample_u, torch.zeros(5, dtype=torch.bool))
    assert out.tolist() == [[1, 3, PAD, PAD], [2, 3, 0, 2], [2, PAD, PAD, PAD], [0, PAD, PAD, PAD],
                            [3, 3, PAD, PAD]]
    assert acc.tolist() == [1, 3, 0, 0, 1]


def test_mixed_batch_rows_are_independent_of_batch_composition():
    gen = torch.Generator().manual_seed(0)
    b, k, v = 6, 3, 7
    target = torch.softmax(torch.randn(b, k + 1, v, generator=gen), dim=-1)
    draft = torch.softmax(torch.randn(b, k, v, generator=gen), dim=-1)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    n = torch.tensor([3, 0, 2, 3, 1, 3])
    au, su = torch.rand(b, k, generator=gen), torch.rand(b, k + 1, generator=gen)
    greedy = torch.tensor([False, True, False, True, False, False])
    out, acc = rejection_sample(drafts, n, draft, target, au, su, greedy)
    for i in range(b):
        s = slice(i, i + 1)
        o, a = rejection_sample_reference(drafts[s], n[s], draft[s], target[s], au[s], su[s], greedy[s])
        assert torch.equal(o[0], out[i]) and a.item() == acc[i].item()
    # Emitted tokens are a prefix; the rest is padding.
    emitted = (out != PAD).sum(dim=1)
    assert torch.equal(emitted, acc + 1)


# ----------------------------------------------------------------------------- distribution

@pytest.mark.parametrize("case", CASES)
def test_first_token_is_distributed_as_target(case):
    p, q = _case(case)
    out, acc = run_spec_step(torch.stack([p, _probs(P_BONUS)[0]]), q[None], TRIALS, seed=1234)
    stat, crit = chi2_statistic(out[:, 0], p)
    assert stat < crit, f"{case}: chi2 {stat:.2f} >= critical {crit:.2f}"
    # The acceptance rate is sum_x min(p(x), q(x)) (Leviathan et al., Definition 3.1).
    rate = torch.minimum(p, q).sum().item()
    sigma = (rate * (1 - rate) / TRIALS) ** 0.5
    assert abs(acc.double().mean().item() - rate) <= 4 * sigma + 1e-9


def test_two_step_second_and_bonus_tokens_are_distributed_as_target():
    p0, q0 = _probs(P_GEN)[0], _probs(Q_GEN)[0]
    p1, q1 = _truncated_pair()
    p2 = _probs(P_BONUS)[0]
    out, acc = run_spec_step(torch.stack([p0, p1, p2]), torch.stack([q0, q1]), TRIALS, seed=99)
    for tokens, dist in ((out[:, 0], p0), (out[acc >= 1, 1], p1), (out[acc == 2, 2], p2)):
        assert tokens.numel() > 2000
        stat, crit = chi2_statistic(tokens, dist)
        assert stat < crit, f"chi2 {stat:.2f} >= critical {crit:.2f}"


# ----------------------------------------------------------------------------- power

def _broken_verify(rule: str):
    """A one-token verifier with a deliberate mistake; same signature as the reference."""

    def verify(drafts, n, draft_probs, target_probs, accept_u, sample_u, greedy):
        x = drafts[:, 0]
        p, q = target_probs[:, 0], draft_probs[:, 0]
        p_x, q_x = p.gather(-1, x[:, None])[:, 0], q.gather(-1, x[:, None])[:, 0]
        if rule == "recover_from_p":
            accept = accept_u[:, 0] < p_x / q_x
            recovered = inverse_cdf_sample(p, sample_u[:, 0])
        else:  # "accept_q_over_p": the ratio inverted
            accept = accept_u[:, 0] < q_x / p_x
            recovered = inverse_cdf_sample((p - q).clamp(min=0), sample_u[:, 0])
        first = torch.where(accept, x, recovered)
        return first[:, None], accept.long()

    return verify


P_FULL = [0.05, 0.35, 0.1, 0.25, 0.2, 0.05]  # full support, so a broken rule cannot hide behind it


@pytest.mark.parametrize("rule", ["recover_from_p", "accept_q_over_p"])
def test_chi_square_rejects_broken_rules(rule):
    p, q = _probs(P_FULL)[0], _probs(Q_GEN)[0]
    target = torch.stack([p, _probs(P_BONUS)[0]])
    stat, crit = chi2_statistic(run_spec_step(target, q[None], TRIALS, seed=1234)[0][:, 0], p)
    assert stat < crit, f"correct rule: chi2 {stat:.2f} >= critical {crit:.2f}"
    out, _ = run_spec_step(target, q[None], TRIALS, seed=1234, verify=_broken_verify(rule))
    stat, crit = chi2_statistic(out[:, 0], p)
    assert stat > crit, f"{rule}: chi2 {stat:.2f} <= critical {crit:.2f}, the test has no power"
