"""Per-row figures (accepted, lost, duplicated, recovery time, 5xx) computed from the client's calls and the tap,
and the JSON results file that ``python -m tests.reliability.report`` renders into docs/reliability.md."""
from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from reliability.load import Call
from reliability.tap import Tap

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("SLICESCHED_RELIABILITY_RESULTS", REPO / ".data" / "reliability" / "results.json"))


@dataclass
class RowResult:
    """One run of one matrix row (one variant, one seed)."""

    row: str
    title: str
    variant: str = ""
    seed: int = 0
    requests: int = 0
    accepted: int = 0
    lost: int = 0
    duplicated: int = 0
    recovery_s: float | None = None
    http_5xx: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # explicit error outcomes by code
    rejected: int = 0
    notes: str = ""
    extra: dict = field(default_factory=dict)
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d", time.gmtime()))
    duration_s: float = 0.0
    redis: str = field(default_factory=lambda: os.environ.get("SLICESCHED_REL_REDIS", "server"))  # server | cluster

    def note(self, text: str) -> None:
        self.notes = f"{self.notes}; {text}" if self.notes else text

    def check(self, *, allow_lost: bool = False) -> None:
        """The matrix's targets: nothing lost, nothing duplicated."""
        assert self.duplicated == 0, f"row {self.row} {self.variant}: {self.duplicated} duplicated results"
        if not allow_lost:
            assert self.lost == 0, f"row {self.row} {self.variant}: {self.lost} lost ({self.extra.get('lost_ids')})"


def accepted_calls(calls: Iterable[Call], tap: Tap) -> list[Call]:
    """Calls the mesh accepted: streaming began / 200, or the request reached the requests stream."""
    out = []
    for c in calls:
        rid = tap.rid(c.seed)
        if c.began or rid is not None:
            c.request_id = c.request_id or rid
            out.append(c)
        elif c.outcome == "error":
            c.outcome = "rejected"  # an error before the request was enqueued: 429/503, never accepted
    return out


def summarize(result: RowResult, calls: list[Call], tap: Tap, *, fault_mono: float | None = None,
              recovered_mono: float | None = None) -> RowResult:
    """Fill the common figures of ``result`` from ``calls`` and the tap."""
    acc = accepted_calls(calls, tap)
    result.requests = len(calls)
    result.accepted = len(acc)
    lost = [c for c in acc if c.outcome not in ("ok", "error")]
    result.lost = len(lost)
    dup_ids = {c.request_id for c in acc if c.terminals > 1 or len(tap.terminals.get(c.request_id or "", [])) > 1}
    result.duplicated = len(dup_ids)
    result.http_5xx = sum(1 for c in calls if c.status is not None and c.status >= 500)
    result.rejected = sum(1 for c in calls if c.outcome == "rejected")
    result.errors = dict(sorted(Counter(c.code or "?" for c in acc if c.outcome == "error").items()))
    result.extra["http_errors"] = dict(sorted(Counter(f"{c.status} {c.code}" for c in calls
                                                      if c.status not in (None, 200)).items()))
    x = result.extra
    x["ok"] = sum(1 for c in acc if c.outcome == "ok")
    x["lost_ids"] = [f"{c.request_id or c.seed}:{c.outcome}:{c.detail[:60]}" for c in lost[:5]]
    x["lost_by_outcome"] = dict(Counter(c.outcome for c in lost))
    x["reexecuted"] = sum(1 for c in acc if tap.started.get(c.request_id or "", 0) > 1)
    x["late_chunks"] = sum(tap.late_chunks.get(c.request_id or "", 0) for c in acc)
    x["retry_after_on_429_503"] = _fraction(c.retry_after is not None for c in calls if c.status in (429, 503))
    e2e = sorted(c.e2e for c in acc if c.outcome == "ok" and c.e2e is not None)
    if e2e:
        x["e2e_p50_s"], x["e2e_p99_s"], x["e2e_max_s"] = _q(e2e, .5), _q(e2e, .99), round(e2e[-1], 3)
    if fault_mono is not None:
        # recovery: the fault, until a probe succeeded (and kept succeeding) and every accepted request sent
        # before that had its terminal outcome
        before = [c.end for c in acc if c.end is not None and (recovered_mono is None or c.sent <= recovered_mono)]
        drained = max(before) if before else fault_mono
        if recovered_mono is not None:
            result.recovery_s = round(max(recovered_mono, drained) - fault_mono, 2)
    return result


def _q(xs: list[float], q: float) -> float:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def _fraction(flags: Iterable[bool]) -> float | None:
    xs = list(flags)
    return round(sum(xs) / len(xs), 3) if xs else None


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def record(result: RowResult, path: Path = RESULTS) -> None:
    """Add ``result`` to the results file, replacing an earlier run of the same row, variant and seed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(path.read_text()) if path.exists() else []
    key = (result.row, result.variant, result.seed, result.redis)
    rows = [r for r in rows if (r["row"], r["variant"], r["seed"], r.get("redis", "server")) != key]
    rows.append(asdict(result))
    rows.sort(key=lambda r: (_row_key(r["row"]), r["variant"], r["seed"], r.get("redis", "server")))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1, sort_keys=True))
    tmp.replace(path)


def _row_key(row: str) -> tuple[int, str]:
    digits = "".join(ch for ch in row if ch.isdigit())
    return (int(digits) if digits else 999, row)
