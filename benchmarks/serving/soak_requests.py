"""The request kinds of the soak run (``benchmarks/soak.py``) and how each one is judged.

* ``good``: a greedy completion (streamed or not) of a prompt whose reference text is known; it
  is *lost* when it does not end in a 200 with a complete answer (``[DONE]``, usage), *corrupted*
  when its text or finish reason differs from the reference.
* ``cancel``: a streamed completion the client abandons after a few content chunks (the
  connection is closed mid-stream); the server must abort it and free its KV blocks (checked once
  at the end of the run through ``/metrics``).
* ``bad``: malformed JSON, an out-of-range sampling parameter, an unknown model or a prompt longer
  than the context window; each must get a 4xx in OpenAI's error shape
  (``{"error": {"message", "type", "param", "code"}}``), never a 5xx.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import httpx

from benchmarks.serving.client import COMPLETIONS_PATH, chunk_text, sse_data

BAD_KINDS = ("malformed_json", "out_of_range", "unknown_model", "too_long_prompt")
OUT_OF_RANGE = ({"temperature": -1.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"n": 0})
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Outcome:
    """What one soak request did: ``ok`` is the verdict of its kind's rule; ``problem`` says why not."""

    kind: str  # good | cancel | bad
    detail: str  # stream/whole, the bad sub-kind, chunks read before cancelling
    ok: bool
    problem: str | None = None  # lost: ... | corrupted: ... | bad: ...
    status: int | None = None


@dataclass(frozen=True)
class SoakTarget:
    """The server and what the requests need to know about it."""

    url: str
    model: str
    max_model_len: int
    prompts: list[str]
    references: list[tuple[str, str]]  # (text, finish_reason) per prompt, greedy, ``max_tokens``
    max_tokens: int
    cancel_max_tokens: int = 256


async def good_request(client: httpx.AsyncClient, t: SoakTarget, rng: random.Random) -> Outcome:
    """A greedy completion of a random prompt, compared with its reference."""
    i = rng.randrange(len(t.prompts))
    stream = rng.random() < 0.5
    body = {"model": t.model, "prompt": t.prompts[i], "max_tokens": t.max_tokens, "temperature": 0.0,
            "stream": stream}
    detail = f"{'stream' if stream else 'whole'} prompt {i}"
    try:
        if stream:
            status, got = await _streamed(client, t.url, {**body, "stream_options": {"include_usage": True}})
        else:
            response = await client.post(t.url + COMPLETIONS_PATH, json=body)
            status = response.status_code
            choice = response.json()["choices"][0] if status == 200 else None
            got = (choice["text"], choice["finish_reason"]) if choice else response.text[:300]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Outcome("good", detail, False, f"lost: {type(e).__name__}: {e}")
    if status != 200 or isinstance(got, str):
        return Outcome("good", detail, False, f"lost: HTTP {status}: {got}", status)
    if got != t.references[i]:
        return Outcome("good", detail, False, f"corrupted: got {got!r}, reference {t.references[i]!r}", status)
    return Outcome("good", detail, True, status=status)


async def _streamed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, tuple[str, str] | str]:
    """(status, (text, finish_reason)) of a streamed completion; a str instead of the pair says
    what was wrong with the stream (an error chunk, no usage chunk, no ``[DONE]``)."""
    text, finish, usage = [], None, None
    async with client.stream("POST", url + COMPLETIONS_PATH, json=body) as response:
        if response.status_code != 200:
            return response.status_code, (await response.aread()).decode(errors="replace")[:300]
        async for line in response.aiter_lines():
            data = sse_data(line)
            if not data:
                continue
            if data == "[DONE]":
                if usage is None:
                    return 200, "no usage chunk before [DONE]"
                return 200, ("".join(text), finish)
            chunk = json.loads(data)
            if chunk.get("error"):
                return 200, f"error chunk: {chunk['error']}"
            text.append(chunk_text(chunk))
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return 200, "stream ended without [DONE]"


async def cancel_request(client: httpx.AsyncClient, t: SoakTarget, rng: random.Random) -> Outcome:
    """A long streamed completion abandoned after 1-4 content chunks (the connection is closed)."""
    body = {"model": t.model, "prompt": rng.choice(t.prompts), "max_tokens": t.cancel_max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    after = rng.randint(1, 4)
    read = 0
    try:
        async with client.stream("POST", t.url + COMPLETIONS_PATH, json=body) as response:
            if response.status_code != 200:
                return Outcome("cancel", f"after {after}", False, f"lost: HTTP {response.status_code}",
                               response.status_code)
            async for line in response.aiter_lines():
                data = sse_data(line)
                if data == "[DONE]":
                    return Outcome("cancel", f"after {after}", False, "finished before the cancel", 200)
                if data and chunk_text(json.loads(data)):
                    read += 1
                    if read >= after:
                        break  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, ValueError) as e:
        return Outcome("cancel", f"after {after}", False, f"lost: {type(e).__name__}: {e}")
    return Outcome("cancel", f"after {read}", read >= after, None if read >= after else "stream too short", 200)


def bad_body(kind: str, t: SoakTarget, rng: random.Random) -> bytes:
    """The request body of one bad sub-kind (:data:`BAD_KINDS`)."""
    good = {"model": t.model, "prompt": rng.choice(t.prompts), "max_tokens": 8}
    if kind == "malformed_json":
        return json.dumps(good).encode()[:-7]  # cut inside the object
    if kind == "out_of_range":
        return json.dumps({**good, **rng.choice(OUT_OF_RANGE)}).encode()
    if kind == "unknown_model":
        return json.dumps({**good, "model": "no-such-model"}).encode()
    if kind == "too_long_prompt":  # every " x" is at least one token
        return json.dumps({**good, "prompt": " x" * (2 * t.max_model_len)}).encode()
    raise ValueError(f"unknown bad request kind {kind!r}")


async def bad_request(client: httpx.AsyncClient, t: SoakTarget, rng: random.Random) -> Outcome:
    """One bad request of a random sub-kind; it must get a 4xx in OpenAI's error shape."""
    kind = rng.choice(BAD_KINDS)
    try:
        response = await client.post(t.url + COMPLETIONS_PATH, content=bad_body(kind, t, rng),
                                     headers={"Content-Type": "application/json"})
        payload = response.json()
    except (httpx.HTTPError, ValueError) as e:
        return Outcome("bad", kind, False, f"bad: {type(e).__name__}: {e}")
    status = response.status_code
    error = payload.get("error") if isinstance(payload, dict) else None
    if not 400 <= status < 500:
        return Outcome("bad", kind, False, f"bad: HTTP {status} (want 4xx): {str(payload)[:300]}", status)
    if not isinstance(error, dict) or set(error) != ERROR_KEYS or not isinstance(error["message"], str):
        return Outcome("bad", kind, False, f"bad: not OpenAI's error shape: {str(payload)[:300]}", status)
    return Outcome("bad", kind, True, status=status)


KINDS = {"good": good_request, "cancel": cancel_request, "bad": bad_request}
