"""compute_probs, greedy_argmax, top_logprobs and per-request generators on hand-sized examples."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import (
    compute_probs,
    draw_uniforms,
    exp1_from_bits,
    greedy_argmax,
    make_generator,
    race_noise,
    race_scores,
    top_logprobs,
)


def probs_of(logits, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """compute_probs on one (V,) row with scalar parameters."""
    return compute_probs(torch.tensor([logits], dtype=torch.float32), torch.tensor([temperature]),
                         torch.tensor([top_k]), torch.tensor([top_p]))[0]


LOG_P = [math.log(x) for x in (0.5, 0.2, 0.2, 0.1)]  # softmax(LOG_P) = [.5, .2, .2, .1]


def test_plain_softmax_and_temperature_scaling():
    logits = [1.0, 2.0, -0.5, 0.0]
    for t in (1.0, 0.5, 2.0):
        expected = torch.softmax(torch.tensor(logits) / t, dim=-1)
        torch.testing.assert_close(probs_of(logits, temperature=t), expected)


def test_temperature_zero_is_one_hot_argmax_with_ties_to_lower_id():
    assert probs_of([1.0, 3.0, 2.0, 3.0], temperature=0.0).tolist() == [0, 1, 0, 0]
    # Truncation settings do not matter for greedy rows.
    assert probs_of([0.0, 0.0, 5.0], temperature=0.0, top_k=1, top_p=0.1).tolist() == [0, 0, 1]


def test_top_k_keeps_exactly_k_with_ties_toward_lower_id():
    logits = [1.0, 3.0, 2.0, 3.0, 0.0]
    p = probs_of(logits, top_k=2)
    assert p.tolist() == pytest.approx([0, 0.5, 0, 0.5, 0])
    p = probs_of(logits, top_k=1)  # the tie 1/3 at the k-th value: only the lower id survives
    assert p.tolist() == [0, 1, 0, 0, 0]
    p = probs_of(logits, top_k=3)
    e = [math.exp(3), math.exp(2), math.exp(3)]
    assert p.tolist() == pytest.approx([0, e[0] / sum(e), e[1] / sum(e), e[2] / sum(e), 0])
    full = torch.softmax(torch.tensor(logits), dim=-1)
    for disabled in (0, -1, 5, 100):
        torch.testing.assert_close(probs_of(logits, top_k=disabled), full)


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.4, [1, 0, 0, 0]),  # 0.5 alone reaches 0.4
        (0.5, [1, 0, 0, 0]),  # exactly reached by the first token: >= top_p, stop there
        (0.65, [0.5 / 0.7, 0.2 / 0.7, 0, 0]),  # tie 0.2/0.2: token 1 (lower id) is taken first
        (0.8, [0.5 / 0.9, 0.2 / 0.9, 0.2 / 0.9, 0]),
        (0.95, [0.5, 0.2, 0.2, 0.1]),
        (1.0, [0.5, 0.2, 0.2, 0.1]),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, expected):
    assert probs_of(LOG_P, top_p=top_p).tolist() == pytest.approx(expected, abs=1e-6)


def test_top_p_tie_order_is_by_token_id_even_when_ids_are_reversed():
    # Tokens 3 and 1 tie at 0.3; 0.4 + 0.3 reaches 0.6 with the lower id (1) first.
    logits = [math.log(x) for x in (0.4, 0.3, 0.0 + 1e-30, 0.3)]
    assert probs_of(logits, top_p=0.6).tolist() == pytest.approx([0.4 / 0.7, 0.3 / 0.7, 0, 0])


def test_order_is_temperature_then_top_k_then_top_p():
    # top-k=2 renormalises [.5, .2] to [.714, .286]; top-p 0.7 is then reached by token 0 alone.
    assert probs_of(LOG_P, top_k=2, top_p=0.7).tolist() == [1, 0, 0, 0]
    # Temperature first: at T=2 the distribution flattens, so top-p 0.7 needs three tokens.
    p = probs_of(LOG_P, temperature=2.0, top_p=0.7)
    flat = torch.softmax(torch.tensor(LOG_P) / 2, dim=-1)
    assert flat[:2].sum() < 0.7 <= flat[:3].sum()
    assert p.tolist() == pytest.approx((flat * torch.tensor([1, 1, 1, 0]) / flat[:3].sum()).tolist())


def test_batched_rows_and_three_dimensional_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 9, generator=gen)
    temperature = torch.tensor([0.0, 0.8, 1.5])
    top_k = torch.tensor([0, 3, -1])
    top_p = torch.tensor([1.0, 1.0, 0.6])
    probs = compute_probs(logits, temperature, top_k, top_p)
    assert probs.shape == (3, 4, 9) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4))
    for b in range(3):
        for s in range(4):
            row = compute_probs(logits[b, s][None], temperature[b:b + 1], top_k[b:b + 1], top_p[b:b + 1])
            torch.testing.assert_close(probs[b, s], row[0])
    assert ((probs[1] > 0).sum(-1) == 3).all()
    assert ((probs[0] == 1).sum(-1) == 1).all()


def test_bf16_logits_are_computed_in_float32():
    probs = compute_probs(torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16), torch.tensor([1.0]),
                          torch.tensor([0]), torch.tensor([1.0]))
    assert probs.dtype == torch.float32


def test_greedy_argmax_lower_id_on_ties():
    logits = torch.tensor([[1.0, 5.0, 5.0], [7.0, 7.0, 7.0], [0.0, -1.0, 2.0]])
    ids = greedy_argmax(logits)
    assert ids.tolist() == [1, 0, 2] and ids.dtype == torch.int64


def test_top_logprobs_from_raw_logits():
    logits = torch.tensor([[2.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    token_lp, top_ids, top_lp = top_logprobs(logits, torch.tensor([1, 3]), 3)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(token_lp, torch.stack([ref[0, 1], ref[1, 3]]))
    assert top_ids.tolist() == [[0, 2, 1], [3, 0, 1]]
    torch.testing.assert_close(top_lp, ref.gather(-1, top_ids))
    _, ids0, lp0 = top_logprobs(logits, torch.tensor([1, 3]), 0)
    assert ids0.shape == (2, 0) and lp0.shape == (2, 0)


def test_generators_are_per_request_and_reproducible():
    a, b = make_generator(7), make_generator(7)
    other = make_generator(8)
    first = draw_uniforms(a, 5)
    draw_uniforms(other, 100)  # another request drawing in between changes nothing
    assert torch.equal(first, draw_uniforms(b, 5))
    assert first.dtype == torch.float32 and first.shape == (5,)
    assert ((first >= 0) & (first < 1)).all()
    assert not torch.equal(draw_uniforms(a, 5), first)  # the stream advances
    assert not torch.equal(draw_uniforms(make_generator(None), 8), draw_uniforms(make_generator(None), 8))


def test_race_noise_is_a_function_of_seed_and_position_only():
    a = race_noise([(5, 3)], 64)[0]
    assert torch.equal(a, race_noise([(5, 3)], 64)[0]) and bool((a > 0).all())
    assert not torch.equal(a, race_noise([(5, 4)], 64)[0]) and not torch.equal(a, race_noise([(6, 3)], 64)[0])
    # The same row whatever else is drawn beside it, and token t's draw whatever the vocabulary size.
    rows = race_noise([(6, 3), (5, 3), (5, 4)], 80)
    assert torch.equal(rows[1, :64], a) and torch.equal(rows[2], race_noise([(5, 4)], 80)[0])


def test_every_24_bit_draw_maps_to_a_positive_finite_non_increasing_exp1_value():
    """All 2**24 inputs: u = 2**24 - 1 used to round to (u + 0.5) / 2**24 = 1, a draw of -0."""
    u = torch.arange(1 << 24, dtype=torch.int32)
    noise = exp1_from_bits(u)
    assert noise.dtype == torch.float32 and bool(torch.isfinite(noise).all()) and bool((noise > 0).all())
    assert bool((noise[1:] <= noise[:-1]).all())
    assert abs(noise[-1].item() - 2.0 ** -24) < 1e-12 and abs(noise[0].item() - 25 * math.log(2)) < 1e-5
    # Every other draw is the unclamped formula's, so seeded samples stay what they were.
    assert torch.equal(noise[:-1], -torch.log((u[:-1].float() + 0.5) * 2.0 ** -24))


def test_a_seeded_sample_never_picks_a_zero_probability_token():
    """(seed 2343, position 11) drew -0 for token 1813 of 4096 (a client's trial found a top-k = 20
    sample of rank 1268): p / noise was NaN there and argmax took it."""
    keys = [(2343, 11)]
    assert bool((race_noise(keys, 4096) > 0).all())
    p = torch.zeros(1, 4096)
    p[0, 7] = 1.0  # top_k = 1: one token left
    assert greedy_argmax(race_scores(p, keys)).tolist() == [7]


def test_race_noise_is_exp1():
    """Kolmogorov-Smirnov against Exp(1) over 64 rows x 4096 tokens (the hashed draws' marginal),
    and tokens of one row and rows of nearby positions uncorrelated."""
    noise = race_noise([(seed, pos) for seed in range(8) for pos in range(8)], 4096).double()
    x = noise.flatten().sort().values
    cdf = 1 - torch.exp(-x)
    n = x.numel()
    ks = torch.maximum(torch.arange(1, n + 1) / n - cdf, cdf - torch.arange(n) / n).max().item()
    assert ks < 1.63 / n ** 0.5  # the 1 % critical value
    assert abs(x.mean().item() - 1) < 0.01 and abs(x.var().item() - 1) < 0.02
    u = torch.exp(-noise)  # uniform under Exp(1)
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):  # neighbouring tokens; neighbouring positions
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(corr) < 0.01


def test_the_race_samples_from_p_and_a_broken_race_is_rejected():
    """argmax(p / Exp(1) noise) over 12,000 (seed, position) pairs follows p, a zero-probability
    token never wins; the same test rejects argmax(p + noise) (a plausible wrong rule)."""
    from tests.kernels.test_rejection_reference import chi2_statistic

    p = torch.tensor([0.4, 0.25, 0.0, 0.2, 0.1, 0.05])
    pairs = [(seed, pos) for seed in range(400) for pos in range(30)]
    noise = race_noise(pairs, p.numel())
    right = greedy_argmax(race_scores(p.expand(len(pairs), -1), pairs))
    stat, critical = chi2_statistic(right, p)
    assert stat < critical
    wrong = greedy_argmax(torch.where(p > 0, p + noise, 0.0))
    stat, critical = chi2_statistic(wrong, p)
    assert stat > critical


def test_a_top_p_that_underflows_float32_still_keeps_the_top_token():
    """top_p = 1e-46 is > 0 (a valid request) but 0 in float32: rank 0 must survive anyway."""
    probs = probs_of(LOG_P, top_p=1e-46)
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]
