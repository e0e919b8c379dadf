"""Render docs/reliability.md from the reliability suite's results file (one JSON object per row, variant, seed).

    .venv/bin/python -m tests.reliability.report          # render from the last results
    .venv/bin/python -m tests.reliability.report --run    # run the slow suite first (pytest -m slow), then render

Only the standard library here, so rendering works without the test dependencies.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("SLICESCHED_RELIABILITY_RESULTS", REPO / ".data" / "reliability" / "results.json"))
DOC = REPO / "docs" / "reliability.md"

# the figures each row reports beside the common columns (RELIABILITY.md's "figures to report")
FIGURES = {
    "1": ["worker_restart_s", "reexecuted", "late_chunks"],
    "2": ["late_chunks", "reexecuted"],
    "3": ["long_e2e_max_s", "spurious_worker_failed", "max_times_delivered_worker_streams", "reexecuted"],
    "4": ["restart_s"],
    "5": ["drain_s", "restart_s"],
    "6": ["acked_before_kill", "acked_writes_lost", "loss_window_ms", "http_503", "http_503_with_retry_after",
          "groups_recreated"],
    "7": ["e2e_max_s", "paused_s"],
    "8": ["e2e_max_s", "half_open_conns", "detection_first_s", "detection_median_s", "connections_reset"],
    "9": ["cancelled_by_client", "mixups", "verification_ok", "leaked_slots", "time_to_free_slots_s",
          "protocol_errors_in_logs"],
    "10": ["p99_ok_s", "error_rate", "log_events", "gateway_restarted"],
    "11": ["backlog", "drain_s", "stream_len_after_trim", "xautoclaim_deleted_ids", "pending_entry_deleted_logs"],
    "12": ["injected", "dead_lettered", "requesters_told", "consumer_crashes"],
    "13": ["xadds", "replayed", "results_per_request_max", "started_per_request_max", "requests_pending_after"],
    "16": ["capacity_rps", "offered_rps", "goodput_rps", "reject_rate", "accepted_ttft_p99_s",
           "accepted_tpot_p99_s", "accepted_sla_met", "peak_rss_mb"],
    "17": ["started_at_all", "started_after_deadline", "wasted_gpu_s"],
    "18": ["poison", "engine_faults", "collateral_failures", "retries_per_job_max", "kv_reservations_after",
           "kv_blocks_free_after"],
    "22": ["failover_s", "same_master", "acked_plain", "acked_plain_lost", "acked_waited", "acked_waited_lost"],
}
ELSEWHERE = {
    "14": ("HTTP bad input (fuzz)", "tests/integration/gateway/test_gateway_errors.py::test_bad_input, "
           "tests/integration/gateway/test_gateway_fuzz.py::test_fuzz_http_api_1000 (no 5xx, JSON error bodies)"),
    "15": ("client disconnects mid-stream", "tests/integration/gateway/test_gateway.py::"
           "test_disconnect_mid_stream_sends_cancel and ::test_cancellation_storm_then_no_mixups; end to end "
           "(slots and KV freed) in row 9 below"),
    "19": ("tenant isolation", "tests/e2e/test_mesh_openai.py::test_key_reaches_only_its_tenant (security work)"),
    "20": ("auth / Redis ACL users", "tests/integration/test_redis_acl.py (security work)"),
    "21": ("exposure at default config", "tests/e2e/test_exposure.py (every listener of the mesh on loopback, Redis "
           "protected), tests/unit/deploy/test_compose_file.py::test_only_the_gateway_is_published_and_on_loopback"),
    "22": ("Redis failover (a Redis Cluster master killed, its replica promoted)",
           "tests/reliability/test_failover.py (not in this run)"),
}
REDIS_KIND = {"server": "one server", "cluster": "cluster 3x2"}
HEADLINE_ROWS = {"1", "2", "3", "4", "5", "6", "7", "8", "11", "12", "13", "22"}
REPLICATION = """## Redis failover: what replication can lose

Row 22 runs the mesh on a Redis Cluster (3 masters, one replica each, node timeout 2 s) and kills a master under
load; its replica takes over (`failover_s`: kill until the replica serves the slot; the killed node then rejoins as a
replica). Reproduce: `.venv/bin/pytest -m slow tests/reliability/test_failover.py` (about 3 minutes). Redis replicates
asynchronously: a master acknowledges a write before its replica has it, so a master that dies loses the writes of
the last moments, acknowledged or not. Two harness writers on the killed master measure that window: `plain`
XADDs every 5 ms, `waited` the same followed by `WAIT 1` on the same connection. On loopback the replica is
usually less than a millisecond behind, so the plain writer lost none in these runs: that says the window is short
here, not that it is empty (across a network, or with a busy replica, it is longer). The row 22 runs shared the
2-core VM with other test runs (load average 10-12): most refusals are the adaptive SLA limit's `503
tenant_saturated`, and accepted requests took 1.1-1.7 s (p50) against 0.3-0.5 s on a quiet machine.

What the mesh does about it:

- Writes that hand a request from one party to the next, after which the writer forgets it, wait for a replica
  (`WAIT 1`, at most `SLICESCHED_REDIS_WAIT_MS`, default 100 ms; `shared/redis_util.run_pipeline`): the gateway's
  `InferenceRequest` (before the request counts as accepted), the scheduler's `AssignRequest` (before it acks the
  request entry) and every `RequestError` it publishes, a worker's last chunk of a request and its errors, its
  `RequestFinished` (the scheduler frees the request's KV on it), every terminal-state claim (the fence that makes
  one result per request), and GMG memory commits and releases. A master's replication stream is ordered, so a WAIT
  also covers every earlier write to that master, the request's earlier token chunks included.
- Writes that are repeated anyway, or whose loss shows, go without: heartbeats, step reports, the GMG's live device
  state (rewritten within 0.5 s; a lost change shows as a gap in GMG epochs and followers reload), acks and
  consumer-group positions (a lost ack re-delivers the entry, and every handler is idempotent), and mid-stream token
  chunks (the last chunk's WAIT covers them, unless their master dies before that chunk is written: below).
- What remains: a WAIT that times out (the replica is down or more than 100 ms behind) lets the write go on
  unreplicated (logged `redis_write_unreplicated`; that master is not waited on for 5 s); a mid-stream chunk lost
  with its master leaves a gap the gateway fills with a retryable `502 stream_gap` once the final chunk has waited
  2 s; killing a master and its replica together loses that slot range until one returns (its AOF). A replica
  promoted on another host stamps new stream entries with its own clock: readers that follow a stream by position
  (gateways, GMG followers) need the hosts' clocks within the failover time of each other (seconds).

A deployment with one Redis server has no failover; why the mesh offers the cluster rather than Sentinel:
[deployment.md](deployment.md#kubernetes) ("No Sentinel").
"""

FINDINGS = """## What the rows found, and what changed

- Row 22 (Redis failover) and the cluster runs: redis-py 8.1's cluster pipeline refuses EVALSHA, and its MULTI
  handed a keys hint to response callbacks that do not take it (the GMG follower's snapshot failed on SMEMBERS);
  scripts now run as raw EVALSHA with a reload on NOSCRIPT, and the pipeline drops the hint. The scheduler's
  assignment MULTI spanned two slots; it is a plain pipeline now (a restarted scheduler checks each request's
  hash). The client's slot map lists a replica only if it had synced when the map was made, so the WAITs were first
  skipped on every master; which masters have a replica is now asked every 5 s (`CLUSTER SLOTS`). During a failover
  (3.4-4.3 s with a 2 s node timeout) a few running requests per run (0-10) end with a retryable `worker_failed`:
  heartbeats were not written or read for longer than the scheduler's 3 s staleness window. Not changed.
- Row 2 (stalled worker): the scheduler fails the requests of a worker silent for 3 s, but the worker, once
  resumed, still published their final chunks: two terminal results for one request on the tokens stream. Now the
  single move of a request to a terminal state is claimed with one Lua script on its `req:{id}` hash
  (`TerminalFence` in `shared/requests_state.py`); only the claimant publishes the result (worker final chunks and
  errors, scheduler failures, deadlines, poison entries). Late chunks of a fenced request are dropped by the gateway
  (unknown request) and counted by `slicesched_worker_fenced_results_total` when final.
- Row 6 (Redis killed): a Redis error inside the worker's compute loop ended the loop, so the worker stopped and was
  restarted (its in-flight requests failed); a failed token publish dropped that step's chunks and never ended the
  finished requests (hung until the gateway's idle timeout, KV never released). Now the worker retries publishing
  and ending a request (every step idempotent) and treats `RequestStarted` as best effort.
- Row 6 with AOF off: Redis restarts empty. The GMG registers the cluster again, workers reserve their weights
  again when the reservation is gone, and the scheduler ends assignments whose request hash vanished with a
  retryable 503 `state_lost` instead of keeping them forever (their clients used to get the 60 s idle timeout).
- Row 4 (GMG killed): the scheduler judged devices only by the heartbeat the GMG relays, so a GMG restart longer than
  3 s failed healthy workers' requests; it now also counts heartbeats it reads itself on the events stream.
- Row 13 (duplicate XADD): the second copy of a queued request stayed pending until the 60 s reclaim; copies are
  now acknowledged at once (only the scheduler's own entry, when re-delivered, stays pending).
- Row 18 (engine exception): a failing step failed every request in the engine, waiting ones included; now only
  the batch that ran. A poison request still takes its whole batch down (see `collateral_failures`): isolating it
  needs the engine to retry a failed step on part of the batch.
- Row 11 (backlog): worker streams (`worker:{device}`) were never trimmed, because workers ran no reclaim/trim loop
  (one acked entry per request stayed forever); workers now run the stream library's reclaim loop, which trims by
  MINID below the oldest pending entry.
- Row 6 (Redis restarted): for a few seconds after Redis returns, the devices' last heartbeats are older than the
  3 s staleness window, so requests still running may be failed with a retryable `worker_failed` (see row 6's
  errors); a scheduler that has just reconnected could wait one heartbeat interval first. Not changed.
- Row 16 (overload): admission bounds the predicted time to first token, not the time per output token: at 2x
  capacity the accepted requests kept their TTFT target but about a quarter missed the 100 ms TPOT target
  (`accepted_sla_met`); at 5x far more is turned away and nearly all accepted requests meet both. Not changed.
- Around short Redis faults (rows 6-8) the gateway's saturation check turns many requests away with 503
  `tenant_saturated` (with Retry-After) while accepted ones finish within seconds: the price of never queueing
  past the TTFT target. Not changed.
- Not exercised: the stream reclaim idle time (60 s) is longer than any generation these runs produce; worker
  streams have a fixed owner, so row 3 checks the 3 s heartbeat failure detector instead."""


RESTARTS = """## Restarts and config changes

Services read the cluster and tenants files at start: a changed file takes effect when the services restart
(`slicesched up` again, or a rollout). At every start the GMG service (`services/gmg/reconcile.py` decides,
`services/gmg/housekeeping.py` does the I/O) compares what Redis holds under the prefix with the files and removes
what no longer belongs to them, before it registers the cluster; leases are closed through their atomic close, the
rest of the GMG in one atomic `reconcile` change (epoch bump and change-stream entry, so followers replay it). The
`gmg_reconciled` log line names the removed tenants and devices and counts the rest.

| state | kept | dropped |
|---|---|---|
| devices: `{gmg}:device:{id}` and every per-device GMG key (reservations, residency, pins, leases, execution, running and finished records, busy intervals) | configured devices (registry refreshed, live fields kept) | devices not in the cluster file |
| tenants: `{gmg}:tenant:{name}`, model graph | configured tenants | tenants not in the tenants file |
| home weights `weights:{t}:home` | on a home device of `t` (its worker resizes it when `t`'s model changed) | anywhere else; `t` removed |
| staged weights `weights:{t}:{segment}` and their residency | `t` configured with the same model (`model_id` in the tenant hash), the segment in the model with the same size, the device not `t`'s home | otherwise |
| residency `{t}\\|{segment}` | on `t`'s homes (rewritten for the current model), or staged and kept | otherwise, with its pins |
| leases | tenant, guest and home configured, the guest not the tenant's home, model unchanged, segments in the model | closed (`lease_revoked`: reservation freed, pins released) |
| KV `kv:{request}`, running records `{gmg}:reqs:{d}` | the request has not ended | the request ended, its journey is gone, or its tenant was removed |
| `sched:tenant:{t}`, `sim:rates` fields | configured tenants | removed tenants |
| `sim:forecast:{d}`, `sim:corrections` fields | configured devices | removed devices |
| request journeys `req:{id}` | all, until their TTL (1 h once ended) | - |
| streams | `requests`, `events`, `dead`, configured devices' worker streams, live gateways' tokens streams | tokens streams of dead gateways, worker streams of removed devices, idle what-if reply streams, once `SLICESCHED_STREAM_EXPIRY_S` (300 s) passed without an entry and without the owner's health key (checked by the GMG every half expiry, at most 30 s) |

Where removal could lose work, the GMG does not remove: while a worker of the old config still runs (its health key
names a device not in the cluster file, or a tenant other than the device's configured home), it waits up to
`SLICESCHED_RECONCILE_WAIT_S` (10 s; a killed worker's health key lapses within 5 s) and then refuses to start
(exit 2) naming the device, the worker's pid and the tenant: `gmg: refusing to start: device 'cpu2' is not in
cluster.yaml but its worker (pid 4242) is still running: removing the device would lose the requests it runs; stop
that worker first`.

Requests of what was removed end with a clear error to their gateway: at its start the scheduler ends the requests
it had placed for a removed tenant with 404 `tenant_removed` and those placed on a removed device with a retryable
503 `device_removed` (their KV released); a removed tenant's request still in the requests stream is refused with
400 `unknown_tenant`; a worker handed an assignment of a removed tenant ends it with 404 `tenant_removed`.

After a SIGKILL of the whole mesh (services and Redis; AOF `everysec` keeps every acknowledged write), a restart
recovers as the fault matrix asks: requests still in the scheduler's pending list are placed again; requests
placed on a worker that is gone end with a retryable 503 `worker_failed` (the worker id changed) and their KV is
released; leases expire; the killed gateway's tokens stream expires. Tests: `tests/e2e/test_restart_reconcile.py`
(a changed cluster and tenants file on one data dir; a SIGKILL of the whole mesh, then a changed tenants file),
`tests/integration/test_gmg_reconcile.py`, `tests/integration/test_scheduler_restart.py`,
`tests/unit/gmg/test_reconcile.py`."""


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict):
        if all(isinstance(x, (int, float)) for x in v.values()):
            nonzero = {k: x for k, x in v.items() if x}
            return ", ".join(f"{k} {_fmt(x)}" for k, x in nonzero.items()) or "all 0"
        return json.dumps(v, sort_keys=True)
    return str(v)


def _row_key(row: str) -> int:
    return int(row) if row.isdigit() else 999


def render(rows: list[dict]) -> str:
    by_row: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_row[r["row"]].append(r)
    seeds = sorted({r["seed"] for r in rows})
    dates = sorted({r["date"] for r in rows})
    total = sum(r["accepted"] for r in rows if r["row"] in HEADLINE_ROWS)
    lost = sum(r["lost"] for r in rows if r["row"] in HEADLINE_ROWS and "AOF off" not in r["variant"])
    lost_off = sum(r["lost"] for r in rows if "AOF off" in r["variant"])
    dup = sum(r["duplicated"] for r in rows)
    out = [
        "# Reliability: measured figures per fault",
        "",
        "Generated by `.venv/bin/python -m tests.reliability.report` from the results the slow suite writes; "
        "`.venv/bin/python -m tests.reliability.report --run` runs the suite (`pytest -m slow tests/reliability`) "
        "first and then renders this page. How the suite works and what each figure means: "
        "[operations.md](operations.md#reliability-suite).",
        "",
        f"Machine: 2-core CPU VM, no GPU ({platform.machine()}); mesh: `slicesched up` with the default configs "
        "and the default policy, `slice` (row 17 pins `container`: it needs requests to wait in the scheduler's "
        "queue, which `slice` serves on a lane instead), two CPU workers running the tiny model with real torch "
        "compute, tenants tiny-a and tiny-b, a private "
        "redis-server 7.0 the harness controls (row 22, and rows marked `cluster 3x2`: a private Redis Cluster of 3 "
        "masters with one replica each). Date: " + ", ".join(dates) + f". Seeds: {seeds}.",
        "",
        "Definitions (RELIABILITY.md): **accepted** = the gateway began streaming / answered 200, or the request "
        "reached the requests stream (a 429/503 before that is a rejection); **lost** = accepted without a final "
        "chunk or an explicit error within the deadline (the gateway's own idle timeout counts as lost); "
        "**duplicated** = more than one distinct terminal result on the gateway's tokens stream, or in the "
        "client's response; **recovery** = from the fault until a probe request succeeded three times in a row "
        "and every accepted request sent before that had its outcome; **5xx** = HTTP responses with a 5xx status "
        "(errors after streaming began are SSE error events, listed under errors).",
        "",
        f"**Headline** (rows 1-8, 11-13, 22): lost **{lost}/{total}** accepted"
        + (f" (plus {lost_off} with AOF off, the documented window)" if lost_off else "")
        + f"; duplicated results **{dup}** across all rows.",
        "",
        "Scale: the matrix asks N >= 1000 per row and 3 seeds. One pass of every row took 17 minutes on this "
        "machine (`--run`, 24 tests), so the default is one seed: 1,000 requests per fault row (1, 2, 4-8, 9, 13; row 10 bursts "
        "2,560, row 11 holds a 3,000-request backlog) and fewer where the figure is not a loss rate (3, 12, 16-18). "
        "`SLICESCHED_REL_SEEDS=1,2,3` runs three seeds (about an hour; each table then gains a median / worst "
        "line), `SLICESCHED_REL_SCALE` multiplies every row's size.",
        "",
        "## Coverage of the matrix",
        "",
        "| # | fault | where |",
        "|---|---|---|",
    ]
    titles = {r["row"]: r["title"] for r in rows}
    for n in range(1, 23):
        k = str(n)
        if k in by_row:
            out.append(f"| {k} | {titles[k]} | measured below |")
        elif k in ELSEWHERE:
            out.append(f"| {k} | {ELSEWHERE[k][0]} | {ELSEWHERE[k][1]} |")
        else:
            out.append(f"| {k} | - | not measured in this run |")
    for k in sorted(by_row, key=_row_key):
        rs = sorted(by_row[k], key=lambda r: (r["variant"], r.get("redis", "server"), r["seed"]))
        out += ["", f"## Row {k}: {rs[0]['title']}", ""]
        figs = FIGURES.get(k, [])
        kinds = {r.get("redis", "server") for r in rs} != {"server"}  # a column only where a cluster ran the row
        head = ["variant"] + (["redis"] if kinds else []) + ["seed", "requests", "accepted", "lost", "dup",
                                                             "recovery s", "5xx", "errors"] + figs
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in rs:
            cells = [r["variant"] or "-"] + ([REDIS_KIND[r.get("redis", "server")]] if kinds else []) + [
                r["seed"], r["requests"], r["accepted"], r["lost"], r["duplicated"], r["recovery_s"], r["http_5xx"],
                r["errors"] or "-"] + [r["extra"].get(f) for f in figs]
            out.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
        for variant in sorted({r["variant"] for r in rs}):
            vs = [r for r in rs if r["variant"] == variant]
            if len(vs) > 1:
                rec = [r["recovery_s"] for r in vs if r["recovery_s"] is not None]
                out.append(f"\n{variant or 'all'}: lost median {statistics.median(r['lost'] for r in vs):g} worst "
                           f"{max(r['lost'] for r in vs)}; recovery median "
                           f"{_fmt(statistics.median(rec)) if rec else '-'} s worst {_fmt(max(rec)) if rec else '-'} s")
        notes = sorted({r["notes"] for r in rs if r["notes"]})
        for note in notes:
            out.append(f"\n{note}")
        http = defaultdict(int)
        for r in rs:
            for code, n in r["extra"].get("http_errors", {}).items():
                http[code] += n
        if http:
            out.append("\nHTTP errors (all runs): " + ", ".join(f"{c} x{n}" for c, n in sorted(http.items())))
    if "22" in by_row:
        out += ["", REPLICATION.rstrip()]
    out += ["", FINDINGS, "", RESTARTS, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.reliability.report", description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run the slow reliability suite first")
    ap.add_argument("--results", default=str(RESULTS), help=f"results file (default {RESULTS})")
    ap.add_argument("--out", default=str(DOC), help=f"page to write (default {DOC})")
    ap.epilog = "Any other argument goes to pytest with --run, in order (e.g. -k row6, -x)."
    raw = sys.argv[1:] if argv is None else list(argv)
    own, rest, i = [], [], 0
    while i < len(raw):  # this command's options; everything else (-k EXPR, -x, ...) is pytest's, kept in order
        a = raw[i]
        if a in ("--run", "-h", "--help"):
            own.append(a)
        elif a in ("--results", "--out") and i + 1 < len(raw):
            own += raw[i:i + 2]
            i += 1
        elif a.startswith(("--results=", "--out=")):
            own.append(a)
        else:
            rest.append(a)
        i += 1
    args = ap.parse_args(own)
    if rest and not args.run:
        ap.error(f"unrecognized arguments: {' '.join(rest)} (pytest arguments need --run)")
    args.pytest_args = rest
    results = Path(args.results)
    if args.run:
        env = dict(os.environ, SLICESCHED_RELIABILITY_RESULTS=str(results))
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "slow", "tests/reliability",
                              *args.pytest_args], cwd=REPO, env=env)
        print(f"reliability suite: exit {rc} after {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if not results.exists():
        print(f"no results at {results}: run with --run first", file=sys.stderr)
        return 2
    Path(args.out).write_text(render(json.loads(results.read_text())))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
