"""OpenAI response bodies and SSE chunks built from the verifier's stream items."""

from __future__ import annotations

import functools
import time

import msgspec
from tokenizers.decoders import ByteLevel

_json = msgspec.json.Encoder()


def sse(payload: dict | str) -> bytes:
    body = payload if isinstance(payload, str) else _json.encode(payload).decode()
    return f"data: {body}\n\n".encode()


def error_body(message: str, err_type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def token_text(tokenizer, token_id: int) -> str:
    """One token's text, special tokens included (``<|endoftext|>``, as vLLM's logprobs show them:
    an empty string could not be told from a real empty token, and collides as a key of the
    completions ``top_logprobs``); ``token_id:<id>`` without a tokenizer (vLLM's
    ``return_tokens_as_token_ids`` form). A token holding part of a character decodes to U+FFFD."""
    if tokenizer is None:
        return f"token_id:{int(token_id)}"
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet (GPT-2, Radford et al. 2019; the
    ``tokenizers`` ByteLevel pre-tokenizer's): printable Latin-1 bytes stand for themselves, each
    other byte for the character 256 + its rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_LEVEL = _byte_level_alphabet()


@functools.lru_cache(maxsize=8)
def _added_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's added (special) tokens, whose pieces are their text, not bytes."""
    return frozenset(tokenizer.get_added_tokens_decoder())


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The token's own bytes, which OpenAI's logprobs ``bytes`` carry so that a character split over
    several tokens can be put together again: a byte-level BPE piece mapped back to its bytes;
    otherwise (special tokens, other tokenizers, none) the UTF-8 of :func:`token_text`."""
    token_id = int(token_id)
    if tokenizer is not None and isinstance(getattr(tokenizer, "decoder", None), ByteLevel) \
            and token_id not in _added_token_ids(tokenizer):
        piece = tokenizer.id_to_token(token_id)
        if piece is not None and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
    return token_text(tokenizer, token_id).encode()


def logprob_token(tokenizer, token_id: int) -> str:
    """A token as logprobs name it: its text, or, for a token that is part of a character (its bytes
    are not UTF-8 alone), ``bytes:`` and the bytes escaped (``bytes:\\xe4\\xb8``, OpenAI's form), so
    that different such tokens keep different names (U+FFFD for all of them merged the completions
    ``top_logprobs`` entries keyed by name)."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode()  # the token's text (what the tokenizer decodes it to)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(items: list[dict], tokenizer, initial_offset: int = 0) -> tuple[dict, int]:
    """Legacy completions ``logprobs`` object for the given token logprob items, and the text
    offset after the last of them.

    ``text_offset[j]`` is the character offset of token ``j``'s text in the completion text (vLLM's
    rule: the running sum of the decoded token lengths, from ``initial_offset``, the sum over the
    choice's earlier tokens).
    """
    tokens = [logprob_token(tokenizer, i["token_id"]) for i in items]
    offsets, at = [], initial_offset
    for i in items:
        offsets.append(at)
        at += len(token_text(tokenizer, i["token_id"]))
    return {
        "tokens": tokens,
        "token_logprobs": [i["logprob"] for i in items],
        # The sampled token is always among them, as in OpenAI's legacy API and vLLM (up to
        # logprobs + 1 entries when it is not one of the most likely).
        "top_logprobs": [{**{logprob_token(tokenizer, t): lp for t, lp in i["top"].items()}, tok: i["logprob"]}
                         for i, tok in zip(items, tokens)],
        "text_offset": offsets,
    }, at


def chat_logprobs(items: list[dict], tokenizer) -> dict:
    """Chat ``logprobs.content`` for the given token logprob items."""
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": logprob_token(tokenizer, token_id), "logprob": logprob,
                "bytes": list(token_bytes(tokenizer, token_id))}

    return {"content": [{**entry(i["token_id"], i["logprob"]),
                         "top_logprobs": [entry(t, lp) for t, lp in i["top"].items()]} for i in items]}


class ResponseBuilder:
    """Accumulates a request's stream items into chunks or a final body.

    A completion request with several prompts has one engine request per prompt, each with ``n``
    choices: prompt ``p``'s choice ``j`` is the response's choice ``p * n + j`` (OpenAI's rule), and
    the usage is the sum over the prompts.

    ``tokenizer`` None (``skip_tokenizer_init``): every choice also carries its ``token_ids`` (the
    new ones in a chunk, all of them in the final body), since its text is empty.
    """

    def __init__(self, kind: str, model: str, request_id: str, n: int, tokenizer, want_logprobs: bool,
                 num_prompts: int = 1):
        self.kind, self.model, self.id, self.tokenizer = kind, model, request_id, tokenizer
        self.created = int(time.time())
        self.object = "text_completion" if kind == "completion" else "chat.completion"
        self.n_per_prompt, self.num_prompts = n, num_prompts
        n *= num_prompts
        self.text = [""] * n
        self.finish = [None] * n
        self.stop = [None] * n  # vLLM's stop_reason: the stop string or token id that matched (None: EOS, length)
        self.logprobs: list[list[dict]] = [[] for _ in range(n)]
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.want_logprobs = want_logprobs
        self._usage: dict[int, dict] = {}  # per prompt, once its engine request finished
        self._role_sent = [False] * n  # chat streams announce the role in a chunk of its own, first
        # Where a streamed chunk's text_offset continues: the earlier tokens' text lengths summed, as
        # the final body counts them. Not the text streamed so far, which is shorter while a stop
        # string's partial match holds text back (its tokens are listed already).
        self._next_offset = [0] * n

    def _lp(self, items: list[dict], i: int | None = None) -> dict | None:
        """The logprobs of ``items``; with choice ``i``, a streamed chunk's, whose text offsets
        continue from the choice's earlier chunks."""
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(items, self.tokenizer)
        lp, end = completion_logprobs(items, self.tokenizer, 0 if i is None else self._next_offset[i])
        if i is not None:
            self._next_offset[i] = end
        return lp

    def add(self, item: dict, prompt: int = 0) -> list[dict]:
        """Absorb a step item of prompt ``prompt``'s engine request; return the streaming chunks
        it produces."""
        chunks = []
        for c in item["choices"]:
            i = prompt * self.n_per_prompt + c["index"]
            self.text[i] += c["new_text"]
            self.logprobs[i] += c["new_logprobs"] or []
            self.token_ids[i] += c["new_token_ids"]
            # The engine reports every choice of the request each step, a finished one too (no new
            # tokens, its finish reason again): a stream says a choice finished exactly once.
            finishes = c["finish_reason"] is not None and self.finish[i] is None
            if finishes:
                self.finish[i], self.stop[i] = c["finish_reason"], c["stop_reason"]
            if c["new_text"] or c["new_token_ids"] or finishes:
                if self.kind == "chat" and not self._role_sent[i]:
                    chunks.append(self._role_chunk(i))
                chunks.append(self._chunk(i, c))
        if item.get("usage"):
            self._usage[prompt] = item["usage"]
        return chunks

    @property
    def usage(self) -> dict | None:
        """Token counts summed over the prompts whose engine requests finished (None: none yet)."""
        if not self._usage:
            return None
        prompt = sum(u["prompt_tokens"] for u in self._usage.values())
        completion = sum(u["completion_tokens"] for u in self._usage.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _chunk(self, i: int, c: dict) -> dict:
        lp = self._lp(c["new_logprobs"] or [], i)
        if self.kind == "completion":
            choice = {"index": i, "text": c["new_text"], "logprobs": lp}
            obj = "text_completion"
        else:
            choice = {"index": i, "delta": {"content": c["new_text"]}, "logprobs": lp}
            obj = "chat.completion.chunk"
        choice.update(finish_reason=c["finish_reason"], stop_reason=c["stop_reason"])  # set only at the finish
        if self.tokenizer is None:
            choice["token_ids"] = list(c["new_token_ids"])
        return self._envelope(obj, [choice])

    def _role_chunk(self, i: int) -> dict:
        """A chat choice's first chunk: the role with empty content, as OpenAI and vLLM send it
        (clients that read the role from the first chunk only then see no text there)."""
        self._role_sent[i] = True
        choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None, "stop_reason": None}
        if self.tokenizer is None:
            choice["token_ids"] = []
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._envelope(obj, []), "usage": self.usage}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        """The fields of a chunk or a final body around its choices."""
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def final(self) -> dict:
        choices = []
        for i, text in enumerate(self.text):
            lp = self._lp(self.logprobs[i])
            if self.kind == "completion":
                choices.append({"index": i, "text": text, "logprobs": lp})
            else:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp})
            choices[-1].update(finish_reason=self.finish[i], stop_reason=self.stop[i])
            if self.tokenizer is None:
                choices[-1]["token_ids"] = self.token_ids[i]
        return {**self._envelope(self.object, choices), "usage": self.usage}
