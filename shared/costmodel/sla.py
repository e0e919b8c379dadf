"""Per-request SLA targets (DESIGN §9): k × the request's own isolated TTFT and TPOT on its tenant's device kind.

The isolated latency is the cost model's :meth:`~shared.costmodel.model_cost.ModelCost.isolated_latency`: the
prompt prefilled alone in chunks of the engine's token budget, then batch-1 decode steps. A 1,800-token prompt so
gets a longer TTFT budget than a 200-token one, and a long conversation a longer TPOT budget than a fresh one.
"""
from __future__ import annotations

from typing import Any

from shared.model.config import ModelConfig

DEFAULT_CHUNK = 2048  # the engines' chunked-prefill token budget (SimConfig.max_batched_tokens)
# The reference request of a per-request SLA (the median of the Azure LLM 2023 conv + code traces): its targets
# are the one figure per tenant that admission control and the policies' heuristics read.
REFERENCE_REQUEST = (1046, 90)


def reference_targets(model: ModelConfig, kind: str, slowdown: float) -> tuple[float, float]:
    """(TTFT, TPOT) targets in seconds of the reference request (:data:`REFERENCE_REQUEST`, its prompt shortened
    to fit the model's context)."""
    from shared.costmodel import cost_for
    inp, out = REFERENCE_REQUEST
    out = max(1, min(out, model.max_position_embeddings // 4))
    inp = max(1, min(inp, model.max_position_embeddings - out))
    ttft, tpot = cost_for(model, kind).isolated_latency(inp, out)
    return slowdown * ttft, slowdown * tpot


class RequestTargets:
    """Targets of one tenant's requests: fixed (absolute SLA) or priced per request (``slowdown`` > 0, on the
    SLA's device kind)."""

    __slots__ = ("ttft_s", "tpot_s", "slowdown", "cost", "chunk")

    def __init__(self, sla: Any, model: ModelConfig, chunk: int = DEFAULT_CHUNK) -> None:
        self.ttft_s, self.tpot_s, self.slowdown = sla.ttft_ms / 1e3, sla.tpot_ms / 1e3, sla.slowdown
        self.chunk = chunk
        if self.slowdown > 0:
            from shared.costmodel import cost_for
            self.cost = cost_for(model, sla.kind)
        else:
            self.cost = None

    def __call__(self, input_tokens: int, output_tokens: int) -> tuple[float, float]:
        """(TTFT target, TPOT target) in seconds for a request of these lengths."""
        if self.cost is None:
            return self.ttft_s, self.tpot_s
        ttft, tpot = self.cost.isolated_latency(input_tokens, output_tokens, self.chunk)
        return self.slowdown * ttft, self.slowdown * tpot


def request_targets(sla: Any, model: ModelConfig, input_tokens: int, output_tokens: int,
                    chunk: int = DEFAULT_CHUNK) -> tuple[float, float]:
    """(TTFT, TPOT) targets in seconds of one request (see :class:`RequestTargets`)."""
    return RequestTargets(sla, model, chunk)(input_tokens, output_tokens)
