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


def step_item(out: RequestOutput) -> dict:
    """What one engine step added to a request, plus its totals when it finished."""
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
    item = {"type": "step", "finished": out.finished, "choices": choices}
    if out.finished:
        stats = out.spec_stats
        m = out.metrics
        item["usage"] = {"prompt_tokens": len(out.prompt_token_ids),
                         "completion_tokens": sum(len(c.token_ids) for c in out.outputs)}
        item["spec"] = stats.as_dict()
        item["queue_time_s"] = (m.first_scheduled_time_s - m.arrival_time_s) if m and m.first_scheduled_time_s else None
    return item
