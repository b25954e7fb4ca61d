"""One range table: the engine's SamplingParams and the HTTP protocol accept and refuse the same values."""

import msgspec
import pytest

from actors.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    decode_request,
    protocol_errors,
)
from engine import SamplingParams
from engine.chat_template import ChatTemplate
from engine.request_ranges import RANGES, RequestError, check_prompt

# (field, refused value, accepted value at the edge of the range)
EDGES = [
    ("temperature", 2.01, 2.0), ("temperature", -0.1, 0.0), ("top_p", 0.0, 1.0), ("top_p", 1.01, 1e-6),
    ("n", 0, 1), ("n", 9, 8), ("top_k", -2, -1), ("seed", -(2**63) - 1, -(2**63)), ("seed", 2**63, 2**63 - 1), ("max_tokens", 0, 1),
    ("num_speculative_tokens", 17, 16), ("stop_token_ids", [3, -1], [0, 2**31 - 1]),
    ("stop", ["a", "b", "c", "d", "e"], ["a", "b", "c", "d"]), ("stop", [""], ["x"]),
    ("priority", 2**31, -(2**31)),
]


def _http(field: str, value) -> CompletionRequest:
    body = {"model": "m", "prompt": "x", "max_tokens": 4, field: value}
    return decode_request(msgspec.json.encode(body), CompletionRequest)


@pytest.mark.parametrize(("field", "bad", "good"), EDGES)
def test_engine_and_http_share_each_bound(field, bad, good):
    with pytest.raises(RequestError) as engine_err:
        SamplingParams(**{field: bad})
    with pytest.raises(ProtocolError) as http_err:
        _http(field, bad)
    assert engine_err.value.param == http_err.value.param == field
    assert str(engine_err.value) == str(http_err.value)  # the same rule, word for word
    assert http_err.value.status == 400
    assert getattr(SamplingParams(**{field: good}), field) == good
    assert getattr(_http(field, good), field) == good


def test_every_table_entry_is_enforced_by_the_engine_or_the_protocol():
    assert set(RANGES) == {"n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs",
                           "num_speculative_tokens", "stop_token_ids", "priority"}
    with pytest.raises(RequestError, match=r"'logprobs' must be in \[0, 5\], got 6"):
        SamplingParams(logprobs=6)
    with pytest.raises(ProtocolError, match=r"'logprobs' must be in \[0, 5\], got 6"):
        _http("logprobs", 6)


@pytest.mark.parametrize(("ids", "max_tokens", "param", "code"), [
    ([], 4, "prompt", None), ([5, 99], 4, "prompt", None), ([1] * 16, None, "prompt", "context_length_exceeded"),
    ([1] * 10, 7, "max_tokens", "context_length_exceeded"),
])
def test_prompt_checks_name_their_parameter(ids, max_tokens, param, code):
    with pytest.raises(RequestError) as err:
        check_prompt(ids, max_tokens, vocab_size=64, max_model_len=16)
    assert (err.value.param, err.value.code) == (param, code)
    check_prompt([1] * 10, 6, vocab_size=64, max_model_len=16)  # exactly fills the window: fine


@pytest.mark.parametrize(("prompt", "param", "message"), [
    ([], "prompt", "must not be empty"), ([1.5, 2], "prompt", "token ids must be integers"),
    ([None], "prompt[0]", "must be a string or a list of token ids"),
    ([{}], "prompt[0]", "must be a string or a list of token ids"),
    ([[]], "prompt[0]", "must not be empty"), ([""], "prompt[0]", "must not be empty"),
    (["a", 5], "prompt[1]", "must be a string or a list of token ids"),
    (["a", "b", [1.5]], "prompt[2]", "token ids must be integers"), ([[1, 2], [3], []], "prompt[2]", "must not be empty"),
    # Every element fine on its own, but strings and token-id lists in one batch (vLLM refuses it too).
    (["a", [4, 5]], "prompt", "a list of strings or a list of token-id lists, not a mix"),
    ([[4, 5], "a"], "prompt", "a list of strings or a list of token-id lists, not a mix"),
])
def test_a_bad_prompt_of_a_batch_is_named_by_its_position(prompt, param, message):
    # A list that is not token ids is a batch: each element a string or a list of token ids.
    with pytest.raises(ProtocolError, match=message) as err:
        decode_request(msgspec.json.encode({"model": "m", "prompt": prompt}), CompletionRequest)
    assert err.value.param == param and str(err.value).startswith(f"'{param}' ")


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("x", ["x"]), ([1, 2], [[1, 2]]), (["a"], ["a"]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]),
    ([[4, 5]], [[4, 5]]),
])
def test_a_flat_list_of_ints_is_one_prompt_and_any_other_list_a_batch(prompt, prompts):
    req = decode_request(msgspec.json.encode({"model": "m", "prompt": prompt}), CompletionRequest)
    assert req.prompts() == prompts
    assert req.is_batch is (prompt not in ("x", [1, 2]))  # a batch of one too: its errors name prompt[0]


def test_nesting_too_deep_for_the_decoder_is_a_400():
    body = b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(ProtocolError, match="nested too deeply") as err:
        decode_request(body, CompletionRequest)
    assert err.value.status == 400


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", None), ("temperature", "0.5"), ("max_tokens", "16"), ("max_tokens", 3.7), ("n", 2.0),
    ("n", True), ("top_k", 1.5), ("seed", 1.5), ("stop_token_ids", 5), ("stop_token_ids", ["a"]),
    ("logprobs", True), ("logprobs", 2.5), ("slo_class", 5), ("ignore_eos", "no"), ("stop", [1]),
    ("priority", "high"), ("num_speculative_tokens", 4.5), ("include_stop_str_in_output", "yes"),
])
def test_a_wrong_type_is_refused_at_construction_naming_the_field(field, value):
    # Built by hand (not decoded), a wrong type used to reach a step and fail the step's whole batch.
    with pytest.raises(RequestError, match=rf"^'{field}': ") as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_vllms_conveniences_for_stop_and_numbers():
    assert SamplingParams(stop="abc").stop == ["abc"]  # one string, not three characters
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(temperature=0).temperature == 0.0 and isinstance(SamplingParams(top_p=1).top_p, float)


def test_stream_options_without_stream_and_a_message_without_content_are_400s():
    body = {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}
    with pytest.raises(ProtocolError, match="only allowed with 'stream': true") as e:
        decode_request(msgspec.json.encode(body), CompletionRequest)
    assert e.value.param == "stream_options"
    assert decode_request(msgspec.json.encode({**body, "stream": True}), CompletionRequest).include_usage
    for message in ({"role": "user"}, {"role": "user", "content": None}, {"role": "system", "content": None}):
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}, message]}
        with pytest.raises(ProtocolError, match=r"messages\[1\] \(\w+\) has no 'content'") as e:
            decode_request(msgspec.json.encode(chat), ChatCompletionRequest)
        assert e.value.param == "messages[1].content"
    # An assistant turn may carry no content (OpenAI: one that made tool calls).
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    assert len(decode_request(msgspec.json.encode(ok), ChatCompletionRequest).messages) == 2


@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
def test_null_means_the_default_for_every_optional_field(schema):
    # OpenAI's schema marks these nullable and clients send null for "not set".
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "n": None, "stream": None, "ignore_eos": None, "priority": None, "echo": None, "logprobs": None}
    req = decode_request(msgspec.json.encode(body), schema)
    assert (req.n, req.stream, req.ignore_eos, req.priority) == (1, False, False, 0)
    assert req.sampling_params(3, None).n == 1
    if schema is ChatCompletionRequest:
        assert req.logprobs is False and req.num_logprobs is None


@pytest.mark.parametrize(("field", "value"), [("user", 123), ("include_stop_str_in_output", "yes")])
@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
def test_a_known_field_of_the_wrong_type_is_a_400_naming_it(schema, field, value):
    # Known fields are typed even where unused (OpenAI's 'user'), so a wrong type is not silently accepted.
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with pytest.raises(ProtocolError, match=f"\\$.{field}") as err:
        decode_request(msgspec.json.encode({**body, field: value}), schema)
    assert (err.value.param, err.value.status) == (field, 400)
    ok = decode_request(msgspec.json.encode({**body, "user": "u-1", "include_stop_str_in_output": True}), schema)
    assert ok.sampling_params(3, None).include_stop_str_in_output is True


@pytest.mark.parametrize(("field", "no_op", "refused"), [
    ("tools", [], [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "none", "auto"),
    ("response_format", {"type": "text"}, {"type": "json_object"}), ("logit_bias", {}, {"5": 10}),
    ("suffix", "", "end"), ("echo", False, True), ("presence_penalty", 0.0, 0.5),
    ("repetition_penalty", 1.0, 1.2), ("min_p", 0, 0.1), ("min_tokens", 0, 3), ("use_beam_search", False, True),
    ("prompt_logprobs", None, 1), ("guided_json", None, {"type": "object"}),
    # vLLM fields a new user found answered 200 with them ignored:
    ("structured_outputs", None, {"regex": "a+"}), ("allowed_token_ids", None, [5]), ("bad_words", [], ["def"]),
    ("truncate_prompt_tokens", None, 1), ("skip_special_tokens", True, False),
    ("spaces_between_special_tokens", True, False), ("logits_processors", [], ["m.f"]),
    ("return_tokens_as_token_ids", False, True),
])
@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
def test_an_unsupported_parameter_is_refused_by_name_unless_it_asks_for_nothing(schema, field, no_op, refused):
    # Silently ignoring a value that changes the output would answer a different question.
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    decode_request(msgspec.json.encode({**body, field: no_op}), schema)
    with pytest.raises(ProtocolError, match=f"'{field}' is not supported by this server") as err:
        decode_request(msgspec.json.encode({**body, field: refused}), schema)
    assert (err.value.param, err.value.status) == (field, 400)


@pytest.mark.parametrize(("tools", "choice"), [("tools", "tool_choice"), ("functions", "function_call")])
def test_tool_definitions_are_accepted_only_where_the_choice_turns_them_off(tools, choice):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], tools: [{"type": "function"}]}
    req = decode_request(msgspec.json.encode({**body, choice: "none"}), ChatCompletionRequest)
    assert getattr(req, choice) == "none"
    for refused in ({}, {choice: "auto"}):  # OpenAI's default with tools is "auto": tools would be called
        with pytest.raises(ProtocolError, match=f"'{tools}' is not supported") as err:
            decode_request(msgspec.json.encode({**body, **refused}), ChatCompletionRequest)
        assert err.value.param == tools and f"unless '{choice}' is \"none\"" in str(err.value)


def test_the_model_field_may_be_left_out():
    assert decode_request(b'{"prompt": "x"}', CompletionRequest).model is None


@pytest.mark.parametrize(("field", "no_op", "refused"), [
    ("chat_template", None, "{{ messages }}"), ("chat_template_kwargs", {}, {"enable_thinking": True}),
    ("add_generation_prompt", True, False), ("continue_final_message", False, True), ("documents", None, []),
    # OpenAI's audio output and web search were accepted and silently ignored (text came back).
    ("modalities", ["text"], ["text", "audio"]), ("audio", None, {"voice": "alloy", "format": "wav"}),
    ("web_search_options", None, {}),
])
def test_vllm_chat_fields_are_refused_unless_they_ask_for_nothing(field, no_op, refused):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    decode_request(msgspec.json.encode({**body, field: no_op}), ChatCompletionRequest)
    with pytest.raises(ProtocolError, match=f"'{field}' is not supported by this server") as err:
        decode_request(msgspec.json.encode({**body, field: refused}), ChatCompletionRequest)
    assert (err.value.param, err.value.status) == (field, 400)


def test_continuous_usage_stats_is_refused():
    body = {"model": "m", "prompt": "x", "stream": True}
    ok = decode_request(msgspec.json.encode({**body, "stream_options": {"continuous_usage_stats": False}}),
                        CompletionRequest)
    assert ok.stream_options.continuous_usage_stats is False
    with pytest.raises(ProtocolError, match="continuous_usage_stats' is not supported") as err:
        decode_request(msgspec.json.encode({**body, "stream_options": {"continuous_usage_stats": True}}),
                       CompletionRequest)
    assert err.value.param == "stream_options"

@pytest.mark.parametrize(("body", "schema", "param"), [
    ({"model": 5, "prompt": "x"}, CompletionRequest, "model"), ({"model": "m"}, CompletionRequest, "prompt"),
    ({"model": "m"}, ChatCompletionRequest, "messages"),
    # The element of a list, not only the list (a missing field named at its path too).
    ({"model": "m", "messages": [{"content": "hi"}]}, ChatCompletionRequest, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "wizard", "content": "c"}]}, ChatCompletionRequest, "messages[2].role"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, ChatCompletionRequest, "messages[0].content[0]"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": 1}}, CompletionRequest,
     "stream_options.include_usage"),
])
def test_a_missing_or_mistyped_field_is_named_in_param(body, schema, param):
    with pytest.raises(ProtocolError) as err:
        decode_request(msgspec.json.encode(body), schema)
    assert err.value.param == param


@pytest.mark.parametrize(("part", "message"), [
    ({"type": "image_url", "image_url": {"url": "x"}}, "only text content parts are supported, got type 'image_url'"),
    ({"type": "text"}, "a text content part needs a string 'text'"),  # was "only text parts": it is one
    ({"type": "text", "text": 5}, "a text content part needs a string 'text'"),
])
def test_a_bad_content_part_says_what_is_wrong_with_it(part, message):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
    req = decode_request(msgspec.json.encode(body), ChatCompletionRequest)
    with pytest.raises(ProtocolError, match=rf"^messages\[0\]\.content\[1\]: {message}") as err:
        with protocol_errors():  # as the ingress renders it
            ChatTemplate(None).render(req.conversation())
    assert err.value.param == "messages[0].content[1]"
