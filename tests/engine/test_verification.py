"""Step verification on the logits' device: exact equality with the reference for the same
uniforms, nothing vocabulary-sized for all-greedy batches, logprobs beside speculation."""

import pytest
import torch

import engine.verification as verification
from engine.drafters.base import DraftProposal
from engine.drafters.draft_model import DraftModelDrafter
from engine.engine import LLMEngine
from engine.sampling import compute_probs, draw_uniforms, greedy_argmax, make_generator, race_scores
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from kernels.rejection import rejection_sample_reference
from tests.engine.bundled import loaded_draft, loaded_target, prompt_ids

VOCAB = 37


def _case(seed: int):
    """A ragged step: a prefill, greedy and sampled decodes with 0..4 drafts, model and one-hot q."""
    gen = torch.Generator().manual_seed(seed)
    drafts = [[], [3, 5], [7, 1, 2, 9], [], [4, 4, 4], [11]]
    num_logits = [1] + [len(d) + 1 for d in drafts[1:]]
    params = [SamplingParams(temperature=t, top_k=tk, top_p=tp, max_tokens=4) for t, tk, tp in
              [(0.7, 0, 1.0), (0.0, 0, 1.0), (1.0, 5, 1.0), (0.9, 0, 0.8), (0.0, 0, 1.0), (1.3, 0, 1.0)]]
    logits = torch.randn(sum(num_logits), VOCAB, generator=gen) * 3
    proposals = [None, DraftProposal(drafts[1]),
                 DraftProposal(drafts[2], torch.softmax(torch.randn(4, VOCAB, generator=gen), -1)),
                 None, DraftProposal(drafts[4]), DraftProposal(drafts[5])]  # row 5: deterministic q
    generators = [None if p.temperature == 0 else make_generator(100 + i) for i, p in enumerate(params)]
    return logits, num_logits, drafts, proposals, generators, params


def _reference(logits, num_logits, drafts, proposals, generators, params):
    """The rule written out per sequence, straight from kernels.rejection's reference."""
    k, batch = max(len(d) for d in drafts), len(drafts)
    rows = torch.split(logits, num_logits)
    target_logits = torch.stack([torch.cat([r, r[-1:].expand(k + 1 - r.shape[0], -1)]) for r in rows])
    draft_ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts])
    draft_probs, accept_u, sample_u = torch.zeros(batch, k, VOCAB), torch.zeros(batch, k), torch.zeros(batch, k + 1)
    for b, (d, prop, gen) in enumerate(zip(drafts, proposals, generators)):
        if d:
            draft_probs[b, : len(d)] = prop.probs if prop.probs is not None else torch.nn.functional.one_hot(
                torch.tensor(d), VOCAB).float()
        if gen is not None:
            u = draw_uniforms(gen, 2 * len(d) + 1)
            accept_u[b, : len(d)], sample_u[b, : len(d) + 1] = u[: len(d)], u[len(d):]
    target_probs = compute_probs(target_logits, torch.tensor([p.temperature for p in params]),
                                 torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]))
    out, num_acc = rejection_sample_reference(draft_ids, torch.tensor([len(d) for d in drafts]), draft_probs,
                                              target_probs, accept_u, sample_u,
                                              torch.tensor([p.temperature == 0 for p in params]))
    return [out[b, : n + 1].tolist() for b, n in enumerate(num_acc.tolist())], num_acc.tolist()


@pytest.mark.parametrize("seed", range(20))
def test_device_verification_equals_the_reference_for_the_same_uniforms(seed):
    case = _case(seed)
    expected = _reference(*_case(seed))  # fresh generators: the same uniforms
    batch = verification.build_verify_batch(*case)
    assert not batch.all_greedy
    assert verification.verify(batch) == expected


def test_an_all_greedy_batch_allocates_no_draft_probabilities():
    logits, num_logits, drafts, proposals, _, _ = _case(0)
    greedy = [SamplingParams(temperature=0.0, max_tokens=4)] * len(drafts)
    batch = verification.build_verify_batch(logits, num_logits, drafts, proposals, [None] * len(drafts), greedy)
    assert batch.all_greedy
    assert batch.draft_probs is None and batch.target_probs is None and batch.accept_u is None
    assert batch.target_logits.shape == (len(drafts), 5, VOCAB)
    assert verification.verify(batch) == _reference(logits, num_logits, drafts, proposals, [None] * 6, greedy)


def test_greedy_engine_steps_never_compute_probabilities(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("an all-greedy step computed target probabilities")

    monkeypatch.setattr(verification, "compute_probs", forbidden)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192, max_waiting=100)
    engine = LLMEngine(loaded_target(), DraftModelDrafter(loaded_draft(), 4, 1024), 3, sched)
    for i, p in enumerate(prompt_ids(4)):
        engine.add_request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.num_draft_tokens > 0 and engine.finished_by_reason == {"length": 4}


def _run(requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8192, max_waiting=100)
    engine = LLMEngine(loaded_target(), DraftModelDrafter(loaded_draft(), 8, 1024), 4, sched)
    outs = {rid: engine.add_request(rid, ids, p) for rid, ids, p in requests}
    while engine.has_unfinished_requests():
        engine.step()
    return {rid: o.outputs[0] for rid, o in outs.items()}


def test_logprobs_and_speculation_in_one_batch_with_other_requests():
    prompts = prompt_ids(4)
    lp = SamplingParams(temperature=0.8, seed=3, max_tokens=16, logprobs=2, ignore_eos=True)
    others = [("greedy", prompts[1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
              ("sampled", prompts[2], SamplingParams(temperature=1.0, seed=9, max_tokens=16, ignore_eos=True)),
              ("greedy-lp", prompts[3], SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True))]
    together = _run([("lp", prompts[0], lp)] + others)
    alone = {rid: _run([(rid, ids, p)])[rid] for rid, ids, p in [("lp", prompts[0], lp)] + others}
    for rid, out in together.items():
        assert out.token_ids == alone[rid].token_ids  # batch composition changes no output
    for rid, n in (("lp", 2), ("greedy-lp", 1)):
        out = together[rid]
        assert [t.token_id for t in out.logprobs] == out.token_ids
        assert all(len(t.top) == n and t.logprob <= 0 for t in out.logprobs)
        for a, b in zip(out.logprobs, alone[rid].logprobs):
            assert a.top.keys() == b.top.keys() and abs(a.logprob - b.logprob) < 1e-4
    assert together["greedy"].logprobs is None


def test_a_race_row_accepts_the_drafts_its_race_picks_and_emits_the_race_at_the_first_miss():
    """A seeded row (``races``) is verified on its race scores: drafts equal to the race's argmax
    at their positions are accepted, the first other one is replaced by the race's token; an
    unseeded sampled row beside it still draws its uniforms; its own generator is never read."""
    torch.manual_seed(0)
    vocab, seed, position = 37, 21, 9
    logits = torch.randn(4 + 1, vocab)  # race row: 3 drafts + 1; plain sampled row: 1
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=seed), SamplingParams(temperature=1.0)]
    p = compute_probs(logits[None, :4], torch.tensor([0.8]), torch.tensor([0]), torch.tensor([0.9]))[0]
    race = [int(greedy_argmax(race_scores(p[j:j + 1], [(seed, position + j)]))[0]) for j in range(4)]
    drafts = [race[0], race[1], (race[2] + 1) % vocab]
    gen, race_gen = make_generator(3), make_generator(4)
    state = race_gen.get_state()
    batch = verification.build_verify_batch(logits, [4, 1], [drafts, []], [DraftProposal(drafts), None],
                                            [race_gen, gen], params, [(seed, position), None])
    out, accepted = verification.verify(batch)
    assert accepted[0] == 2 and out[0] == [race[0], race[1], race[2]]
    assert torch.equal(race_gen.get_state(), state)  # nothing drawn from the race row's generator
    assert not torch.equal(gen.get_state(), make_generator(3).get_state())  # the other row drew its uniform
