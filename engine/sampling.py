"""The exact distributions the draft and target models sample from, and per-request randomness.

:func:`compute_probs` turns logits into the distribution a request samples from. Speculative
decoding is lossless only if the verifier's ``p`` is precisely the distribution the target model
would have sampled from without speculation, so both the draft ``q`` and the target ``p`` come
from this one function (Leviathan et al. 2023, Section 2.3 and Appendix A.1).

Randomness is per request: each request owns a CPU ``torch.Generator`` (:func:`make_generator`)
and draws its uniforms from it (:func:`draw_uniforms`), so a request's output depends only on its
seed, never on which other requests share its batch or on the device.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def compute_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Sampling distribution per row: temperature, then top-k, then top-p, then renormalise.

    The order is that of Hugging Face ``generate`` and vLLM. Per row:

    * ``temperature == 0``: the one-hot of ``argmax(logits)`` (ties to the lower token id).
    * otherwise ``logits / temperature``; then top-k keeps the ``k`` largest logits, equal logits
      ordered by token id so exactly ``k`` survive (``k <= 0`` or ``k >= V`` disables it); then
      top-p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration") keeps the
      smallest prefix of the survivors, sorted by probability descending and then by token id,
      whose cumulative probability is ``>= top_p`` (always at least one token; ``top_p >= 1``
      disables it); finally a softmax over the kept logits.

    Args:
        logits: ``(B, V)`` or ``(B, S, V)`` float (any float dtype; computed in float32).
        temperature: ``(B,)`` float32, ``>= 0``.
        top_k: ``(B,)`` int64; ``<= 0`` disables.
        top_p: ``(B,)`` float32 in ``(0, 1]``.

    Returns:
        float32 probabilities of ``logits``' shape; the per-row parameters apply to all ``S``
        positions of a ``(B, S, V)`` input.

    Raises:
        ValueError: if ``logits`` is not 2-D/3-D or the parameter shapes are not ``(B,)``.
    """
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be (B, V) or (B, S, V), got {tuple(logits.shape)}")
    batch = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if tuple(t.shape) != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {tuple(t.shape)}")
    shape = logits.shape
    steps = shape[1] if logits.dim() == 3 else 1
    flat = logits.reshape(-1, shape[-1]).float()
    # Expand the per-request parameters to one value per flattened row.
    temperature = temperature.to(flat.device, torch.float32).repeat_interleave(steps)
    top_k = top_k.to(flat.device, torch.int64).repeat_interleave(steps)
    top_p = top_p.to(flat.device, torch.float32).repeat_interleave(steps)

    is_greedy = temperature == 0
    # Greedy rows are replaced below; dividing them by 1 keeps their arithmetic finite.
    scaled = flat / torch.where(is_greedy, 1.0, temperature)[:, None]
    scaled = _truncate(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, greedy_argmax(flat)[:, None], 1.0)
    probs = torch.where(is_greedy[:, None], one_hot, probs)
    return probs.reshape(shape)


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set the logits that top-k/top-p drop to -inf. ``scaled``: ``(N, V)`` float32."""
    vocab = scaled.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1
    if not bool((use_k | use_p).any()):
        return scaled  # skip the O(V log V) sort when no row truncates
    # Stable descending sort: equal logits stay in token-id order, so tie breaks are by lower id.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    drop = use_k[:, None] & (rank >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    # Top-p on the top-k survivors' renormalised distribution. A token is kept iff the mass
    # strictly before it is < top_p: that is the smallest prefix reaching top_p. Rank 0 always
    # survives, also when top_p underflows float32 to 0 (a request's 1e-46 is > 0 as a double).
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = use_p[:, None] & (mass_before >= top_p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim, ties to the lower token id. Returns int64 of ``logits.shape[:-1]``.

    ``torch.argmax`` is documented to return the first maximal index, which is the lower id.
    """
    return torch.argmax(logits, dim=-1)


def top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of chosen tokens and the top-k alternatives, from the *raw* logits.

    vLLM's default logprobs semantics: ``log_softmax`` of the model's logits before temperature
    and truncation, so the values do not depend on the sampling parameters.

    Args:
        logits: ``(N, V)`` float.
        token_ids: ``(N,)`` int64 sampled tokens.
        k: number of alternatives, ``>= 0``.

    Returns:
        ``token_logprob``: ``(N,)`` float32; ``top_ids``: ``(N, k)`` int64, descending, ties to
        the lower id; ``top_logprobs``: ``(N, k)`` float32.

    Raises:
        ValueError: on bad shapes or ``k`` outside ``[0, V]``.
    """
    if logits.dim() != 2 or tuple(token_ids.shape) != logits.shape[:1]:
        raise ValueError(f"logits must be (N, V) and token_ids (N,), got {tuple(logits.shape)} "
                         f"and {tuple(token_ids.shape)}")
    if not 0 <= k <= logits.shape[1]:
        raise ValueError(f"k must be in [0, {logits.shape[1]}], got {k}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_logprob = logprobs.gather(-1, token_ids.long()[:, None]).squeeze(-1)
    # torch.topk leaves the order of ties unspecified; a stable sort makes it the lower id.
    top_values, top_ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return token_logprob, top_ids[:, :k].contiguous(), top_values[:, :k].contiguous()


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request, seeded with ``seed`` or, when None, nondeterministically."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def draw_uniforms(gen: torch.Generator, n: int) -> torch.Tensor:
    """``(n,)`` float32 uniforms in ``[0, 1)`` from ``gen`` only (on CPU; move them as needed)."""
    return torch.rand(n, generator=gen, dtype=torch.float32)


_MASK64 = (1 << 64) - 1


def _position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (seed, position): SplitMix64's finaliser of their combination, so
    nearby seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _int32(value: int) -> int:
    """``value``'s low 32 bits as a signed int32 (torch's integer ops wrap in two's complement)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _shr32(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 ``z`` (torch's ``>>`` is arithmetic on signed integers)."""
    return (z >> bits) & ((1 << (32 - bits)) - 1)


_GOLDEN32, _FMIX1, _FMIX2 = _int32(0x9E3779B9), _int32(0x85EBCA6B), _int32(0xC2B2AE35)


def race_noise(keys: list[tuple[int, int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(len(keys), vocab)`` float32 Exp(1) draws, row ``i`` for the token at position
    ``keys[i][1]`` of the sequence seeded ``keys[i][0]``: a function of that pair only (never of
    k, the batch or what was drawn before; on another device, up to the last bit of ``log``).

    ``argmax(p / noise)`` is then a sample from ``p`` (the exponential race, the same as the
    Gumbel-max trick: ``argmax(log p + g)`` with ``g = -log(noise)``). When the draft model proposes
    ``argmax(q / noise)`` with the *same* noise, the target's token at that position does not
    depend on the drafter or on k at all, and the draft matches it with probability at least
    ``(1 - TV(p, q)) / (1 + TV(p, q))`` (Daliri, Musco and Suresh 2024, "Coupling without
    communication and drafter-invariant speculative decoding", Theorem 1).

    The draws are counter-based, made on ``device`` in one pass for every row: token ``t`` of a
    row hashes ``t`` and the row's key (:func:`_position_seed`) with MurmurHash3's 32-bit
    finaliser into 24 uniform bits ``u``, and the draw is ``-log((u + 0.5) / 2**24)``
    (:func:`exp1_from_bits`: in ``[6e-8, 17.3]``, never 0, so ``p / noise`` is finite). A seeded
    CPU generator per row (the previous form) took ~75 us a row at vocab 4096 and a host-to-device
    copy; this takes ~130 us for 7 rows.
    """
    row_keys = torch.tensor([_int32(_position_seed(seed, position)) for seed, position in keys],
                            dtype=torch.int32, device=device)
    z = torch.arange(vocab, dtype=torch.int32, device=device)[None, :] * _GOLDEN32 + row_keys[:, None]
    z = (z ^ _shr32(z, 16)) * _FMIX1
    z = (z ^ _shr32(z, 13)) * _FMIX2
    z = z ^ _shr32(z, 16)
    return exp1_from_bits(_shr32(z, 8))


def exp1_from_bits(u: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws ``-log((u + 0.5) / 2**24)`` from int32 ``u`` uniform in ``[0, 2**24)``, as
    float32 in ``[6e-8, 17.3]``: positive and finite for every ``u``.

    In float32 ``u = 2**24 - 1`` rounds to ``(u + 0.5) / 2**24 = 1``: a draw of -0, so
    ``p / noise`` was NaN or inf and ``argmax`` picked that token whatever its probability (one
    token in 2**24: a seeded sample ignored top-k/top-p at ~vocab / 2**24 of positions). The
    argument is capped at the largest float32 below 1; every other draw is unchanged (above 2**23
    the half is rounded to even, which only makes neighbouring draws tie). An exact form (``log1p``
    of the complement) cost ~3.5x the time on every seeded step.
    """
    return -torch.log(torch.clamp_max((u.float() + 0.5) * 2.0 ** -24, 1.0 - 2.0 ** -24))


def race_scores(probs: torch.Tensor, keys: list[tuple[int, int]]) -> torch.Tensor:
    """``probs / noise``: the argmax of row ``i`` is the token of ``keys[i]`` = (seed, position)
    (see :func:`race_noise`).

    Args:
        probs: ``(S, V)`` float32 sampling distributions (from :func:`compute_probs`), any device.
        keys: ``S`` (seed, position) pairs, one per row.

    Returns:
        ``(S, V)`` float32 scores on ``probs.device``; only their argmax means anything.
    """
    return probs / race_noise(keys, probs.shape[-1], probs.device)
