"""Bad checkpoints and configs fail with a clear error naming the culprit."""

import json
import shutil

import numpy as np
import pytest
import torch

from engine.args import EngineArgs
from engine.errors import CheckpointError, ConfigError
from engine.loader import load_model


@pytest.fixture
def ckpt(tiny_checkpoints, tmp_path):
    src, _ = tiny_checkpoints["mixtral"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture_lists_supported(ckpt):
    _edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*MixtralForCausalLM.*Qwen3MoeForCausalLM.*LlamaForCausalLM"):
        load_model(ckpt)


def test_missing_tensor_is_named(ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight.*missing"):
        load_model(ckpt)


def test_shape_mismatch_names_tensor_and_both_shapes(ckpt):
    _edit_config(ckpt, hidden_size=40)
    # Experts load first; the first tensor read with the wrong hidden size is named.
    expected = r"'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight' has shape \(48, 32\), expected \(48, 40\)"
    with pytest.raises(CheckpointError, match=expected):
        load_model(ckpt)


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_hidden_layers": 1}, r"config\.num_hidden_layers: 1, but the checkpoint has tensors of later layers "
                               r"\(e\.g\. 'model\.layers\.1\."),
    ({"num_experts_per_tok": 9}, r"config\.num_experts_per_tok: must be in \[1, config\.num_local_experts = \d+\], got 9"),
    ({"num_experts_per_tok": 0}, r"config\.num_experts_per_tok: must be in \[1, "),
    ({"eos_token_id": 99999}, r"config\.eos_token_id: 99999 is outside the vocabulary \[0, \d+\)"),
    ({"max_position_embeddings": -5}, r"config\.max_position_embeddings: must be >= 2, got -5"),
    ({"vocab_size": 0}, r"config\.vocab_size: must be >= 1, got 0"),
])
def test_a_config_that_does_not_fit_its_checkpoint_is_refused_at_load_naming_the_field(ckpt, changes, message):
    """Each of these loaded before: fewer layers ran a truncated model, a top-k beyond the experts
    failed every request at run time, an EOS outside the vocabulary never stopped a sequence."""
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    _edit_config(ckpt, **changes)
    with pytest.raises(ConfigError, match=message):
        load_model(ckpt)


def test_weights_stored_as_integers_are_refused_naming_the_tensor(ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is stored as torch\.int32, expected bfloat16"):
        load_model(ckpt)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)  # an fp8 export's
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is stored as torch\.float8_e4m3fn"):
        load_model(ckpt)


def test_a_tensor_the_model_does_not_read_is_refused_naming_it(ckpt):
    """Llama's mlp_bias (or any extra weight) was dropped without a word: output unlike transformers'."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.extra.bias"] = torch.zeros(4)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) the MixtralForCausalLM model does not use, e\.g\. "
                                              r"\['model\.layers\.0\.mlp\.extra\.bias'\]"):
        load_model(ckpt)


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_act": "gelu"}, r"config\.hidden_act: 'gelu' is not supported"),
    ({"mlp_bias": True}, r"config\.mlp_bias: MLP biases are not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, r"config\.quantization_config: quantized checkpoints \('fp8'\)"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}, r"config\.layer_types: a sliding window on some"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"config\.rope_scaling\.type: 'dynamic' is not supported"),
])
def test_config_features_the_model_lacks_are_refused_not_ignored(ckpt, changes, message):
    """Each loaded before and computed something else than transformers (a model developer's trial)."""
    _edit_config(ckpt, **changes)
    with pytest.raises(ConfigError, match=message):
        load_model(ckpt)


def test_missing_fields_take_transformers_defaults_and_llama_has_no_sliding_window():
    from engine.config import parse_hf_config

    base = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 32, "max_position_embeddings": 64}
    mixtral = parse_hf_config({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 2,
                               "num_experts_per_tok": 1})
    assert (mixtral.rms_norm_eps, mixtral.rope_theta) == (1e-5, 1e6)  # MixtralConfig's, not 1e-6 / 10000
    llama = parse_hf_config({**base, "architectures": ["LlamaForCausalLM"], "sliding_window": 4})
    assert (llama.rms_norm_eps, llama.rope_theta, llama.sliding_window) == (1e-6, 10000.0, None)
    qwen = parse_hf_config({**base, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
                            "sliding_window": 4, "layer_types": ["sliding_attention"]})
    assert qwen.sliding_window == 4


def test_truncated_safetensors(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ckpt)


def test_corrupt_safetensors_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_model(ckpt)


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_generate_with_a_bad_prompt_leaves_nothing_queued():
    from engine import LLM, SamplingParams
    from tests.engine.bundled import TARGET

    llm = LLM(TARGET)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 6, 7], [8, 9], [10**6]], params)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used == 0
    out = llm.generate([[5, 6, 7]], params)  # the next call runs only its own prompt
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4


def test_a_failed_engine_step_raises_from_offline_generate_and_the_engine_keeps_serving(monkeypatch):
    """The step's exception fails its sequences (finish reason "error"); offline, generate used to
    return their empty outputs as if nothing happened."""
    from engine import LLM, SamplingParams
    from engine.errors import GenerationError
    from tests.engine.bundled import TARGET

    llm = LLM(TARGET)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    expected = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)]

    def broken(*args, **kwargs):
        raise RuntimeError("expert executor exploded")

    with monkeypatch.context() as m:
        m.setattr(llm.engine, "_verify_and_emit", broken)
        with pytest.raises(GenerationError, match=r"prompt\(s\) \[0, 1\].*RuntimeError: expert executor exploded") as err:
            llm.generate([[5, 6, 7], [8, 9]], params)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert [o.outputs[0].finish_reason for o in err.value.outputs] == ["error", "error"]
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used == 0
    assert [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)] == expected


def test_a_request_may_lower_its_draft_length_but_not_raise_it_and_stop_ids_are_in_the_vocabulary():
    from engine import LLM, SamplingParams
    from engine.request_ranges import RequestError
    from tests.engine.bundled import DRAFT, TARGET

    llm = LLM(TARGET, draft_model=DRAFT, num_speculative_tokens=3)
    with pytest.raises(RequestError, match=r"at most 3 .*got 4") as err:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, num_speculative_tokens=4))
    assert err.value.param == "num_speculative_tokens" and not llm.engine.has_unfinished_requests()
    lowered = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, num_speculative_tokens=1))
    assert len(lowered[0].outputs[0].token_ids) == 4
    vocab_size = llm.engine.target.config.vocab_size
    with pytest.raises(RequestError, match=rf"below the vocabulary size {vocab_size}") as err:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop_token_ids=[3, vocab_size]))
    assert err.value.param == "stop_token_ids" and not llm.engine.has_unfinished_requests()
    with pytest.raises(RequestError) as err:  # a long bad list is not echoed back whole
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop_token_ids=list(range(100_000))))
    assert str(err.value).endswith(f"got [{vocab_size}, {vocab_size + 1}, {vocab_size + 2}, {vocab_size + 3}, "
                                   f"{vocab_size + 4}] ...") and len(str(err.value)) < 200



def test_an_n_beyond_the_servers_capacity_is_refused_not_queued_for_a_retry():
    """A new user's n = 5 on a server of 2 running + 2 waiting sequences got 503 "retry later" when
    idle, which no retry could change."""
    from engine import LLM, SamplingParams
    from engine.request_ranges import RequestError
    from engine.scheduler import SchedulerConfig
    from tests.engine.bundled import TARGET

    llm = LLM(TARGET, max_num_seqs=2)
    llm.engine.scheduler.config = SchedulerConfig(max_num_seqs=2, max_waiting=2)  # the server's kind of queue
    with pytest.raises(RequestError, match=r"'n' must be at most 4 .*2 running \+ 2 waiting.*got 5") as err:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, n=5))
    assert err.value.param == "n" and not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, n=4))[0].outputs) == 4

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"speculative_method": "eagle"}, r"^speculative_method: Invalid enum value 'eagle'"),
    ({"speculative_method": "DRAFT", "draft_model": "x"}, r"^speculative_method: Invalid enum value 'DRAFT'"),
    ({"speculative_policy": "greedy"}, r"^speculative_policy: Invalid enum value 'greedy'"),
    ({"num_speculative_tokens": 4.5}, r"^num_speculative_tokens: Expected `int \| null`, got `float`"),
    ({"num_speculative_tokens": "4"}, r"^num_speculative_tokens: Expected `int \| null`, got `str`"),
    # an unused draft model was ignored without a word (a typo'd path too)
    ({"speculative_method": "ngram", "draft_model": "/tmp/none"}, r"^draft_model: speculative_method 'ngram' .*'/tmp/none'"),
])
def test_engine_args_built_by_hand_refuse_wrong_types_and_values_naming_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(**{"model": "checkpoints/stdlib-moe-target", **kwargs})


def test_a_keyboard_interrupt_mid_generate_aborts_that_calls_requests(monkeypatch):
    """A Ctrl-C in a notebook used to leave the call's requests running: the next generate then
    stepped them along with its own (and returned while their KV slots stayed taken)."""
    from engine import LLM, SamplingParams
    from tests.engine.bundled import TARGET

    llm = LLM(TARGET)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:  # after two real steps: the requests are prefilled and decoding
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used == 0
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == expected


def test_a_cuda_device_this_machine_lacks_is_a_config_error_before_any_weight_loads(monkeypatch):
    from engine import LLM
    from tests.engine.bundled import TARGET

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^device: 'cuda', but torch sees no CUDA device"):
        LLM(TARGET, device="cuda")  # was a bare AssertionError from torch's lazy CUDA init
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^device: 'cuda:1', but this machine has 1 CUDA device"):
        LLM(TARGET, device="cuda:1")


def test_a_context_window_beyond_the_models_is_refused_before_the_kv_cache_is_allocated():
    from engine import LLM
    from tests.engine.bundled import TARGET

    # 10**6 positions used to allocate the KV cache until the kernel killed the process.
    for bad in (10**6, 0, -5):  # 0 silently meant the default; -5 was a torch error
        with pytest.raises(ConfigError, match=rf"max_model_len: must be in \[2, 1024\].*got {bad}$"):
            LLM(TARGET, max_model_len=bad)
    assert LLM(TARGET, max_model_len=1024).engine.max_model_len == 1024


# An array used to fail on its own truth value ("ambiguous"), naming nothing.
@pytest.mark.parametrize("prompts", [None, b"def x():", [5, "text"], [True, False], [[1.5, 2]],
                                     np.array([5, 6, 7]), torch.tensor([5, 6, 7])])
def test_prompts_of_the_wrong_type_are_refused_naming_the_prompt(prompts):
    from engine import LLM, SamplingParams
    from engine.request_ranges import RequestError
    from tests.engine.bundled import TARGET

    llm = LLM(TARGET)
    with pytest.raises(RequestError, match="prompt") as err:
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert err.value.param == "prompt" and not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.generate("def f():", "greedy")
    assert len(llm.generate((5, 6, 7), SamplingParams(temperature=0, max_tokens=2))) == 1  # a tuple of ids


def test_an_eagle3_head_given_as_a_draft_model_points_to_its_method():
    from engine import LLM
    from tests.engine.bundled import DRAFT, TARGET

    head = DRAFT.replace("stdlib-draft", "stdlib-eagle3")
    with pytest.raises(ConfigError, match=r"LlamaForCausalLMEagle3.*speculative_method 'eagle3'"):
        LLM(TARGET, draft_model=head)


def test_vllm_prompt_dicts_are_accepted_and_other_dicts_named():
    from engine import LLM, SamplingParams
    from engine.request_ranges import RequestError
    from tests.engine.bundled import TARGET

    llm = LLM(TARGET)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    ids = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    text = llm.generate("def f(x):", params)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids == ids
    both = llm.generate([{"prompt": "def f(x):"}, {"prompt_token_ids": [5, 6, 7]}], params)
    assert [o.outputs[0].token_ids for o in both] == [text, ids]
    with pytest.raises(RequestError, match=r"exactly one of 'prompt' or 'prompt_token_ids', got keys \['ids'\]"):
        llm.generate({"ids": [5]}, params)
    for bad, hint in ((5, False), (np.array([5, 6]), True)):  # the array hint only for arrays
        with pytest.raises(RequestError, match="prompts must be") as err:
            llm.generate(bad, params)
        assert (".tolist()" in str(err.value)) is hint
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_changed_after_construction_are_checked_again_when_added():
    """The struct is mutable: max_tokens = -5 set afterwards used to run and return one token."""
    from engine import LLM, SamplingParams
    from engine.request_ranges import RequestError
    from tests.engine.bundled import TARGET

    llm = LLM(TARGET)
    for name, value, message in (("max_tokens", -5, "'max_tokens'"), ("temperature", "hot", "'temperature'")):
        params = SamplingParams(temperature=0.0, max_tokens=3)
        setattr(params, name, value)
        with pytest.raises(RequestError, match=message) as err:
            llm.generate([[5, 6, 7]], params)
        assert err.value.param == name and not llm.engine.has_unfinished_requests()


def test_offline_refusals_name_the_prompt_and_say_what_would_work(tmp_path):
    """A trial's findings: a batch's bad prompt was not named, an unknown SLO class listed "one of
    []", priority pointed to a server setting LLM() lacked, a config.json path read "does not exist"."""
    from engine import LLM, SamplingParams
    from tests.engine.bundled import TARGET

    llm = LLM(TARGET, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match=r"^prompt\[1\]: the prompt has 70 tokens") as err:
        llm.generate([[5, 6], [7] * 70], params)
    assert (err.value.param, err.value.code) == ("prompt", "context_length_exceeded")
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"'slo_class' names no class: none is configured .*got 'gold'"):
        llm.generate([5, 6], SamplingParams(max_tokens=4, slo_class="gold"))
    with pytest.raises(ValueError, match=r"LLM\(scheduling_policy='priority'\)"):
        llm.generate([5, 6], SamplingParams(max_tokens=4, priority=3))
    ranked = LLM(TARGET, max_model_len=64, scheduling_policy="priority")
    out = ranked.generate([[5, 6], [7, 8]], [SamplingParams(temperature=0.0, max_tokens=4, priority=p) for p in (3, -1)])
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    with pytest.raises(CheckpointError, match="is a file; pass its directory"):
        load_model(f"{TARGET}/config.json")


def test_a_kv_cache_too_large_to_allocate_names_the_settings_that_size_it(monkeypatch):
    """A model with 4M positions and no max_model_len failed with torch's bare allocator error."""
    from engine.kv_cache import KVCache

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 25769803776 bytes")

    monkeypatch.setattr(torch, "zeros", no_memory)
    with pytest.raises(ConfigError, match=r"^max_model_len / max_num_seqs: the KV cache for 16 sequences of 4194304 "
                                          r"tokens needs 24\.0 GiB on cpu .*lower max_model_len"):
        KVCache(num_layers=3, max_seqs=16, max_len=4194304, num_kv_heads=2, head_dim=8)
