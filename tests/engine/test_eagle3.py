"""EAGLE-3 heads: the head's math, lossless speculation with it, and refusal of heads that do not fit."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.drafters.base import DraftRequest
from engine.drafters.eagle import EagleDrafter
from engine.errors import CheckpointError, ConfigError
from engine.loader import load_model
from engine.model import ForwardBatch
from engine.model.eagle3 import Eagle3Head
from engine.sampling_params import SamplingParams
from tests.helpers.tiny_checkpoints import VOCAB, make_eagle3_head


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoints):
    return tiny_checkpoints["mixtral"][0]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3") / "head"
    return path, make_eagle3_head(path, seed=3)


def _rms(x, w, eps=1e-6):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta=10000.0):
    """x: (heads, d) at integer position pos; HF rotate_half convention."""
    d = x.shape[-1]
    freqs = pos / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([freqs.cos(), freqs.cos()]), torch.cat([freqs.sin(), freqs.sin()])
    rotated = torch.cat([-x[:, d // 2:], x[:, : d // 2]], -1)
    return x * cos + rotated * sin


def reference_head(t, embed, tokens, hs, heads=4, kv_heads=2, head_dim=8):
    """The architecture written out row by row in float64: row p gets token tokens[p] and feature
    hs[p] (already hidden-wide); causal attention over rows 0..p. Returns (draft logits, outputs)."""
    t = {k: v.double() for k, v in t.items()}
    qs, ks, vs = [], [], []
    for p, (tok, h) in enumerate(zip(tokens, hs)):
        x = torch.cat([_rms(embed[tok].double(), t["midlayer.input_layernorm.weight"]),
                       _rms(h, t["midlayer.hidden_norm.weight"])])
        qs.append(_rope((t["midlayer.self_attn.q_proj.weight"] @ x).view(heads, head_dim), p))
        ks.append(_rope((t["midlayer.self_attn.k_proj.weight"] @ x).view(kv_heads, head_dim), p))
        vs.append((t["midlayer.self_attn.v_proj.weight"] @ x).view(kv_heads, head_dim))
    logits, outs = [], []
    for p, h in enumerate(hs):
        attn = []
        for i in range(heads):
            g = i // (heads // kv_heads)
            scores = torch.stack([qs[p][i] @ ks[j][g] for j in range(p + 1)]) / head_dim ** 0.5
            w = torch.softmax(scores, 0)
            attn.append(sum(w[j] * vs[j][g] for j in range(p + 1)))
        r = h + t["midlayer.self_attn.o_proj.weight"] @ torch.cat(attn)
        u = _rms(r, t["midlayer.post_attention_layernorm.weight"])
        gate = t["midlayer.mlp.gate_proj.weight"] @ u
        r = r + t["midlayer.mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * (t["midlayer.mlp.up_proj.weight"] @ u))
        outs.append(r)
        logits.append(t["lm_head.weight"] @ _rms(r, t["norm.weight"]))
    return torch.stack(logits), torch.stack(outs)


def test_target_features_are_the_layer_inputs_of_the_reference_model(tiny_checkpoints):
    """Feature id i is the residual entering layer i (transformers' ``hidden_states[i]``); id
    num_layers is the last layer's output, which transformers reports after the final norm."""
    from engine.model.layers import rms_norm

    path, ref = tiny_checkpoints["mixtral"]
    target = load_model(path)
    ids = [3, 77, 12, 5, 64, 9]
    kv = target.model.new_kv_cache(1, 16)
    kv.reserve(kv.allocate(), len(ids))
    _, feats = target.model.forward_with_features(ForwardBatch.build([0], [ids], [0], "all"), kv, (2, 0, 1))
    with torch.no_grad():
        hidden = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
    last, first, middle = feats.split(32, -1)
    torch.testing.assert_close(first, hidden[0][0])
    torch.testing.assert_close(middle, hidden[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rms_norm(last, target.model.norm, target.config.rms_norm_eps), hidden[2][0],
                               atol=1e-5, rtol=1e-5)


def test_head_forward_and_cached_draft_step_equal_the_reference(target_dir, head):
    path, tensors = head
    target = load_model(target_dir)
    model = Eagle3Head(path, target.config, target.model.embed)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (7,), generator=g).tolist()
    feats = torch.randn(6, 96, generator=g)
    kv = model.new_kv_cache(1, 32)
    slot = kv.allocate()
    kv.reserve(slot, 6)
    logits, out = model.forward(ForwardBatch.build([slot], [tokens[:6]], [0], "all"), kv, feats)
    kv.reserve(slot, 7)  # one draft step: the last output is the next row's feature, from the cache
    step_logits, _ = model.forward(ForwardBatch.build([slot], [tokens[6:]], [6]), kv, out[-1:])
    hs = [h for h in (tensors["fc.weight"].double() @ feats.double().T).T] + [out[-1].double()]
    ref_logits, ref_out = reference_head(tensors, target.model.embed, tokens, hs)
    draft_ids = torch.arange(96) + tensors["d2t"]
    assert torch.allclose(out.double(), ref_out[:6], atol=1e-4)
    got = torch.cat([logits, step_logits])
    assert torch.allclose(got[:, draft_ids].double(), ref_logits, atol=1e-4)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[draft_ids] = False
    assert torch.isneginf(got[:, outside]).all()  # tokens outside the draft vocabulary are never drafted


def test_training_ttt_unroll_equals_the_engine_draft_loop(target_dir, head):
    """scripts/eagle3_training's unrolled steps are what the engine computes with its cache."""
    from scripts.eagle3_training import TrainableEagle3

    path, tensors = head
    target = load_model(target_dir)
    engine_head = Eagle3Head(path, target.config, target.model.embed)
    draft_ids = torch.arange(96) + tensors["d2t"]
    m = TrainableEagle3(32, 48, 4, 2, 8, 1e-6, 10000.0, target.model.embed, draft_ids)
    norms = {"norm", "midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm"}
    m.load_state_dict({k.removesuffix(".weight") if k.removesuffix(".weight") in norms else k: v
                       for k, v in tensors.items()})
    assert set(m.checkpoint_tensors()) == set(tensors)
    g = torch.Generator().manual_seed(1)
    tokens, feats = torch.randint(0, VOCAB, (1, 12), generator=g), torch.randn(1, 12, 96, generator=g)
    with torch.no_grad():
        ttt = m.ttt_logits(tokens, feats, 3)
    drafter = EagleDrafter(engine_head, 1, 32)
    a = 12 - 3 - 1  # the last anchor: true rows 0..a, drafts follow the TRUE tokens (teacher forcing)
    kv = drafter.kv
    slot = kv.allocate()
    kv.reserve(slot, a + 1)
    logits, out = engine_head.forward(ForwardBatch.build([slot], [tokens[0, 1:a + 2].tolist()], [0], "all"), kv,
                                      feats[0, :a + 1])
    steps = [logits[-1]]
    for j in (2, 3):
        kv.reserve(slot, a + j)
        step, out = engine_head.forward(ForwardBatch.build([slot], [[int(tokens[0, a + j])]], [a + j - 1]), kv, out[-1:])
        steps.append(step[0])
    for j in range(3):
        assert torch.allclose(steps[j][draft_ids], ttt[j][0, a], atol=1e-4)



def test_training_head_loads_a_saved_head_for_a_warm_start(target_dir, head):
    """scripts/train_eagle3.py --init: a saved head's tensors go back into the trainable head
    unchanged; a missing or misshapen tensor is refused by name."""
    from scripts.eagle3_training import TrainableEagle3

    path, tensors = head
    target = load_model(target_dir)
    draft_ids = torch.arange(96) + tensors["d2t"]
    m = TrainableEagle3(32, 48, 4, 2, 8, 1e-6, 10000.0, target.model.embed, draft_ids)
    m.load_checkpoint_tensors(load_file(str(path / "model.safetensors")))
    saved = m.checkpoint_tensors()
    assert set(saved) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(saved[k], v), k
    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight"):
        m.load_checkpoint_tensors({k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"})
    with pytest.raises(ValueError, match=r"fc.weight: shape \(32, 48\)"):
        m.load_checkpoint_tensors({**tensors, "fc.weight": torch.zeros(32, 48)})

def _prompts(n=6):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 40, (n,), generator=g)]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_a_head_equals_plain_greedy_offline(target_dir, head, k):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    plain = LLM(str(target_dir), skip_tokenizer_init=True).generate(_prompts(), params)
    # A small token budget: prompts arrive in chunks, so features accumulate over partial prefills.
    llm = LLM(str(target_dir), draft_model=str(head[0]), speculative_method="eagle3", num_speculative_tokens=k,
              speculative_policy="fixed", max_num_batched_tokens=24, skip_tokenizer_init=True)
    spec = llm.generate(_prompts(), params)
    assert [r.outputs[0].token_ids for r in spec] == [r.outputs[0].token_ids for r in plain]
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert llm.engine.kv.num_used == 0 and llm.engine.drafter.kv.num_used == 0


def test_drafter_resumes_from_features_it_was_not_sent_before(target_dir, head):
    """A drafter that misses the features of the rows it needs refuses; given them, it re-derives."""
    target = load_model(target_dir)
    drafter = EagleDrafter(Eagle3Head(head[0], target.config, target.model.embed), 2, 64)
    feats = torch.randn(9, 96, generator=torch.Generator().manual_seed(2))
    tokens = list(range(1, 11))
    with pytest.raises(ValueError, match="needs target features of positions 0..8"):
        drafter.propose([DraftRequest("s", tokens, 2, features=feats[5:], features_start=5)])
    full = drafter.propose([DraftRequest("s", tokens, 2, features=feats)])[0].token_ids
    assert drafter.rows_kept("s", tokens + [3]) == 9
    fresh = EagleDrafter(drafter.head, 2, 64)
    assert fresh.propose([DraftRequest("s", tokens, 2, features=feats)])[0].token_ids == full


def _broken(src, tmp_path, config=None, drop=None, replace=None):
    out = tmp_path / "broken"
    out.mkdir()
    raw = json.loads((src / "config.json").read_text())
    raw.update(config or {})
    (out / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop(drop, None)
    tensors.update(replace or {})
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("change, error, message", [
    (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}), ConfigError,
     r"eagle_aux_hidden_state_layer_ids: need three layer ids in \[0, 2\] of the target, got \[0, 1, 3\]"),
    (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}}), ConfigError,
     r"need three layer ids"),
    (dict(config={"target_hidden_size": 64}), ConfigError, r"target_hidden_size .*64-wide .* hidden size is 32"),
    (dict(config={"vocab_size": 200}), ConfigError, r"config.vocab_size: 200 differs from the target's 128"),
    (dict(config={"architectures": ["LlamaForCausalLM"]}), ConfigError, "is not an EAGLE-3 head"),
    (dict(config={"num_hidden_layers": 2}), ConfigError, "config.num_hidden_layers"),
    (dict(drop="midlayer.hidden_norm.weight"), CheckpointError, r"'midlayer.hidden_norm.weight' is missing"),
    (dict(replace={"fc.weight": torch.zeros(32, 64)}), CheckpointError, r"'fc.weight' has shape \(32, 64\), expected \(32, 96\)"),
    (dict(replace={"d2t": torch.full((96,), 500)}), CheckpointError, r"'d2t' maps draft ids outside \[0, 128\)"),
    (dict(replace={"d2t": torch.zeros(96, dtype=torch.int64) - torch.arange(96)}), CheckpointError, "two draft ids"),
    (dict(drop="d2t"), CheckpointError, r"'d2t' is missing"),
])
def test_heads_that_do_not_fit_are_refused_at_startup(target_dir, head, tmp_path, change, error, message):
    bad = _broken(head[0], tmp_path, **change)
    with pytest.raises(error, match=message):
        LLM(str(target_dir), draft_model=str(bad), speculative_method="eagle3", skip_tokenizer_init=True)


def test_eagle3_without_a_head_is_a_config_error(target_dir, tmp_path):
    from actors.config import ServeConfig
    from engine.yaml_config import load_yaml

    with pytest.raises(ConfigError, match="draft_model: speculative_method 'eagle3' needs draft_model"):
        LLM(str(target_dir), speculative_method="eagle3")
    (tmp_path / "serve.yaml").write_text(f"model_name: x\nengine:\n  model: {target_dir}\n  speculative_method: eagle3\n")
    with pytest.raises(ConfigError, match=r"needs draft_model - at `\$\.engine`"):
        load_yaml(tmp_path / "serve.yaml", ServeConfig)


def test_sampled_output_with_a_head_follows_the_target_distribution(tiny_checkpoints, head):
    """The law of the second sampled token (verified against a head draft whose q is the head's
    softmax) equals the target's own marginal, from the transformers reference model (chi-square;
    bins expecting fewer than 5 draws merged)."""
    from tests.kernels.test_rejection_reference import chi2_statistic

    target_dir, ref = tiny_checkpoints["mixtral"]
    prompt, n = [5, 17, 42, 99, 3], 2000
    with torch.no_grad():
        p1 = torch.softmax(ref(torch.tensor([prompt])).logits[0, -1].double(), -1)  # (VOCAB,)
        nexts = torch.tensor([prompt + [a] for a in range(VOCAB)])
        p2 = torch.softmax(ref(nexts).logits[:, -1].double(), -1)  # (VOCAB, VOCAB): row a = p(. | a)
    marginal = p1 @ p2
    llm = LLM(str(target_dir), draft_model=str(head[0]), speculative_method="eagle3", num_speculative_tokens=2,
              speculative_policy="fixed", max_num_seqs=64, skip_tokenizer_init=True)
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s) for s in range(n)]
    seconds = torch.tensor([r.outputs[0].token_ids[1] for r in llm.generate([prompt] * n, params)])
    small = marginal * n < 5
    merged = torch.cat([marginal[~small], marginal[small].sum()[None]])
    index = torch.cumsum(~small, 0) - 1
    bins = torch.where(small[seconds], merged.numel() - 1, index[seconds])
    stat, critical = chi2_statistic(bins, merged)
    assert stat < critical, (stat, critical)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] >= n and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


def test_the_bundled_head_is_lossless_and_drafts_well_on_heldout_prompts():
    """checkpoints/stdlib-eagle3 on the bundled target: greedy output equals plain greedy, and more
    than half a draft token is accepted per verification (the bound the bundled draft model meets)."""
    from engine.drafters.base import NoneDrafter
    from engine.engine import LLMEngine
    from engine.scheduler import SchedulerConfig
    from tests.engine.bundled import ROOT, loaded_target, prompt_ids

    target = loaded_target()
    drafter = EagleDrafter(Eagle3Head(ROOT / "checkpoints/stdlib-eagle3", target.config, target.model.embed), 8, 1024)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = []
    for d, k in ((NoneDrafter(), 0), (drafter, 4)):
        engine = LLMEngine(target, d, k, SchedulerConfig(max_num_seqs=8, max_waiting=100), speculative_policy="fixed")
        reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompt_ids(16))]
        while engine.has_unfinished_requests():
            engine.step()
        outputs.append([r.outputs[0].token_ids for r in reqs])
    assert outputs[0] == outputs[1]
    assert engine.get_metrics()["mean_acceptance_length"] > 1.5
