"""``slicesched inspect``: devices, tenants, leases, forecasts, streams and one request's journey, read from Redis.

``--json`` prints one JSON object (keys documented in docs/operations.md); ``--watch [SECONDS]`` refreshes the view
(with ``--json``: one object per line). Redis unreachable or bad arguments: one line on stderr, exit 2; an unknown
request id: exit 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import redis as syncredis
from redis.exceptions import RedisClusterException

from shared.redis_util import REDIS_ERRORS, sync_client

from services.inspect import render as R

VIEWS = ("devices", "tenants", "leases", "forecasts", "streams", "request")
DEAD_DEFAULT = 20


def _common(p: argparse.ArgumentParser, suppress: bool) -> None:
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument("--redis-url", default=d(os.environ.get("REDIS_URL")),
                   help="Redis to read (default $REDIS_URL; `slicesched up` prints it)")
    p.add_argument("--prefix", default=d(os.environ.get("SLICESCHED_PREFIX", "slicesched:")),
                   help="key namespace (default slicesched:)")
    p.add_argument("--json", action="store_true", default=d(False), help="print JSON (stable keys) instead of tables")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=d(None), metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--metrics-host", default=d("127.0.0.1"),
                   help="host of the gateways' /metrics (tenants view; ports come from their health keys)")


def configure(p: argparse.ArgumentParser) -> None:
    _common(p, suppress=False)
    sub = p.add_subparsers(dest="view", required=True, metavar="VIEW", parser_class=type(p))
    helps = {"devices": "memory, home tenant, state, heartbeat age, busy ratio, running/queued, resident weights",
             "tenants": "queued, running, SLA targets and attainment so far",
             "leases": "active leases on guest devices", "forecasts": "the simulator's per-device forecasts",
             "streams": "every stream: length, groups, lag, pending entries and idle time; dead letters",
             "request": "one request's journey by id"}
    for v in VIEWS:
        sp = sub.add_parser(v, help=helps[v], description=helps[v])
        _common(sp, suppress=True)
        if v == "request":
            sp.add_argument("request_id", metavar="ID")
        if v == "streams":
            sp.add_argument("--dead", type=int, default=DEAD_DEFAULT, metavar="N",
                            help=f"recent dead letters to list (default {DEAD_DEFAULT})")


class InspectError(Exception):
    """One-line failure with an exit code (2: cannot read Redis or bad input, 1: nothing found)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def collect(r: syncredis.Redis, args: argparse.Namespace) -> dict:
    """The JSON document of ``args.view``."""
    from services.inspect.state import StateReader
    from services.inspect.streams import StreamsReader

    prefix = args.prefix if args.prefix.endswith(":") else args.prefix + ":"
    try:
        if args.view in ("devices", "tenants", "leases", "forecasts"):
            reader = StateReader(r, prefix, metrics_host=args.metrics_host)
            return getattr(reader, args.view)()
        if args.view == "streams":
            return StreamsReader(r, prefix).streams(dead_recent=max(0, args.dead))
        doc = StreamsReader(r, prefix).request(args.request_id)
    except (syncredis.ConnectionError, syncredis.TimeoutError, OSError, RedisClusterException) as e:
        raise InspectError(f"cannot read Redis at {_safe_url(args.redis_url)}: {e}", 2) from None
    except syncredis.RedisError as e:  # e.g. NOPERM for a user without read access to these keys or commands
        raise InspectError(f"Redis at {_safe_url(args.redis_url)} refused a read: {e}", 2) from None
    if not doc["found"]:
        raise InspectError(f"no request {args.request_id!r} under prefix {prefix!r} (journeys expire an hour after "
                           "the request ends)", 1)
    return doc


def run(args: argparse.Namespace) -> int:
    if not args.redis_url:
        print("slicesched inspect: no Redis given: set REDIS_URL or pass --redis-url (slicesched up prints it)",
              file=sys.stderr)
        return 2
    try:  # a single server or any node of a Redis Cluster (SLICESCHED_REDIS_CLUSTER, or asked)
        r = sync_client(args.redis_url, socket_timeout=5, socket_connect_timeout=3, wait_s=0)
    except ValueError as e:
        print(f"slicesched inspect: bad --redis-url: {e}", file=sys.stderr)
        return 2
    except (*REDIS_ERRORS, RedisClusterException) as e:
        print(f"slicesched inspect: cannot read Redis at {_safe_url(args.redis_url)}: {e}", file=sys.stderr)
        return 2
    if args.watch is not None and args.watch <= 0:
        print("slicesched inspect: --watch needs a positive number of seconds", file=sys.stderr)
        return 2
    try:
        if args.watch is None:
            doc = collect(r, args)
            print(json.dumps(doc, sort_keys=True) if args.json else render(doc))
            return 0
        return _watch(r, args)
    except InspectError as e:
        print(f"slicesched inspect: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 0
    finally:
        r.close()


def _watch(r: syncredis.Redis, args: argparse.Namespace) -> int:
    """Redraw until Ctrl-C; Redis trouble is shown and retried (it is often what one is watching for)."""
    while True:
        try:
            doc = collect(r, args)
            body = json.dumps(doc, sort_keys=True) if args.json else render(doc)
        except InspectError as e:
            if e.code != 2:
                raise
            body = json.dumps({"kind": args.view, "ts": time.time(), "error": str(e)}) if args.json else str(e)
        if args.json:
            print(body, flush=True)
        else:
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"\x1b[H\x1b[2Jslicesched inspect {args.view}  every {args.watch:g}s  {stamp}\n\n"
                             f"{body}\n")
            sys.stdout.flush()
        time.sleep(args.watch)


def _safe_url(url: str) -> str:
    """The URL without its password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


# ---------------------------------------------------------------- human output
def render(doc: dict) -> str:
    return {"devices": _devices, "tenants": _tenants, "leases": _leases, "forecasts": _forecasts,
            "streams": _streams, "request": _request}[doc["kind"]](doc)


def _devices(doc: dict) -> str:
    rows = []
    for d in doc["devices"]:
        m = d["memory"]
        res: dict[str, int] = {}
        for x in d["resident"]:
            res[x["tenant"]] = res.get(x["tenant"], 0) + 1
        resident = ", ".join(f"{t}:{n}seg" for t, n in sorted(res.items())) or "-"
        rows.append([d["id"], d["label"] or d["backend"], d["state"], d["home_tenant"] or "-",
                     R.human_age(d["heartbeat_age_s"]), R.human_bytes(m["capacity_bytes"]),
                     R.human_bytes(m["limit_bytes"]), R.human_bytes(m["reserved_bytes"]),
                     R.human_bytes(m["used_bytes"]), R.percent(d["busy_ratio"]), d["running"], d["queued"],
                     d["leases_active"], f"{resident} ({R.human_bytes(d['resident_bytes'])})"])
    return R.table(["DEVICE", "BACKEND", "STATE", "HOME", "HB_AGE", "CAPACITY", "LIMIT", "RESERVED", "USED", "BUSY",
                    "RUN", "QUEUED", "LEASES", "RESIDENT"], rows, empty="(no devices registered under this prefix)")


def _tenants(doc: dict) -> str:
    rows = []
    for t in doc["tenants"]:
        req = t["requests"]
        rej = req.get("rejected_quota", 0) + req.get("rejected_overload", 0)
        src = {"gateway_metrics": "", "request_hashes": " (req hashes)"}.get(t["sla_source"], "")
        rows.append([t["name"], t["model"], ",".join(t["home_devices"]) or "-", t["queued"], t["running"],
                     R.human_ms(t["sla"]["ttft_ms"]), R.human_ms(t["sla"]["tpot_ms"]), req.get("ok", 0),
                     req.get("error", 0), rej, R.percent(t["sla_attainment"]) + src])
    out = R.table(["TENANT", "MODEL", "HOMES", "QUEUED", "RUNNING", "TTFT_SLA", "TPOT_SLA", "OK", "ERRORS",
                   "REJECTED", "SLA_ATTAINMENT"], rows, empty="(no tenants registered under this prefix)")
    return out + f"\n\ngateways scraped: {doc['gateways_scraped']}  request hashes scanned: {doc['requests_scanned']}" \
                 + (" (truncated)" if doc["scan_truncated"] else "")


def _leases(doc: dict) -> str:
    rows = [[x["id"], x["tenant"], x["guest"], x["home"] or "-", x["mode"] or "-", ",".join(x["segments"]),
             R.human_bytes(x["nbytes"]), R.ratio(x["share"]),
             R.human_age(x["remaining_s"]) if (x["remaining_s"] or 0) >= 0 else "ended", x["state"]]
            for x in doc["leases"]]
    return R.table(["LEASE", "TENANT", "GUEST", "HOME", "MODE", "SEGMENTS", "BYTES", "SHARE", "ENDS_IN", "STATE"],
                   rows, empty="(no active leases)")


def _forecasts(doc: dict) -> str:
    rows = []
    for f in doc["forecasts"]:
        x = f["fields"]
        rows.append([f["device"], x.get("state", "-"), x.get("tenant") or "-", R.human_age(f["age_s"]),
                     R.human_age(x.get("horizon_s")), R.percent(x.get("busy_ratio")), R.human_age(x.get("next_idle_s")),
                     R.human_age(x.get("longest_idle_s")), x.get("iteration_ms", "-"),
                     R.human_bytes(x.get("free_now")), R.human_bytes(x.get("free_min")), x.get("label", "-")])
    out = [R.table(["DEVICE", "STATE", "TENANT", "AGE", "HORIZON", "BUSY", "NEXT_IDLE", "LONGEST_IDLE", "ITER_MS",
                    "FREE_NOW", "FREE_MIN", "LABEL"], rows, empty="(no forecasts published)")]
    if doc.get("rates"):
        out += ["", R.table(["TENANT", "ARRIVALS/S", "MEAN_INPUT", "MEAN_OUTPUT"],
                            [[t, R.ratio(v.get("rate_rps")), R.ratio(v.get("mean_input"), 1),
                              R.ratio(v.get("mean_output"), 1)] for t, v in doc["rates"].items()])]
    if doc.get("corrections"):
        out += ["", R.table(["DEVICE/KIND", "FACTOR", "ERROR", "SAMPLES"],
                            [[k, R.ratio(v["factor"], 3), R.percent(v["error"]), v["samples"]]
                             for k, v in doc["corrections"].items()])]
    return "\n".join(out)


def _streams(doc: dict) -> str:
    rows = []
    for st in doc["streams"]:
        if not st["groups"]:
            rows.append([st["name"], st["length"], "-", "-", "-", "-", "-", "-"])
        for g in st["groups"]:
            rows.append([st["name"], st["length"], g["name"], g["consumers"], g["lag"], g["pending"],
                         R.human_ms(g["oldest_pending_idle_ms"]), g["max_deliveries"]])
    out = [R.table(["STREAM", "LENGTH", "GROUP", "CONSUMERS", "LAG", "PENDING", "OLDEST_IDLE", "DELIVERIES"], rows,
                   empty="(no streams under this prefix)")]
    dl = doc["dead_letters"]
    out.append(f"\ndead letters: {dl['count']}" + (f"  by reason: " + ", ".join(
        f"{k}={v}" for k, v in dl["by_reason"].items()) if dl["by_reason"] else ""))
    if dl["recent"]:
        out.append(R.table(["DEAD_ID", "STREAM", "ENTRY", "REQUEST", "REASON"],
                           [[e["id"], e["stream"], e["entry_id"], e["request_id"] or "-", e["reason"][:80]]
                            for e in dl["recent"]]))
    return "\n".join(out)


def _request(doc: dict) -> str:
    head = R.key_values([("request", doc["request_id"]), ("state", doc["state"]), ("tenant", doc["tenant"]),
                         ("expires in", R.human_age(doc["ttl_s"]) if doc["ttl_s"] is not None else "-")]
                        + [(k, v) for k, v in doc["fields"].items() if k not in ("state", "tenant")])
    out = [head, "", R.table(["EVENT", "TIME_UTC", "+MS"],
                             [[e["event"], _utc(e["ts"]), f"{e['t_ms']:.1f}"] for e in doc["timeline"]],
                             empty="(no timestamps)")]
    if doc["devices"]:
        out += ["", R.table(["DEVICE", "STATUS", "OUTCOME"],
                            [[d["device"], d["status"], d["outcome"] or "-"] for d in doc["devices"]])]
    if doc["dead_letters"]:
        out += ["", R.table(["DEAD_ID", "STREAM", "ENTRY", "REASON"],
                            [[e["id"], e["stream"], e["entry_id"], e["reason"][:100]] for e in doc["dead_letters"]])]
    return "\n".join(out)


def _utc(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}"
