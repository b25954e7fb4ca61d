"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` over the ingress's tokenizer and chat template.

``/tokenize`` takes ``{"model", "prompt"}`` or ``{"model", "messages", "add_generation_prompt"}``
and answers ``{"count", "max_model_len", "tokens", "token_strs"}``: the token ids the completion
routes would give the engine for that prompt (a conversation rendered by the same chat template).
``/detokenize`` takes ``{"model", "tokens"}`` and answers ``{"prompt"}``. Errors are 400s in
OpenAI's shape (404 for another model's name, as the other routes answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from actors.http_errors import error_response, read_body
from actors.openai_protocol import (
    ChatMessage,
    ProtocolError,
    check_messages,
    conversation,
    decode_request,
    protocol_errors,
    unknown_model,
)
from actors.responses import token_text
from engine.chat_template import ChatTemplate
from engine.loader import encode_text, special_tokens_for

# /tokenize counts prompts up to this many context windows (a client measuring one that is too long).
TOKENIZE_MAX_WINDOWS = 4


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: a ``prompt`` (vLLM's TokenizeCompletionRequest) or ``messages`` (its
    TokenizeChatRequest). ``add_special_tokens`` defaults as vLLM's and the completion routes':
    true for a prompt, false for messages (a chat template writes its own BOS)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False

    def validate(self) -> None:
        """Raises:
            ProtocolError: neither or both of ``prompt`` and ``messages``, or a bad conversation.
        """
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("send either 'prompt' or 'messages'", "prompt" if self.prompt is None else "messages")
        if self.messages is not None:
            check_messages(self.messages)


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None

    def validate(self) -> None:
        """Nothing beyond the types (ids are checked against the vocabulary when decoded)."""


class TokenizerRoutes:
    """The two routes' handling, given what the ingress loaded.

    Args:
        model_name: the served model (another name in a request is a 404).
        tokenizer: a ``tokenizers.Tokenizer``, or None (``skip_tokenizer_init``: every call a 400).
        chat_template: the template ``/v1/chat/completions`` renders conversations with.
        max_model_len: the context window, reported by ``/tokenize``.
        vocab_size: ``/detokenize`` refuses ids outside ``[0, vocab_size)``.
        body_timeout_s: a body not all received in this many seconds is a 408
            (:func:`actors.http_errors.read_body`).

    A prompt longer than the context window is tokenized all the same (``/tokenize`` is how a
    client measures one), up to :data:`TOKENIZE_MAX_WINDOWS` windows: a longer one is a 400
    (``context_length_exceeded``), refused before tokenizing where ``max_chars_per_token``
    (:func:`engine.loader.max_chars_per_token`) bounds it. Without the cap, seven 3.8 MB prompts
    (1.9 million tokens each, 17 MB answers with token strings) held the ingress for 31-37 s and
    every other client with it (an abuse trial, 2026-12-06).
    """

    def __init__(self, model_name: str, tokenizer, chat_template: ChatTemplate, max_model_len: int,
                 vocab_size: int, body_timeout_s: float, max_chars_per_token: int | None = None) -> None:
        self.model_name, self.tokenizer, self.chat_template = model_name, tokenizer, chat_template
        self.max_model_len, self.vocab_size, self.body_timeout_s = max_model_len, vocab_size, body_timeout_s
        self.max_chars_per_token = max_chars_per_token

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, TokenizeRequest, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, DetokenizeRequest, self._detokenize)

    async def _answer(self, request: Request, schema: type, handle: Callable) -> Response:
        """Read, decode and answer (tokenizing off the event loop); ProtocolErrors as OpenAI errors."""
        try:
            req = decode_request(await read_body(request, self.body_timeout_s), schema)
            if req.model is not None and req.model != self.model_name:
                raise unknown_model(req.model, self.model_name)
            if self.tokenizer is None:
                raise ProtocolError(f"{request.url.path} needs a tokenizer and this model was loaded with "
                                    "skip_tokenizer_init")
            return JSONResponse(await asyncio.to_thread(handle, req))
        except ProtocolError as e:
            return error_response(e.status, str(e), e.param, e.code)

    def _tokenize(self, req: TokenizeRequest) -> dict:
        """Raises:
            ProtocolError: the chat template refuses the conversation (param ``messages``).
        """
        text, param = req.prompt, "prompt" if req.messages is None else "messages"
        if req.messages is not None:
            with protocol_errors():
                text = self.chat_template.render(conversation(req.messages), req.add_generation_prompt is not False)
        if self.max_chars_per_token is not None:  # refused before tokenizing where the tokenizer allows
            self._check_count(-(-len(text) // self.max_chars_per_token), param, "at least ")
        ids = encode_text(self.tokenizer, text, special_tokens_for(req.messages is not None, req.add_special_tokens))
        self._check_count(len(ids), param)
        strs = [token_text(self.tokenizer, t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def _check_count(self, num_tokens: int, param: str, qualifier: str = "") -> None:
        """Raises:
            ProtocolError: ``num_tokens`` over :data:`TOKENIZE_MAX_WINDOWS` context windows.
        """
        limit = TOKENIZE_MAX_WINDOWS * self.max_model_len
        if num_tokens > limit:
            raise ProtocolError(f"the prompt has {qualifier}{num_tokens} tokens; /tokenize counts up to "
                                f"{TOKENIZE_MAX_WINDOWS} context windows ({limit} tokens)", param,
                                code="context_length_exceeded")

    def _detokenize(self, req: DetokenizeRequest) -> dict:
        """Raises:
            ProtocolError: an id outside the vocabulary (param ``tokens``).
        """
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ProtocolError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}
