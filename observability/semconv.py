"""Every span name, event name and attribute key specmoe emits, in one place.

Standard keys follow the OpenTelemetry semantic conventions (HTTP, GenAI); they are spelled out
here rather than imported from ``opentelemetry.semconv._incubating`` because that module is
private and renamed between releases. Everything specmoe-specific lives under ``specmoe.``.

Span trees (process in brackets)::

    POST /v1/completions                 [ingress]   kind SERVER, parent = incoming traceparent
      text_completion <model>            [ingress]   gen_ai span; events first_token / finish
        specmoe.engine.step              [verifier]  child of the oldest request in the batch,
                                                     linked to every request it served
          specmoe.draft.propose          [verifier]  kind CLIENT, caller side of the draft call
            specmoe.draft.forward        [draft]     kind SERVER, from the injected carrier
          specmoe.target.forward         [verifier]
            specmoe.moe.dispatch         [verifier]  one per MoE layer
              specmoe.expert.call        [verifier]  one per actor call (CLIENT); straggler flag
                specmoe.expert.compute   [expert]    actor side (SERVER), from the call's carrier
                specmoe.expert.load      [expert]    offload: one expert loaded (demand or prefetch)
          specmoe.verify                 [verifier]  rejection sampling

See ``actors/telemetry.py`` for where each span is made.
"""

from __future__ import annotations

from typing import Final

# --- resource -------------------------------------------------------------------------------
SERVICE_NAME: Final = "specmoe"
RESOURCE_PROCESS_ROLE: Final = "specmoe.process.role"  # "ingress" | "verifier" | "draft" | "expert" | ...

# --- HTTP request span (server side of the OpenAI-compatible API) --------------------------
HTTP_REQUEST_METHOD: Final = "http.request.method"
HTTP_ROUTE: Final = "http.route"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"
URL_PATH: Final = "url.path"
ERROR_TYPE: Final = "error.type"


def http_span_name(method: str, route: str) -> str:
    """HTTP semconv span name: ``"{method} {route}"``, e.g. ``"POST /v1/completions"``."""
    return f"{method} {route}"


# --- GenAI span (one per request) ----------------------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_OPERATION_TEXT_COMPLETION: Final = "text_completion"
GEN_AI_OPERATION_CHAT: Final = "chat"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED: Final = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"  # list[str], one per choice
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"

# Events on the gen_ai span. specmoe-prefixed because the gen_ai.* namespace is owned by the
# semantic conventions, which define no such events.
EVENT_FIRST_TOKEN: Final = "specmoe.first_token"
EVENT_FINISH: Final = "specmoe.finish"
EVENT_TTFT_S: Final = "specmoe.ttft_s"  # attribute of EVENT_FIRST_TOKEN, seconds since arrival
EVENT_FINISH_REASON: Final = "specmoe.finish_reason"  # attribute of EVENT_FINISH


def gen_ai_span_name(operation: str, model: str) -> str:
    """GenAI semconv span name: ``"{gen_ai.operation.name} {gen_ai.request.model}"``."""
    return f"{operation} {model}"


# --- engine step ----------------------------------------------------------------------------
SPAN_ENGINE_STEP: Final = "specmoe.engine.step"
STEP_BATCH_SIZE: Final = "specmoe.step.batch_size"  # sequences in the step
STEP_NUM_PREFILLS: Final = "specmoe.step.num_prefills"
STEP_K: Final = "specmoe.step.k"  # draft length used this step (max over the batch)
STEP_NUM_DRAFTED_TOKENS: Final = "specmoe.step.num_drafted_tokens"
STEP_NUM_ACCEPTED_TOKENS: Final = "specmoe.step.num_accepted_tokens"
STEP_NUM_EMITTED_TOKENS: Final = "specmoe.step.num_emitted_tokens"
# The speculation controller's decision (engine.spec_controller): how k was chosen, what it expected.
STEP_K_POLICY: Final = "specmoe.step.k_policy"  # fixed | warmup | probe | explore | adaptive
STEP_EXPECTED_TOKENS: Final = "specmoe.step.expected_tokens"
STEP_PREDICTED_DURATION_MS: Final = "specmoe.step.predicted_duration_ms"
REQUEST_ID: Final = "specmoe.request.id"  # attribute of a step's link to a request's trace

SPAN_DRAFT_PROPOSE: Final = "specmoe.draft.propose"  # verifier side of the draft call
SPAN_DRAFT_FORWARD: Final = "specmoe.draft.forward"  # draft replica side
SPAN_TARGET_FORWARD: Final = "specmoe.target.forward"
SPAN_VERIFY: Final = "specmoe.verify"

# --- MoE --------------------------------------------------------------------------------------
SPAN_MOE_DISPATCH: Final = "specmoe.moe.dispatch"
MOE_LAYER: Final = "specmoe.moe.layer"
MOE_NUM_TOKENS: Final = "specmoe.moe.num_tokens"  # tokens routed in this layer (before top-k fan-out)
MOE_NUM_EXPERTS_HIT: Final = "specmoe.moe.num_experts_hit"
MOE_NUM_STRAGGLERS: Final = "specmoe.moe.num_stragglers"

SPAN_EXPERT_CALL: Final = "specmoe.expert.call"  # router side, one per (layer, expert) call
SPAN_EXPERT_COMPUTE: Final = "specmoe.expert.compute"  # actor side (optional)
SPAN_EXPERT_LOAD: Final = "specmoe.expert.load"  # actor side, offload: one expert slow tier -> resident
EXPERT_LOAD_PREFETCH: Final = "specmoe.expert.load.prefetch"  # bool: a prefetch (else a demand miss)
EXPERT_ID: Final = "specmoe.expert.id"
EXPERT_REPLICA: Final = "specmoe.expert.replica"  # Ray actor id of the replica that served the call
EXPERT_NUM_TOKENS: Final = "specmoe.expert.num_tokens"
EXPERT_QUEUE_TIME_MS: Final = "specmoe.expert.queue_time_ms"  # round trip minus compute, ms
EXPERT_COMPUTE_TIME_MS: Final = "specmoe.expert.compute_time_ms"  # reported by the actor, ms
EXPERT_STRAGGLER: Final = "specmoe.expert.straggler"  # bool, see observability.stragglers
EXPERT_ATTEMPTS: Final = "specmoe.expert.attempts"  # tries of this group in this dispatch
EXPERT_TRANSPORT: Final = "specmoe.expert.transport"  # compiled_graph | actor_call
EXPERT_ERROR: Final = "specmoe.expert.error"  # why this attempt was abandoned
EXPERT_HEDGES: Final = "specmoe.expert.hedges"  # extra replicas the call was sent to past its deadline
EXPERT_HEDGE_WON: Final = "specmoe.expert.hedge_won"  # bool: the answer came from a hedge
EVENT_EXPERT_HEDGE: Final = "specmoe.expert.hedge"  # event on the call span when a hedge is sent
EVENT_HEDGE_FROM: Final = "specmoe.expert.hedge.from_replica"  # attributes of EVENT_EXPERT_HEDGE
EVENT_HEDGE_TO: Final = "specmoe.expert.hedge.to_replica"
EVENT_HEDGE_WAITED_MS: Final = "specmoe.expert.hedge.waited_ms"  # since the first send, ms


# --- attribute builders (pure; None values are dropped by the span helpers) ------------------
def gen_ai_request_attributes(
    operation: str,
    model: str,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> dict[str, object]:
    """Attributes of the gen_ai span at its start (the request parameters)."""
    return {
        GEN_AI_OPERATION_NAME: operation,
        GEN_AI_PROVIDER_NAME: SERVICE_NAME,
        GEN_AI_REQUEST_MODEL: model,
        GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
        GEN_AI_REQUEST_TEMPERATURE: temperature,
        GEN_AI_REQUEST_TOP_P: top_p,
        GEN_AI_REQUEST_SEED: seed,
    }


def gen_ai_response_attributes(
    *,
    response_id: str | None,
    finish_reasons: list[str],
    input_tokens: int | None,
    output_tokens: int | None,
    response_model: str | None = None,
) -> dict[str, object]:
    """Attributes of the gen_ai span when the request finishes (usage summed over choices)."""
    return {
        GEN_AI_RESPONSE_ID: response_id,
        GEN_AI_RESPONSE_MODEL: response_model,
        GEN_AI_RESPONSE_FINISH_REASONS: list(finish_reasons),
        GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
        GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
    }


def step_attributes(stats) -> dict[str, object]:
    """Step span attributes of one engine step (``engine.observer.StepStats``: batch_size,
    num_prefills, k, num_drafted, num_accepted, num_emitted, and the controller's k_policy,
    expected_tokens and predicted_step_s)."""
    return {
        STEP_BATCH_SIZE: stats.batch_size,
        STEP_NUM_PREFILLS: stats.num_prefills,
        STEP_K: stats.k,
        STEP_NUM_DRAFTED_TOKENS: stats.num_drafted,
        STEP_NUM_ACCEPTED_TOKENS: stats.num_accepted,
        STEP_NUM_EMITTED_TOKENS: stats.num_emitted,
        STEP_K_POLICY: stats.k_policy,
        STEP_EXPECTED_TOKENS: stats.expected_tokens,
        STEP_PREDICTED_DURATION_MS: stats.predicted_step_s * 1e3,
    }
