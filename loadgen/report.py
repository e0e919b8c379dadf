"""Serving metrics from per-request records (DESIGN §9), as pure functions shared by replay and the benches.

TTFT; TPOT = (E2E − TTFT)/(output tokens − 1); inter-token latency; E2E. A request violates its SLA when TTFT
or TPOT exceeds its tenant's target, or when it is rejected or fails (timeouts count as failures). Requests
cancelled by the operator (Ctrl-C) are counted apart and left out of the violation rate. Token throughput
counts the output tokens of completed requests over the measured window (first send → last finish).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterable, Mapping

import numpy as np

STATUSES = ("ok", "rejected", "failed", "timeout", "cancelled")
QUANTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw for one request. Times in seconds; ``sent_ts`` is epoch seconds."""

    id: str
    tenant: str
    arrival_s: float
    sent_ts: float
    status: str = "ok"
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl: list[float] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    http_status: int | None = None
    error: str | None = None
    send_lag_s: float = 0.0  # how late the client sent it relative to its scheduled arrival

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def finish_ts(self) -> float | None:
        return None if self.e2e_s is None else self.sent_ts + self.e2e_s


@dataclass(frozen=True)
class SlaTarget:
    """A tenant's targets in seconds; with ``per_request`` (``(input, output) -> (ttft_s, tpot_s)``, e.g.
    :class:`shared.costmodel.sla.RequestTargets`) each request gets its own, priced from its lengths."""

    ttft_s: float
    tpot_s: float
    per_request: Callable[[int, int], tuple[float, float]] | None = field(default=None, compare=False)

    def for_request(self, rec: "RequestRecord") -> tuple[float, float]:
        if self.per_request is None:
            return self.ttft_s, self.tpot_s
        return self.per_request(max(1, rec.input_tokens), max(1, rec.expected_output_tokens or rec.output_tokens))


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """(E2E − TTFT)/(output − 1); undefined for a single output token."""
    return (e2e_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else None


def violates(rec: RequestRecord, sla: SlaTarget | None) -> bool:
    """True when the request counts against its tenant's SLA (cancelled requests never do)."""
    if rec.status == "cancelled":
        return False
    if rec.status != "ok":
        return True
    if sla is None:
        return False
    ttft_s, tpot_s = sla.for_request(rec)
    if rec.ttft_s is not None and rec.ttft_s > ttft_s:
        return True
    return rec.tpot_s is not None and rec.tpot_s > tpot_s


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in QUANTILES} | {"mean": None}
    a = np.asarray(values, dtype=np.float64)
    out: dict[str, float | None] = {f"p{q}": float(np.percentile(a, q)) for q in QUANTILES}
    out["mean"] = float(a.mean())
    return out


def measured_window(records: Iterable[RequestRecord]) -> tuple[float, float]:
    """(first send, last finish) in epoch seconds; (0, 0) when nothing was sent."""
    recs = list(records)
    if not recs:
        return 0.0, 0.0
    start = min(r.sent_ts for r in recs)
    ends = [r.finish_ts for r in recs if r.finish_ts is not None]
    return start, max(ends + [start])


def _group(recs: list[RequestRecord], sla: SlaTarget | None | Mapping[str, SlaTarget], duration: float) -> dict:
    ok = [r for r in recs if r.status == "ok"]
    counts = {s: sum(1 for r in recs if r.status == s) for s in STATUSES}
    judged = [r for r in recs if r.status != "cancelled"]

    def target(r: RequestRecord) -> SlaTarget | None:
        return sla.get(r.tenant) if isinstance(sla, Mapping) else sla

    violations = sum(1 for r in judged if violates(r, target(r)))
    tokens = sum(r.output_tokens for r in ok)
    itl = [x for r in ok for x in r.itl]
    return {
        "requests": len(recs),
        "completed": counts["ok"],
        "rejected": counts["rejected"],
        "failed": counts["failed"] + counts["timeout"],
        "timeouts": counts["timeout"],
        "cancelled": counts["cancelled"],
        "output_tokens": tokens,
        "tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "requests_per_s": counts["ok"] / duration if duration > 0 else 0.0,
        "ttft_s": _quantiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _quantiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": _quantiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "itl_s": _quantiles(itl),
        "sla_violations": violations,
        "violation_rate": violations / len(judged) if judged else 0.0,
    }


def summarize(records: Iterable[RequestRecord], slas: Mapping[str, SlaTarget], *,
              window: tuple[float, float] | None = None, partial: bool = False,
              tenants: list[str] | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Per-tenant and total metrics. ``window`` (epoch s) defaults to first send → last finish.

    The result's top level repeats the total's ``tokens_per_s`` and ``violation_rate`` (the keys the
    simulator's JSON uses) so the benches can read live and simulated results the same way.
    """
    recs = list(records)
    start, end = window if window is not None else measured_window(recs)
    duration = max(0.0, end - start)
    names = list(tenants) if tenants is not None else []
    for r in recs:
        if r.tenant not in names:
            names.append(r.tenant)
    per = {n: _group([r for r in recs if r.tenant == n], slas.get(n), duration) for n in names}
    total = _group(recs, slas, duration)
    return {"partial": partial, "window_s": [start, end], "duration_s": duration,
            "tokens_per_s": total["tokens_per_s"], "violation_rate": total["violation_rate"],
            "total": total, "tenants": per, **(dict(extra) if extra else {})}


def _ms(v: float | None) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1000:.1f}"


def summary_markdown(summary: Mapping[str, Any], title: str = "Replay summary") -> str:
    """A Markdown report of :func:`summarize`'s result: one row per tenant plus the total."""
    lines = [f"# {title}" + (" (PARTIAL: stopped early)" if summary.get("partial") else ""), ""]
    for k in ("workload", "url", "rate_scale", "started_utc"):
        if k in summary:
            lines.append(f"- {k.replace('_', ' ')}: {summary[k]}")
    lines += [f"- measured window: {summary['duration_s']:.2f} s",
              f"- token throughput: {summary['tokens_per_s']:.2f} tok/s; "
              f"SLA violation rate: {summary['violation_rate']:.2%}", ""]
    head = ("| tenant | requests | ok | rejected | failed | tok/s | req/s | TTFT p50/p90/p99 ms | "
            "TPOT p50/p90/p99 ms | E2E p50/p90/p99 ms | violations |")
    lines += [head, "|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|"]
    rows = list(summary["tenants"].items()) + [("**total**", summary["total"])]
    for name, g in rows:
        q = [" / ".join(_ms(g[m][f"p{p}"]) for p in QUANTILES) for m in ("ttft_s", "tpot_s", "e2e_s")]
        lines.append(f"| {name} | {g['requests']} | {g['completed']} | {g['rejected']} | {g['failed']} | "
                     f"{g['tokens_per_s']:.2f} | {g['requests_per_s']:.3f} | {q[0]} | {q[1]} | {q[2]} | "
                     f"{g['violation_rate']:.2%} |")
    if any(g["cancelled"] for _, g in rows):
        lines += ["", f"Cancelled at stop (not judged): {summary['total']['cancelled']}"]
    return "\n".join(lines) + "\n"
