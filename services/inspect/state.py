"""Collectors for devices, tenants, leases and forecasts: plain reads of the GMG hashes, the scheduler's per-tenant
stats, the gateways' ``/metrics`` and the simulator's forecast hashes. Read-only; every result is JSON-ready.

The JSON keys are part of the CLI's contract (``docs/operations.md``): add keys, never rename them.
"""
from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import redis as syncredis

from shared.gmg.keys import GMGKeys
from shared.requests_state import tenant_stats_key

REQUEST_SCAN_LIMIT = 20_000  # request hashes read for tenants' recent outcomes (one SCAN pass, bounded)
VIOLATING_OUTCOMES = ("rejected_quota", "rejected_overload", "error")
COUNTED_OUTCOMES = ("ok", *VIOLATING_OUTCOMES)  # outcomes that count toward SLA attainment (DESIGN §9)


def s(v: Any) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def sdict(h: dict) -> dict[str, str]:
    return {s(k): s(v) for k, v in h.items()}


def num(v: Any) -> int | float | str | None:
    """A hash field as int, else float, else the string itself; ``None``/empty -> ``None``."""
    if v is None:
        return None
    t = s(v)
    if t == "":
        return None
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        return t


def _int(v: Any) -> int | None:
    n = num(v)
    return int(n) if isinstance(n, (int, float)) else None


def _float(v: Any) -> float | None:
    n = num(v)
    return float(n) if isinstance(n, (int, float)) else None


class StateReader:
    """Reads devices, tenants, leases and forecasts of the mesh under ``prefix``."""

    def __init__(self, redis: syncredis.Redis, prefix: str, *, metrics_host: str = "127.0.0.1",
                 metrics_timeout_s: float = 1.0) -> None:
        self.r, self.p = redis, prefix
        self.k = GMGKeys(prefix)
        self.metrics_host, self.metrics_timeout_s = metrics_host, metrics_timeout_s

    # ------------------------------------------------------------ devices
    def devices(self) -> dict:
        now = time.time()
        ids = sorted(s(x) for x in self.r.smembers(self.k.devices))
        pipe = self.r.pipeline(transaction=False)
        for d in ids:
            pipe.hgetall(self.k.device(d))
            pipe.hgetall(self.k.exec_state(d))
            pipe.hgetall(self.k.resident(d))
            pipe.hgetall(self.k.reservations(d))
            pipe.zcard(self.k.leases(d))
        rows = pipe.execute()
        out = []
        for i, d in enumerate(ids):
            h, ex, res, rsv, nleases = (sdict(rows[5 * i]), sdict(rows[5 * i + 1]), sdict(rows[5 * i + 2]),
                                        sdict(rows[5 * i + 3]), int(rows[5 * i + 4]))
            out.append(_device_row(d, h, ex, res, rsv, nleases, now))
        return {"kind": "devices", "ts": now, "prefix": self.p, "devices": out}

    # ------------------------------------------------------------ tenants
    def tenants(self) -> dict:
        now = time.time()
        names = sorted(s(x) for x in self.r.smembers(self.k.tenants))
        pipe = self.r.pipeline(transaction=False)
        for t in names:
            pipe.hgetall(self.k.tenant(t))
            pipe.hgetall(tenant_stats_key(self.p, t))
        rows = pipe.execute()
        metrics, gateways = self.gateway_metrics()
        recent, scanned, truncated = self.recent_request_states()
        out = []
        for i, t in enumerate(names):
            h, st = sdict(rows[2 * i]), sdict(rows[2 * i + 1])
            out.append(_tenant_row(t, h, st, metrics.get(t), recent.get(t, {}), now))
        return {"kind": "tenants", "ts": now, "prefix": self.p, "tenants": out,
                "gateways_scraped": gateways, "requests_scanned": scanned, "scan_truncated": truncated}

    def gateway_metrics(self) -> tuple[dict[str, dict], int]:
        """Sum of every live gateway's request outcomes and SLA violations per tenant; (per tenant, gateways read)."""
        from prometheus_client.parser import text_string_to_metric_families

        from shared.service import health_key  # aiohttp and prometheus: only this view needs them

        per: dict[str, dict] = {}
        read = 0
        for key in self.r.scan_iter(match=health_key(self.p, "gateway", "*"), count=100):
            port = _int(self.r.hget(key, "port"))
            if not port:
                continue
            try:
                url = f"http://{self.metrics_host}:{port}/metrics"
                with urllib.request.urlopen(url, timeout=self.metrics_timeout_s) as resp:
                    text = resp.read().decode("utf-8", "replace")
            except (OSError, ValueError):
                continue
            read += 1
            for fam in text_string_to_metric_families(text):
                for smp in fam.samples:
                    t = smp.labels.get("tenant")
                    if t is None:
                        continue
                    d = per.setdefault(t, {"requests": {}, "sla_violations": 0.0})
                    if smp.name == "slicesched_requests_total":
                        o = smp.labels.get("outcome", "?")
                        d["requests"][o] = d["requests"].get(o, 0) + int(smp.value)
                    elif smp.name == "slicesched_sla_violations_total":
                        d["sla_violations"] += smp.value
        return per, read

    def recent_request_states(self, limit: int = REQUEST_SCAN_LIMIT) -> tuple[dict[str, dict[str, int]], int, bool]:
        """Counts of request-hash states per tenant (terminal hashes live an hour): (counts, scanned, truncated)."""
        keys, truncated = [], False
        for k in self.r.scan_iter(match=f"{self.p}req:*", count=1000):
            if len(keys) >= limit:
                truncated = True
                break
            keys.append(k)
        counts: dict[str, dict[str, int]] = {}
        for i in range(0, len(keys), 1000):
            pipe = self.r.pipeline(transaction=False)
            for k in keys[i:i + 1000]:
                pipe.hmget(k, "tenant", "state")
            for tenant, state in pipe.execute():
                if tenant is None or state is None:
                    continue
                c = counts.setdefault(s(tenant), {})
                c[s(state)] = c.get(s(state), 0) + 1
        return counts, len(keys), truncated

    # ------------------------------------------------------------ leases
    def leases(self) -> dict:
        now = time.time()
        ids = sorted(s(x) for x in self.r.smembers(self.k.devices))
        pipe = self.r.pipeline(transaction=False)
        for d in ids:
            pipe.zrange(self.k.leases(d), 0, -1)
        lease_ids = sorted({s(x) for ids_ in pipe.execute() for x in ids_})
        pipe = self.r.pipeline(transaction=False)
        for lid in lease_ids:
            pipe.hgetall(self.k.lease(lid))
        out = []
        for lid, raw in zip(lease_ids, pipe.execute()):
            h = sdict(raw)
            if not h:
                continue
            end = _float(h.get("end_ts"))
            out.append({"id": lid, "tenant": h.get("tenant", ""), "guest": h.get("guest", ""),
                        "home": h.get("home", ""), "segments": [x for x in h.get("segments", "").split(",") if x],
                        "start_ts": _float(h.get("start_ts")), "end_ts": end,
                        "remaining_s": None if end is None else round(end - now, 3),
                        "nbytes": _int(h.get("nbytes")), "share": _float(h.get("share")),
                        "mode": h.get("mode") or None, "state": h.get("state", "")})
        out.sort(key=lambda x: (x["end_ts"] or 0, x["id"]))
        return {"kind": "leases", "ts": now, "prefix": self.p, "leases": out}

    # ------------------------------------------------------------ forecasts
    def forecasts(self) -> dict:
        """The simulator's per-device forecasts (``sim:forecast:{device}``), arrival rates and corrections."""
        now = time.time()
        base = f"{self.p}sim:forecast:"
        keys = sorted(s(k) for k in self.r.scan_iter(match=f"{base}*", count=500))
        out = []
        for key in keys:
            try:
                h = sdict(self.r.hgetall(key))
            except syncredis.ResponseError:  # not a hash (WRONGTYPE): not a forecast we understand
                continue
            fields = {k: _field(k, v) for k, v in sorted(h.items())}
            ts = next((_float(h[f]) for f in ("ts", "generated_ts", "updated_ts") if f in h), None)
            out.append({"device": key[len(base):], "ts": ts, "age_s": None if ts is None else round(now - ts, 3),
                        "fields": fields})
        rates, corrections = {}, {}
        try:
            for k, v in sdict(self.r.hgetall(f"{self.p}sim:rates")).items():
                tenant, _, what = k.partition(":")
                if tenant not in ("ts", "window_s"):
                    rates.setdefault(tenant, {})[what or "rate_rps"] = _float(v)
            for k, v in sdict(self.r.hgetall(f"{self.p}sim:corrections")).items():
                factor, error, samples = (v.split("|") + ["", "", ""])[:3]
                corrections[k] = {"factor": _float(factor), "error": _float(error), "samples": _int(samples)}
        except syncredis.ResponseError:  # not hashes: nothing we understand
            pass
        return {"kind": "forecasts", "ts": now, "prefix": self.p, "forecasts": out,
                "rates": dict(sorted(rates.items())), "corrections": dict(sorted(corrections.items()))}


def _field(name: str, v: str) -> Any:
    """A forecast field: interval lists (``busy``/``idle``: ``s-e,…``; ``memory``: ``t:bytes,…``) as lists of pairs,
    JSON as JSON, numbers as numbers, anything else as the string."""
    if name in ("busy", "idle", "memory"):
        sep = ":" if name == "memory" else "-"
        pairs = []
        for part in filter(None, v.split(",")):
            a, _, b = part.partition(sep)
            try:
                pairs.append([float(a), int(b) if name == "memory" else float(b)])
            except ValueError:
                return v
        return pairs
    if v[:1] in "[{":
        try:
            return json.loads(v)
        except ValueError:
            return v
    return num(v)


def _device_row(d: str, h: dict, ex: dict, res: dict, rsv: dict, nleases: int, now: float) -> dict:
    hb = _float(h.get("heartbeat_ts"))
    limit, reserved = _int(h.get("limit")), _int(h.get("reserved"))
    resident = []
    for key, nbytes in sorted(res.items()):
        tenant, _, seg = key.partition("|")
        resident.append({"tenant": tenant, "segment": seg, "bytes": _int(nbytes) or 0})
    by_kind: dict[str, int] = {}
    for v in rsv.values():
        parts = v.split("|")
        if len(parts) >= 3:
            by_kind[parts[0]] = by_kind.get(parts[0], 0) + (_int(parts[2]) or 0)
    return {
        "id": d, "backend": h.get("backend", ""), "kind": h.get("kind", ""), "label": h.get("label", ""),
        "host": h.get("host", ""), "home_tenant": h.get("home_tenant", ""), "state": h.get("state", "unknown"),
        "down_reason": h.get("down_reason") or None, "worker_id": h.get("worker_id") or None,
        "heartbeat_ts": hb, "heartbeat_age_s": None if not hb else round(now - hb, 3),
        "memory": {"capacity_bytes": _int(h.get("capacity")), "limit_bytes": limit, "reserved_bytes": reserved,
                   "used_bytes": _int(h.get("used")), "free_bytes": None if limit is None or reserved is None
                   else limit - reserved, "weights_used_bytes": _int(h.get("weight_used")),
                   "kv_used_bytes": _int(h.get("kv_used")), "kv_total_bytes": _int(h.get("kv_total"))},
        "busy_ratio": _float(h.get("busy_ratio")), "running": _int(h.get("running")),
        "queued": _int(h.get("queued")),
        "exec": {"steps_total": _int(ex.get("steps_total")), "busy_ms_total": _float(ex.get("busy_ms_total")),
                 "started_total": _int(ex.get("started_total")), "finished_total": _int(ex.get("finished_total")),
                 "last_step_ts": _float(ex.get("last_step_ts"))},
        "reservations": {"count": len(rsv), "bytes_by_kind": by_kind},
        "leases_active": nleases,
        "resident": resident, "resident_bytes": sum(x["bytes"] for x in resident),
    }


def _tenant_row(t: str, h: dict, st: dict, metrics: dict | None, recent: dict[str, int], now: float) -> dict:
    stats_ts = _float(st.get("ts"))
    row = {"name": t, "model": h.get("model", ""),
           "home_devices": [x for x in h.get("home_devices", "").split(",") if x],
           "max_queue": _int(h.get("max_queue")),
           "sla": {"ttft_ms": _float(h.get("sla_ttft_ms")), "tpot_ms": _float(h.get("sla_tpot_ms"))},
           "queued": _int(st.get("queued")), "running": _int(st.get("running")),
           "stats_age_s": None if stats_ts is None else round(now - stats_ts, 3),
           "requests": {}, "sla_violations": None, "sla_attainment": None, "sla_source": None,
           "recent_states": dict(sorted(recent.items()))}
    if metrics is not None:
        row["requests"] = dict(sorted(metrics["requests"].items()))
        counted = sum(metrics["requests"].get(o, 0) for o in COUNTED_OUTCOMES)
        row["sla_violations"] = int(metrics["sla_violations"])
        if counted:
            row["sla_attainment"] = round(max(0.0, 1.0 - metrics["sla_violations"] / counted), 4)
            row["sla_source"] = "gateway_metrics"
    if row["sla_source"] is None:
        done = recent.get("done", 0)
        bad = recent.get("failed", 0) + recent.get("rejected", 0)
        if done + bad:
            # request hashes carry no TTFT/TPOT: only failures and rejections count as violations here
            row["sla_attainment"] = round(done / (done + bad), 4)
            row["sla_source"] = "request_hashes"
    return row
