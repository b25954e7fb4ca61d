"""Offline batch API in vLLM's shape: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and
``LLM.chat(conversations, ...)``."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from engine.args import EngineArgs
from engine.chat_template import ChatTemplate
from engine.config import context_window
from engine.engine import LLMEngine
from engine.errors import GenerationError
from engine.loader import encode_text, load_model, special_tokens_for
from engine.outputs import RequestOutput
from engine.request_ranges import RequestError, check_without_tokenizer, is_token_ids
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig


def build_engine(args: EngineArgs) -> LLMEngine:
    """Load the target (experts in-process) and the drafter ``args`` names."""
    args.resolve_auto_dtype()
    target = load_model(args.model, args.dtype, args.device, skip_tokenizer_init=args.skip_tokenizer_init,
                        compile=args.compile)
    max_len = context_window(args.max_model_len, target.config.max_position_embeddings)
    drafter = args.build_drafter(target, max_len)
    return LLMEngine(target, drafter, args.num_speculative_tokens, args.scheduler, max_len,
                     speculative_policy=args.speculative_policy)


class LLM:
    """Generate for many prompts at once through the continuous-batching speculative engine.

    Args:
        model: target checkpoint directory.
        draft_model, speculative_method, num_speculative_tokens, speculative_policy,
            pipelined_drafting, dtype, device, max_model_len, compile: see :class:`engine.args.EngineArgs`.
        max_num_seqs, max_num_batched_tokens, spec_disable_batch_size, enable_chunked_prefill,
            scheduling_policy: scheduler settings (:class:`engine.scheduler.SchedulerConfig`;
            ``scheduling_policy="priority"`` makes ``SamplingParams.priority`` order the queue, as vLLM's).
        skip_tokenizer_init: load no tokenizer; ``generate`` then takes token-id prompts only and
            returns token ids (``CompletionOutput.token_ids``) with empty text.

    Example:
        >>> llm = LLM(model="checkpoints/stdlib-moe-target", draft_model="checkpoints/stdlib-draft")
        >>> out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=16))
        >>> out[0].outputs[0].text
    """

    def __init__(
        self,
        model: str,
        draft_model: str | None = None,
        speculative_method: str | None = None,
        num_speculative_tokens: int | None = None,
        speculative_policy: str = "adaptive",
        pipelined_drafting: bool = False,
        dtype: str = "float32",
        device: str = "cpu",
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 4096,
        spec_disable_batch_size: int = 0,
        enable_chunked_prefill: bool = True,
        scheduling_policy: str = "fcfs",
        skip_tokenizer_init: bool = False,
        compile: bool = False,
    ) -> None:
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_waiting=1 << 20, spec_disable_batch_size=spec_disable_batch_size,
                                enable_chunked_prefill=enable_chunked_prefill, scheduling_policy=scheduling_policy)
        self.args = EngineArgs(model=model, draft_model=draft_model, speculative_method=speculative_method,
                               num_speculative_tokens=num_speculative_tokens,
                               speculative_policy=speculative_policy, pipelined_drafting=pipelined_drafting,
                               dtype=dtype, device=device,
                               max_model_len=max_model_len, skip_tokenizer_init=skip_tokenizer_init,
                               scheduler=sched, compile=compile)
        self.engine = build_engine(self.args)
        self.tokenizer = self.engine.target.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Args:
            prompts: a string, a list of token ids, vLLM's ``{"prompt": str}`` or
                ``{"prompt_token_ids": [int]}``, or a list of those.
            sampling_params: one for all prompts or one per prompt (default: SamplingParams()).

        Raises:
            ValueError: bad prompt or parameters (see :meth:`LLMEngine.add_request`); the prompts of
                this call queued before the bad one are withdrawn, so nothing of it runs later.
                Likewise, a KeyboardInterrupt mid-run aborts this call's requests before it propagates.
            GenerationError: an engine step failed for some of the prompts (finish reason
                ``"error"``), chained from the step's exception; its ``outputs`` are every output.
        """
        return self._generate(prompts, sampling_params, use_tqdm, special_tokens_for(chat=False))

    def _generate(self, prompts, sampling_params, use_tqdm: bool, add_special_tokens: bool) -> list[RequestOutput]:
        """:meth:`generate`, text prompts encoded with or without the tokenizer's special tokens."""
        if isinstance(prompts, dict):
            prompts = [prompts]
        if not isinstance(prompts, (str, list, tuple)):  # an array's truth value would be the error
            hint = " (an array: pass .tolist())" if hasattr(prompts, "tolist") else ""
            raise RequestError(f"prompts must be a string, a list of token ids, a prompt dict or a list of "
                               f"those, got {type(prompts).__name__}{hint}", "prompt")
        if isinstance(prompts, str) or (prompts and is_token_ids(prompts)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        requests = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                requests.append(self._add(prompt, p, i if len(prompts) > 1 else None, add_special_tokens))
            self._run(requests, use_tqdm)
        except BaseException:  # bad input, or Ctrl-C mid-run: nothing of this call stays queued or running
            for r in requests:
                self.engine.abort_request(r.request_id)
            raise
        failed = [i for i, r in enumerate(requests) if any(c.finish_reason == "error" for c in r.outputs)]
        if failed:  # the serving engine fails such requests alone; an offline caller must not get "" silently
            cause = self.engine.last_step_error
            raise GenerationError(f"generation failed for prompt(s) {failed}: the engine step raised "
                                  f"{type(cause).__name__}: {cause}", requests) from cause
        return requests

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, as vLLM's ``LLM.chat``: each is rendered with the
        target's chat template (:class:`engine.chat_template.ChatTemplate`; the plain template when
        the checkpoint has none), exactly as ``/v1/chat/completions`` renders it, then generated.

        Args:
            messages: one conversation ``[{"role": str, "content": str | [text parts]}, ...]`` or a
                list of them.
            sampling_params: one for all conversations or one per conversation.
            chat_template: jinja2 source used instead of the checkpoint's.
            add_generation_prompt: end each prompt with the assistant's turn opening.
            chat_template_kwargs: further template variables.

        Returns:
            one :class:`RequestOutput` per conversation, in order (``prompt`` is the rendered text).

        Raises:
            RequestError: a malformed conversation, a template's refusal, or no tokenizer
                (``skip_tokenizer_init``); otherwise as :meth:`generate`.
        """
        if self.tokenizer is None:
            check_without_tokenizer(False, [], chat=True)
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if not all(isinstance(c, (list, tuple)) for c in conversations):
            raise RequestError("messages must be a conversation (a list of message dicts) or a list of "
                               "conversations", "messages")
        template = ChatTemplate.of(self.engine.target.chat_template, chat_template)
        prompts = [template.render(c, add_generation_prompt, **(chat_template_kwargs or {})) for c in conversations]
        return self._generate(prompts, sampling_params, use_tqdm, special_tokens_for(chat=True))

    def _add(self, prompt: object, params: SamplingParams, index: int | None = None,
             add_special_tokens: bool = True) -> RequestOutput:
        """Queue one prompt; a RequestError names the prompt's ``index`` in a batch (as the HTTP
        path's ``prompt[i]: ``)."""
        try:
            return self._add_one(prompt, params, add_special_tokens)
        except RequestError as e:
            if index is None:
                raise
            raise RequestError(f"prompt[{index}]: {e}", e.param, e.code) from e

    def _add_one(self, prompt: object, params: SamplingParams, add_special_tokens: bool) -> RequestOutput:
        prompt = _unwrap_prompt_dict(prompt)
        text = prompt if isinstance(prompt, str) else None
        if text is None and not is_token_ids(prompt):
            raise RequestError(f"each prompt must be a string or a list of token ids (ints), got "
                               f"{prompt!r:.60}", "prompt")
        if self.tokenizer is None:
            check_without_tokenizer(text is not None, params.stop)
        ids = encode_text(self.tokenizer, prompt, add_special_tokens) if text is not None else list(prompt)
        return self.engine.add_request(f"offline-{next(self._ids)}", ids, params, prompt=text)

    def _run(self, requests: list[RequestOutput], use_tqdm: bool) -> None:
        """Step the engine until it has nothing left (other callers' requests included)."""
        with tqdm(total=len(requests), disable=not use_tqdm, desc="generate") as bar:
            done = 0
            while self.engine.has_unfinished_requests():
                self.engine.step()
                now = sum(r.finished for r in requests)
                bar.update(now - done)
                done = now

    def get_tokenizer(self):
        """The target's ``tokenizers.Tokenizer`` (vLLM's ``LLM.get_tokenizer``); None with
        ``skip_tokenizer_init``."""
        return self.tokenizer

    def get_metrics(self) -> dict:
        """Engine totals (see :meth:`LLMEngine.get_metrics`)."""
        return self.engine.get_metrics()


def _unwrap_prompt_dict(prompt: object) -> object:
    """vLLM's prompt dicts: ``{"prompt": str}`` (TextPrompt) or ``{"prompt_token_ids": [int]}``
    (TokensPrompt) -> the string or the ids; anything else unchanged (checked by the caller)."""
    if not isinstance(prompt, dict):
        return prompt
    if prompt.keys() in ({"prompt"}, {"prompt_token_ids"}):
        return next(iter(prompt.values()))
    raise RequestError(f"a prompt dict takes exactly one of 'prompt' or 'prompt_token_ids', got keys "
                       f"{sorted(prompt)}", "prompt")
