"""Collectors for the streams (length, groups, lag, pending entries and their idle time), the dead-letter stream,
and one request's journey (its ``req:{id}`` hash in time order, GMG traces, matching dead letters). Read-only."""
from __future__ import annotations

import time
from typing import Any

import msgspec
import redis as syncredis

from shared.gmg.keys import GMGKeys
from shared.messages import dead_stream
from shared.requests_state import assigned_key, req_key
from services.inspect.state import num, s, sdict

PENDING_SAMPLE = 1000  # pending entries read per group to find the longest idle one
DEAD_RECENT = 20
DEAD_SCAN_LIMIT = 20_000  # dead letters read (newest first) for counts by reason and for request lookups


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0


def loose_request_id(raw: bytes | None) -> str | None:
    """The request id inside a (possibly poison) payload, if it decodes far enough; never raises."""
    if not raw or len(raw) > 1_000_000:
        return None
    try:
        v = msgspec.msgpack.decode(raw)
    except Exception:  # poison entries are arbitrary bytes; nothing here may raise
        return None
    if not isinstance(v, dict):
        return None
    rid = v.get("request_id")
    if rid is None and isinstance(v.get("request"), dict):
        rid = v["request"].get("request_id")
    return rid if isinstance(rid, str) else None


def reason_kind(reason: str) -> str:
    """The stable head of a dead-letter reason (``undecodable: Expected …`` -> ``undecodable``)."""
    return reason.split(":", 1)[0].strip() or "unknown"


class StreamsReader:
    """Reads every stream under ``prefix`` and the dead-letter stream."""

    def __init__(self, redis: syncredis.Redis, prefix: str) -> None:
        self.r, self.p = redis, prefix
        self.dead = dead_stream(prefix)

    def stream_names(self) -> list[str]:
        return sorted({s(k) for k in self.r.scan_iter(match=f"{self.p}*", count=1000, _type="stream")})

    def streams(self, *, dead_recent: int = DEAD_RECENT) -> dict:
        now = time.time()
        out = [self.stream(name) for name in self.stream_names()]
        return {"kind": "streams", "ts": now, "prefix": self.p, "streams": [x for x in out if x is not None],
                "dead_letters": self.dead_letters(recent=dead_recent)}

    def stream(self, name: str) -> dict | None:
        try:
            info = self.r.xinfo_stream(name)
            groups = self.r.xinfo_groups(name)
        except syncredis.ResponseError:  # vanished (or trimmed to nothing and deleted) since the scan
            return None
        info = {s(k): v for k, v in info.items()}
        last_id = s(info.get("last-generated-id") or "0-0")
        first = info.get("first-entry")
        added = info.get("entries-added")
        return {"name": name, "length": int(info.get("length") or 0), "first_id": s(first[0]) if first else None,
                "last_id": last_id, "entries_added": None if added is None else int(added),
                "groups": [self._group(name, {s(k): v for k, v in g.items()}, last_id, added) for g in groups]}

    def _group(self, stream: str, g: dict, last_id: str, added: Any) -> dict:
        name = s(g.get("name"))
        pending = int(g.get("pending") or 0)
        delivered = s(g.get("last-delivered-id") or "0-0")
        read = g.get("entries-read")
        lag = g.get("lag")
        if lag is None:  # Redis cannot tell (e.g. after deletions): estimate from the ids and counters
            if delivered == last_id:
                lag = 0
            elif read is not None and added is not None:
                lag = max(0, int(added) - int(read))
        row = {"name": name, "consumers": int(g.get("consumers") or 0), "pending": pending,
               "last_delivered_id": delivered, "entries_read": None if read is None else int(read),
               "lag": None if lag is None else int(lag), "lag_source": "redis" if g.get("lag") is not None
               else ("estimate" if lag is not None else None),
               "oldest_pending_id": None, "oldest_pending_idle_ms": None, "max_pending_idle_ms": None,
               "max_deliveries": None, "consumers_detail": []}
        if pending:
            sample = self.r.xpending_range(stream, name, min="-", max="+", count=PENDING_SAMPLE)
            if sample:
                row["oldest_pending_id"] = s(sample[0]["message_id"])
                row["oldest_pending_idle_ms"] = int(sample[0]["time_since_delivered"])
                row["max_pending_idle_ms"] = max(int(x["time_since_delivered"]) for x in sample)
                row["max_deliveries"] = max(int(x["times_delivered"]) for x in sample)
        for c in self.r.xinfo_consumers(stream, name):
            c = {s(k): v for k, v in c.items()}
            row["consumers_detail"].append({"name": s(c.get("name")), "pending": int(c.get("pending") or 0),
                                            "idle_ms": int(c.get("idle") or 0)})
        return row

    # ------------------------------------------------------------ dead letters
    def dead_entries(self, limit: int = DEAD_SCAN_LIMIT) -> list[dict]:
        """Dead letters, newest first (at most ``limit``)."""
        out, last = [], "+"
        while len(out) < limit:
            batch = self.r.xrevrange(self.dead, max=last, min="-", count=min(1000, limit - len(out)))
            if not batch:
                break
            for eid, fields in batch:
                out.append(_dead_row(s(eid), fields))
            last = "(" + s(batch[-1][0])
            if len(batch) < 1000:
                break
        return out

    def dead_letters(self, *, recent: int = DEAD_RECENT) -> dict:
        try:
            total = int(self.r.xlen(self.dead))
        except syncredis.ResponseError:
            total = 0
        entries = self.dead_entries() if total else []
        by_reason: dict[str, int] = {}
        by_stream: dict[str, int] = {}
        for e in entries:
            by_reason[e["reason_kind"]] = by_reason.get(e["reason_kind"], 0) + 1
            by_stream[e["stream"]] = by_stream.get(e["stream"], 0) + 1
        return {"stream": self.dead, "count": total, "scanned": len(entries),
                "by_reason": dict(sorted(by_reason.items())), "by_stream": dict(sorted(by_stream.items())),
                "recent": entries[:recent]}

    # ------------------------------------------------------------ one request
    def request(self, request_id: str, devices: list[str] | None = None) -> dict:
        """The journey of ``request_id``; ``found`` is False when nothing anywhere mentions it."""
        now = time.time()
        key = req_key(self.p, request_id)
        h = sdict(self.r.hgetall(key))
        ttl = self.r.ttl(key) if h else None
        timeline = sorted(((f[:-3], float(v)) for f, v in h.items() if f.endswith("_ts") and _is_float(v)),
                          key=lambda x: x[1])
        t0 = timeline[0][1] if timeline else None
        events = [{"event": ev, "ts": ts, "t_ms": round((ts - t0) * 1000, 3)} for ev, ts in timeline]
        fields = {f: num(v) for f, v in sorted(h.items()) if not f.endswith("_ts")}
        k = GMGKeys(self.p)
        if devices is None:
            devices = sorted(s(x) for x in self.r.smembers(k.devices))
        traces = []
        for d in devices:
            running = self.r.hget(k.requests(d), request_id)
            if running is not None:
                tenant, state, ts = (s(running).split("|") + ["", "", ""])[:3]
                traces.append({"device": d, "status": state or "running", "outcome": None, "ts": num(ts)})
            for member, score in self.r.zscan_iter(k.finished(d), match=f"{request_id}|*"):
                parts = s(member).split("|")
                traces.append({"device": d, "status": "finished", "outcome": parts[2] if len(parts) > 2 else None,
                               "ts": float(score)})
            if self.r.sismember(assigned_key(self.p, d), request_id):
                traces.append({"device": d, "status": "assigned_by_scheduler", "outcome": None, "ts": None})
        dead = [e for e in self.dead_entries() if e["request_id"] == request_id]
        return {"kind": "request", "ts": now, "prefix": self.p, "request_id": request_id,
                "found": bool(h or traces or dead), "state": h.get("state"), "tenant": h.get("tenant"),
                "ttl_s": ttl if ttl is None or ttl >= 0 else None, "fields": fields, "timeline": events,
                "devices": traces, "dead_letters": dead}


def _is_float(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def _dead_row(eid: str, fields: dict) -> dict:
    f = {s(k): v for k, v in fields.items()}
    reason = s(f.get("reason", b""))
    return {"id": eid, "ts": num(f.get("ts")), "stream": s(f.get("stream", b"")),
            "entry_id": s(f.get("entry_id", b"")), "group": s(f.get("group", b"")), "reason": reason,
            "reason_kind": reason_kind(reason), "request_id": loose_request_id(f.get("m")),
            "payload_bytes": len(f.get("m") or b"")}
