"""Per-request state inside the simulator."""
from __future__ import annotations

WAITING, RUNNING, DONE, REJECTED, FAILED = 0, 1, 2, 3, 4


class SimRequest:
    """One request's progress: prompt tokens prefilled, output tokens generated, and its timestamps."""

    __slots__ = ("rid", "tenant", "arrival", "input", "output", "prefilled", "generated", "first_token", "finish",
                 "kv_bytes", "status", "engine", "late", "ttft_t", "tpot_t")

    def __init__(self, rid: str, tenant: str, arrival: float, input_tokens: int, output_tokens: int) -> None:
        self.rid, self.tenant, self.arrival = rid, tenant, arrival
        self.input, self.output = max(1, input_tokens), max(1, output_tokens)
        self.prefilled = 0
        self.generated = 0
        self.first_token = -1.0
        self.finish = -1.0
        self.kv_bytes = 0
        self.status = WAITING
        self.engine = None
        self.late = False  # counted as a violation already (only tracked when a run may stop early)
        self.ttft_t = self.tpot_t = float("inf")  # its SLA targets (s), where the run needs them

    def ttft(self) -> float:
        return self.first_token - self.arrival

    def tpot(self) -> float:
        """(E2E − TTFT) / (output − 1); 0 for single-token outputs."""
        return (self.finish - self.first_token) / (self.output - 1) if self.output > 1 else 0.0
