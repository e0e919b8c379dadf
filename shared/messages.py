"""Every stream payload and every stream/group name, in one place.

Payloads are msgspec Structs (frozen, keyword-only, tagged by type) encoded as MessagePack. One decoder per stream
decodes the union of that stream's message types; anything else is a poison entry for the dead-letter stream.
Times are ``*_ts`` (epoch seconds); durations carry their unit. Request-scoped messages carry ``tenant`` and
``request_id``. High-rate ``TokenChunk`` fields are only ever appended, with defaults.
"""
from __future__ import annotations

from typing import Union

import msgspec


class Msg(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of every stream payload; ``msg_id`` makes handling idempotent."""

    msg_id: str


# ---------------------------------------------------------------- gateway -> scheduler (requests stream)
class InferenceRequest(Msg, frozen=True, kw_only=True):
    request_id: str
    tenant: str
    gateway: str  # gateway id: tokens go to tokens_stream(prefix, gateway)
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False
    arrival_ts: float = 0.0
    deadline_ts: float = 0.0  # 0 = none; the scheduler drops it (with an error) if still queued past this
    top_k: int = 0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; k: the sampled token's and the k most likely tokens' logprobs
    stop_token_ids: list[int] = []


class CancelRequest(Msg, frozen=True, kw_only=True):
    request_id: str
    tenant: str
    reason: str = "client_disconnected"


# ---------------------------------------------------------------- scheduler -> worker (worker:{device})
class AssignRequest(Msg, frozen=True, kw_only=True):
    """The scheduler placed ``request`` on this device; KV for it is already reserved in the GMG."""

    request: InferenceRequest
    device: str
    kv_blocks: int
    attempt: int = 1


class CancelAssigned(Msg, frozen=True, kw_only=True):
    request_id: str
    tenant: str
    reason: str = "client_disconnected"


class LeaseGranted(Msg, frozen=True, kw_only=True):
    """Sent to both the driver (home) and the guest worker: ``tenant`` may run ``segments`` on ``guest_device``
    until ``end_ts``, taking at most ``share`` of the guest's time while its own tenant has work. The guest stages
    missing segment weights itself (from the tenant's checkpoint or seed); until it is ready, and whenever a
    remote segment fails or times out, the driver runs the segment locally."""

    lease_id: str
    tenant: str
    home_device: str
    guest_device: str
    segments: list[str]
    start_ts: float
    end_ts: float
    share: float = 1.0
    memory_bytes: int = 0
    mode: str = "segments"
    # sequences mode: the guest hands each sequence to a home device of the tenant once its prompt is prefilled
    # (its KV moves over the link and it decodes in the home's batch); kept on the guest when the home refuses
    handback: bool = False


class HandOff(Msg, frozen=True, kw_only=True):
    """Guest lane -> a home worker of the request's tenant: continue ``request`` here (docs/guest-execution.md,
    "Lane hand-off"). The sequence's KV is fetched from the guest's segment server (``request_id`` and ``token``)
    on real backends; the rest of its state rides here. The home answers with :class:`HandOffReply`; the request's
    journey hash changes owner only if its ``handoff`` field still holds ``token`` (the guest gives up by clearing
    it), so exactly one worker continues the request."""

    request: InferenceRequest
    from_device: str
    token: str
    kv_blocks: int  # the guest's reservation (the home sizes its own from the prompt and max_tokens)
    seq: int  # next token chunk number
    started_ts: float
    first_token_ts: float
    completion_tokens: int
    output: list[int]
    computed: int
    pending: str = ""
    generator_state: bytes = b""
    detok: list = []


class HandOffReply(Msg, frozen=True, kw_only=True):
    """Home -> guest: the hand-off of ``request_id`` committed (``ok``) or was refused (``reason``)."""

    request_id: str
    token: str
    ok: bool
    reason: str = ""


class LeaseRevoked(Msg, frozen=True, kw_only=True):
    lease_id: str
    tenant: str
    home_device: str
    guest_device: str
    reason: str = ""


# ---------------------------------------------------------------- workers -> gateway (tokens:{gateway})
class TokenChunk(Msg, frozen=True, kw_only=True):
    request_id: str
    tenant: str
    seq: int  # 0, 1, 2 ... per request; the gateway drops duplicates and detects gaps
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # stop | length | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    device: str = ""
    # per token of token_ids when the request asked for logprobs: (logprob, [(token id, logprob), ...])
    logprobs: list[tuple[float, list[tuple[int, float]]]] = []


class RequestError(Msg, frozen=True, kw_only=True):
    """Terminal error for a request. ``status`` is the HTTP status the gateway should use."""

    request_id: str
    tenant: str
    status: int
    code: str  # e.g. worker_failed, deadline_exceeded, overloaded, internal_error
    message: str
    retryable: bool = False


# ---------------------------------------------------------------- workers -> everyone (events stream)
class SegmentStat(msgspec.Struct, frozen=True, array_like=True):
    """Measured time of one segment name over one (tokens-bucket) in a report window."""

    segment: str
    tokens_bucket: int  # batch tokens rounded up to a power of two
    count: int
    total_ms: float
    sumsq_ms: float = 0.0
    kv_tokens: int = 0  # mean KV positions attended (attention segments), 0 otherwise


class WorkerHeartbeat(Msg, frozen=True, kw_only=True):
    device: str
    worker_id: str  # process instance id (changes on restart)
    backend: str
    home_tenant: str
    ts: float
    state: str = "ready"  # starting | ready | draining
    capacity_bytes: int = 0
    weight_bytes: int = 0
    kv_used_bytes: int = 0
    kv_total_bytes: int = 0
    running: int = 0
    queued: int = 0
    # home prefill backlog: prompt tokens not yet through prefill (waiting + partly prefilled sequences), and the
    # gateway arrival time of the oldest of those requests (0 when none)
    queued_prefill_tokens: int = 0
    prefill_oldest_ts: float = 0.0
    busy_ratio: float = 0.0  # since the previous heartbeat
    # guest lanes ("sequences" leases): (tenant, outstanding, queued prompt tokens, accepting)
    guest_lanes: list[tuple[str, int, int, bool]] = []
    guest_share: float = 0.0  # share of this device's time the lanes get now while the home tenant has work (0
    #   while it has prompts to prefill; else its TPOT slack within the leases' shares: shared/guest_share.py)


class StepReport(Msg, frozen=True, kw_only=True):
    """Aggregated execution of one device over a short window (not one message per step)."""

    device: str
    tenant: str
    window_start_ts: float
    window_end_ts: float
    steps: int
    busy_ms: float
    segments: list[SegmentStat] = []
    busy_intervals: list[tuple[float, float]] = []  # (start_ts, end_ts) of iterations, merged when adjacent
    guest_intervals: list[tuple[str, float, float]] = []  # (tenant, start_ts, end_ts) of guest-lane iterations
    kv_used_bytes: int = 0


class RequestStarted(Msg, frozen=True, kw_only=True):
    request_id: str
    tenant: str
    device: str
    ts: float


class RequestFinished(Msg, frozen=True, kw_only=True):
    """A request left the device: finished, cancelled or failed. Its KV is free on the device."""

    request_id: str
    tenant: str
    device: str
    outcome: str  # stop | length | cancelled | failed
    prompt_tokens: int
    completion_tokens: int
    kv_blocks: int
    ts: float
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0


class RequestMoved(Msg, frozen=True, kw_only=True):
    """A running request moved from ``from_device`` to ``device`` (a guest lane's hand-off): cancels go there,
    and its KV reservation on ``from_device`` is already released."""

    request_id: str
    tenant: str
    from_device: str
    device: str
    worker_id: str
    kv_blocks: int
    ts: float


class DeviceDown(Msg, frozen=True, kw_only=True):
    device: str
    worker_id: str
    reason: str
    ts: float


# ---------------------------------------------------------------- unions per stream
RequestsMsg = Union[InferenceRequest, CancelRequest]
WorkerMsg = Union[AssignRequest, CancelAssigned, LeaseGranted, LeaseRevoked, HandOff, HandOffReply]
TokensMsg = Union[TokenChunk, RequestError]
EventsMsg = Union[WorkerHeartbeat, StepReport, RequestStarted, RequestFinished, RequestMoved, DeviceDown]


# ---------------------------------------------------------------- stream and group names
def requests_stream(prefix: str) -> str:
    return f"{prefix}requests"


def worker_stream(prefix: str, device: str) -> str:
    return f"{prefix}worker:{device}"


def tokens_stream(prefix: str, gateway: str) -> str:
    return f"{prefix}tokens:{gateway}"


def events_stream(prefix: str) -> str:
    return f"{prefix}events"


def dead_stream(prefix: str) -> str:
    return f"{prefix}dead"


GROUP_SCHEDULER = "scheduler"
GROUP_WORKER = "worker"
GROUP_GMG = "gmg"
GROUP_SIMULATOR = "simulator"


# ---------------------------------------------------------------- scheduler <-> simulator (what-if RPC)
class WhatIfCandidate(msgspec.Struct, frozen=True, kw_only=True):
    """One candidate placement to evaluate against the simulator's twin.

    ``lease``: run ``segments`` (``mlp[l]`` names) of ``tenant``'s batch on guest ``device`` for ``duration_s``,
    taking at most ``share`` of the guest's time, holding ``memory_bytes`` there (staging of segments not resident
    on the guest is added). ``admit``: place a new request of ``tenant`` (``input_tokens``/``output_tokens``) on
    ``device``.
    """

    kind: str  # lease | admit
    tenant: str
    device: str
    home_device: str = ""
    segments: list[str] = []
    duration_s: float = 0.0
    share: float = 1.0
    memory_bytes: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    request_id: str = ""
    mode: str = "segments"  # lease mode: segments (MLP blocks of the home's batch) | sequences (segments ["*"])


class WhatIfQuery(Msg, frozen=True, kw_only=True):
    """A batch of candidates; the reply goes to ``sim_reply_stream(prefix, client)``."""

    query_id: str
    client: str
    candidates: list[WhatIfCandidate]
    horizon_s: float = 2.0
    deadline_ts: float = 0.0  # 0 = none; a query still unanswered past this is dropped (the client has given up)


class RequestPrediction(msgspec.Struct, frozen=True, array_like=True):
    """Predicted latency of affected requests that share one prediction: the running requests of a tenant on a
    device, the worst of its queued ones (``queued:<tenant>``), a typical new one (``typical:<tenant>``), or the
    candidate request itself."""

    request_ids: list[str]
    tenant: str
    device: str
    ttft_ms: float  # predicted TTFT; 0 for requests already past their first token
    tpot_ms: float
    sla_ok: bool


class DeviceForecast(msgspec.Struct, frozen=True, array_like=True):
    """One device over the horizon: busy intervals (seconds from the query) and the memory peak."""

    device: str
    busy: list[tuple[float, float]]
    memory_peak_bytes: int
    memory_limit_bytes: int


class WhatIfOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """The prediction for candidate ``index`` of the query."""

    index: int
    feasible: bool  # memory_ok and sla_ok
    memory_ok: bool
    sla_ok: bool
    reasons: list[str] = []  # what breaks: "memory:<device>", "sla_tpot:<tenant>", "unknown_device:<id>", ...
    gain_ms: float = 0.0  # predicted TPOT reduction of the candidate's tenant (lease), or 0
    requests: list[RequestPrediction] = []
    devices: list[DeviceForecast] = []


class WhatIfReply(Msg, frozen=True, kw_only=True):
    query_id: str
    epoch: int  # GMG epoch of the twin the answer was computed on
    outcomes: list[WhatIfOutcome] = []
    compute_ms: float = 0.0
    error: str = ""  # non-empty: the query could not be evaluated (outcomes empty)


SimRpcMsg = WhatIfQuery
SimReplyMsg = WhatIfReply


def sim_rpc_stream(prefix: str) -> str:
    return f"{prefix}sim:rpc"


def sim_reply_stream(prefix: str, client: str) -> str:
    return f"{prefix}sim:reply:{client}"


def sim_forecast_key(prefix: str, device: str) -> str:
    """Hash the simulator publishes per device (see docs/redis-schema.md)."""
    return f"{prefix}sim:forecast:{device}"


def sim_rates_key(prefix: str) -> str:
    """Hash of per-tenant arrival-rate estimates (see docs/redis-schema.md)."""
    return f"{prefix}sim:rates"


def sim_corrections_key(prefix: str) -> str:
    """Hash of the simulator's online correction factors per (device, segment kind)."""
    return f"{prefix}sim:corrections"


def sim_steering_key(prefix: str) -> str:
    """Hash of the versioned copy the scheduler's what-if applies (``shared.sim.steering.SteeringCopy``)."""
    return f"{prefix}sim:steering"
