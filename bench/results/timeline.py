"""Device busy-time timelines of a mesh run, from what the workers published.

* own work: ``StepReport.busy_intervals`` (iterations of the device's own tenant);
* guest work: ``StepReport.guest_intervals`` (whole iterations of a leased tenant run on a guest lane) and the
  per-window totals of guest segments (``SegmentStat`` names ``tenant/segment``: segments run for a driver,
  measured per report window, not placed inside it);
* lease windows: ``LeaseGranted``/``LeaseRevoked`` on the worker streams (a re-sent grant extends the window;
  a revocation ends it at its stream entry's time).

:class:`TimelineRecorder` is the hook ``bench.compare_mesh`` calls around each mesh point: when the mesh is
up it creates an idle consumer group on the events and worker streams (consumers trim only below every group's
last delivered id, so the whole run stays readable), and before the mesh stops it reads them with XRANGE.
"""
from __future__ import annotations

from typing import Any, Iterable

import structlog

from shared.codec import DecodeError, decode
from shared.messages import (EventsMsg, LeaseGranted, LeaseRevoked, StepReport, WorkerHeartbeat, WorkerMsg,
                             events_stream, worker_stream)
from shared.streams import entry_payload

log = structlog.get_logger(__name__)

HOLD_GROUP = "results-hold"
Entry = tuple[float, Any]  # (stream entry time in epoch seconds, decoded message)


def _entry_ts(entry_id: bytes | str) -> float:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(s.split("-", 1)[0]) / 1000.0


def hold_streams(r, streams: Iterable[str]) -> None:
    """An idle consumer group at id 0 on each stream, so trimming keeps every entry until the run is read."""
    for s in streams:
        try:
            r.xgroup_create(s, HOLD_GROUP, id="0", mkstream=True)
        except Exception as e:  # BUSYGROUP: already held
            if "BUSYGROUP" not in str(e):
                raise


def read_stream(r, stream: str, types: Any, chunk: int = 5000) -> list[Entry]:
    """Every entry of ``stream`` decoded as ``types``; entries that do not decode are skipped."""
    out: list[Entry] = []
    start = "-"
    while True:
        batch = r.xrange(stream, min=start, max="+", count=chunk)
        for entry_id, fields in batch:
            data = entry_payload(fields)
            if data is None:
                continue
            try:
                out.append((_entry_ts(entry_id), decode(data, types)))
            except DecodeError:
                continue
        if len(batch) < chunk:
            return out
        last = batch[-1][0]
        start = "(" + (last.decode() if isinstance(last, bytes) else last)


def build_timeline(events: Iterable[Entry], worker: Iterable[Entry], *, t0: float | None = None,
                   t1: float | None = None) -> dict[str, Any]:
    """Intervals in seconds from ``t0`` (default: the earliest one), clipped to ``[t0, t1]``.

    Returns ``devices`` (device → home tenant), ``own`` and ``guest`` (``[device, start, end, tenant]``),
    ``guest_segments`` (``[device, window_start, window_end, tenant, ms]``) and ``leases`` (``[guest, home,
    tenant, start, end, mode, how_it_ended]``), plus per-device totals in ``busy``.
    """
    devices: dict[str, str] = {}
    own, guest, segs = [], [], []
    for _, m in events:
        if isinstance(m, WorkerHeartbeat):  # idle devices report no steps but are on the timeline too
            devices[m.device] = m.home_tenant
        if not isinstance(m, StepReport):
            continue
        devices.setdefault(m.device, m.tenant)
        own += [(m.device, a, b, m.tenant) for a, b in m.busy_intervals]
        guest += [(m.device, a, b, tn) for tn, a, b in getattr(m, "guest_intervals", ())]
        per: dict[str, float] = {}
        for st in m.segments:
            if "/" in st.segment:
                tn = st.segment.split("/", 1)[0]
                per[tn] = per.get(tn, 0.0) + st.total_ms
        segs += [(m.device, m.window_start_ts, m.window_end_ts, tn, ms) for tn, ms in per.items() if ms > 0]
    leases: dict[str, dict[str, Any]] = {}
    for ts, m in sorted(worker, key=lambda e: e[0]):
        if isinstance(m, LeaseGranted):
            lz = leases.setdefault(m.lease_id, {"guest": m.guest_device, "home": m.home_device, "tenant": m.tenant,
                                                "start": m.start_ts, "end": m.end_ts, "mode": m.mode,
                                                "ended": "window"})
            lz["start"], lz["end"] = min(lz["start"], m.start_ts), max(lz["end"], m.end_ts)
        elif isinstance(m, LeaseRevoked) and m.lease_id in leases:
            lz = leases[m.lease_id]
            if ts < lz["end"]:
                lz["end"], lz["ended"] = ts, m.reason or "revoked"
    starts = [x[1] for x in own + guest + segs] + [lz["start"] for lz in leases.values()]
    if t0 is None:
        t0 = min(starts, default=0.0)
    hi = float("inf") if t1 is None else t1 - t0

    def clip(a: float, b: float) -> tuple[float, float] | None:
        a, b = max(0.0, a - t0), min(hi, b - t0)
        return (round(a, 4), round(b, 4)) if b > a else None

    out: dict[str, Any] = {"t0_ts": t0, "devices": dict(sorted(devices.items())), "own": [], "guest": [],
                           "guest_segments": [], "leases": []}
    for key, rows in (("own", own), ("guest", guest)):
        for dev, a, b, tn in rows:
            c = clip(a, b)
            if c:
                out[key].append([dev, *c, tn])
    for dev, a, b, tn, ms in segs:
        c = clip(a, b)
        if c:
            out["guest_segments"].append([dev, *c, tn, round(ms, 3)])
    for lz in leases.values():
        c = clip(lz["start"], lz["end"])
        if c:
            out["leases"].append([lz["guest"], lz["home"], lz["tenant"], *c, lz["mode"], lz["ended"]])
            devices.setdefault(lz["guest"], "?")
    out["devices"] = dict(sorted(devices.items()))
    out["busy"] = busy_totals(out)
    return out


def busy_totals(tl: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per device: seconds of own work, guest work (lanes + segments) and hosted lease windows."""
    tot = {d: {"own_s": 0.0, "guest_s": 0.0, "lease_window_s": 0.0, "leases": 0} for d in tl["devices"]}
    for dev, a, b, _ in tl["own"]:
        tot[dev]["own_s"] += b - a
    for dev, a, b, _ in tl["guest"]:
        tot[dev]["guest_s"] += b - a
    for dev, _, _, _, ms in tl["guest_segments"]:
        tot[dev]["guest_s"] += ms / 1000.0
    for row in tl["leases"]:
        tot[row[0]]["lease_window_s"] += row[4] - row[3]
        tot[row[0]]["leases"] += 1
    return {d: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()} for d, t in tot.items()}


class TimelineRecorder:
    """Mesh-point hook: records the timeline of every point run under one of ``policies``."""

    def __init__(self, policies: Iterable[str] = ("slice",)) -> None:
        self.policies = set(policies)
        self.points: dict[tuple[str, float], dict[str, Any]] = {}

    def _streams(self, launcher) -> list[str]:
        return [events_stream(launcher.prefix)] + [worker_stream(launcher.prefix, d.id)
                                                   for d in launcher.cluster.devices]

    def started(self, launcher, policy: str, scale: float) -> None:
        if policy not in self.policies:
            return
        import redis as syncredis
        r = syncredis.Redis.from_url(launcher.redis_url, socket_timeout=10)
        try:
            hold_streams(r, self._streams(launcher))
        except Exception as e:  # a timeline is a by-product: never fail the measurement for it
            log.warning("timeline_hold_failed", policy=policy, scale=scale, error=repr(e))
        finally:
            r.close()

    def finished(self, launcher, policy: str, scale: float, summary: dict[str, Any]) -> None:
        if policy not in self.policies:
            return
        import redis as syncredis
        r = syncredis.Redis.from_url(launcher.redis_url, socket_timeout=10)
        try:
            streams = self._streams(launcher)
            events = read_stream(r, streams[0], EventsMsg)
            worker = [e for s in streams[1:] for e in read_stream(r, s, WorkerMsg)]
            start, end = (summary.get("window_s") or [None, None])[:2]
            tl = build_timeline(events, worker, t0=start or None, t1=end or None)
            tl.update(policy=policy, scale=scale, tokens_per_s=summary.get("tokens_per_s"),
                      violation_rate=summary.get("violation_rate"))
            self.points[(policy, float(f"{scale:.6g}"))] = tl
        except Exception as e:
            log.warning("timeline_read_failed", policy=policy, scale=scale, error=repr(e))
        finally:
            r.close()

    def pick_busiest(self, policy: str, bound: float = 0.09) -> dict[str, Any] | None:
        """The point within the violation ``bound`` that hosted the most leases (ties: the higher scale), else the
        lightest load run: the run that shows slices in use, while the policy still met the bound."""
        mine = [tl for (p, _), tl in self.points.items() if p == policy]
        ok = [tl for tl in mine if tl.get("violation_rate") is not None and tl["violation_rate"] <= bound]
        if not ok:
            return min(mine, key=lambda tl: tl["scale"]) if mine else None
        return max(ok, key=lambda tl: (len(tl["leases"]), tl["scale"]))

    def pick(self, policy: str, scale: float | None) -> dict[str, Any] | None:
        """The timeline at ``scale`` (e.g. the policy's max sustainable scale), else at the lightest load run."""
        mine = {s: tl for (p, s), tl in self.points.items() if p == policy}
        if not mine:
            return None
        if scale is not None and float(f"{scale:.6g}") in mine:
            return mine[float(f"{scale:.6g}")]
        return mine[min(mine)]
