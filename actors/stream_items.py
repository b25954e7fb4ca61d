"""Plain-data items the verifier streams to the ingress (cheap to pickle across the Serve hop)."""

from __future__ import annotations

from engine.engine import QueueFull
from engine.outputs import RequestOutput


def error_item(e: Exception) -> dict:
    """An error as the ingress should answer it: 503 for a full queue, 400 for bad input; a
    :class:`RequestError`'s ``param`` and ``code`` travel along for the OpenAI error body."""
    status = 503 if isinstance(e, QueueFull) else 400
    return {"type": "error", "status": status, "message": str(e), "finished": True,
            "param": getattr(e, "param", None), "code": getattr(e, "code", None)}


def unavailable_item(message: str) -> dict:
    """The replica cannot serve (shutting down): a 503, which clients may retry elsewhere."""
    return {"type": "error", "status": 503, "message": message, "finished": True}


def step_item(out: RequestOutput, at_s: float) -> dict:
    """What one engine step added to a request, plus its totals when it finished.

    ``at_s`` (monotonic s, when the step emitted it) lets :func:`merge_step_items` keep each
    step's timing once items are merged."""
    choices = []
    for c in out.outputs:
        choices.append({
            "index": c.index,
            "new_text": c.new_text,
            "new_token_ids": list(c.new_token_ids),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "new_logprobs": None if c.logprobs is None else [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top}
                for lp in c.logprobs[len(c.logprobs) - len(c.new_token_ids):]
            ],
            "num_tokens": len(c.token_ids),
        })
    item = {"type": "step", "finished": out.finished, "choices": choices, "at_s": at_s}
    if out.finished:
        stats = out.spec_stats
        m = out.metrics
        item["usage"] = {"prompt_tokens": len(out.prompt_token_ids),
                         "completion_tokens": sum(len(c.token_ids) for c in out.outputs)}
        item["spec"] = stats.as_dict()
        item["queue_time_s"] = (m.first_scheduled_time_s - m.arrival_time_s) if m and m.first_scheduled_time_s else None
    return item


def merge_step_items(items: list[dict]) -> dict:
    """Consecutive step items of one request as one: per choice the texts, token ids and
    logprobs concatenated and the last finish reason and count; the last item's totals.

    Each part's emission time and token count go along as ``steps``, ``[[at_s, tokens], ...]``
    (monotonic s), so the ingress still records every step's inter-token latency (see
    :func:`ship`)."""
    merged = {"type": "step", "finished": items[-1]["finished"], "choices": [], "steps": []}
    by_index: dict[int, dict] = {}
    for item in items:
        merged["steps"].append([item["at_s"], _num_new_tokens(item)])
        for c in item["choices"]:
            into = by_index.get(c["index"])
            if into is None:
                into = by_index[c["index"]] = {**c, "new_token_ids": list(c["new_token_ids"]),
                                               "new_logprobs": None if c["new_logprobs"] is None else list(c["new_logprobs"])}
                merged["choices"].append(into)
                continue
            into["new_text"] += c["new_text"]
            into["new_token_ids"] += c["new_token_ids"]
            if c["new_logprobs"] is not None:
                into["new_logprobs"] = (into["new_logprobs"] or []) + c["new_logprobs"]
            into.update(finish_reason=c["finish_reason"], stop_reason=c["stop_reason"], num_tokens=c["num_tokens"])
    for key in ("usage", "spec", "queue_time_s"):
        if key in items[-1]:
            merged[key] = items[-1][key]
    return merged


def ship(items: list[dict], now_s: float) -> dict:
    """Consecutive step items as the one item that crosses to the ingress, merged when more than
    one, with their emission times as ages (s before ``now_s``: they mean the same on another
    node's clock), ``steps: [[age_s, tokens], ...]``. A lone item keeps its age too: stream
    batching may have held it for up to its interval, and the ingress's ITL must not count that."""
    if len(items) == 1:
        item = items[0]
        item["steps"] = [[item.pop("at_s"), _num_new_tokens(item)]]
    else:
        item = merge_step_items(items)
    item["steps"] = [[now_s - t, n] for t, n in item["steps"]]
    return item


def _num_new_tokens(item: dict) -> int:
    return sum(len(c["new_token_ids"]) for c in item["choices"])
