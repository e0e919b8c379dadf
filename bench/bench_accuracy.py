"""``slicesched bench accuracy``: the simulator's prediction error against the real CPU mesh.

Runs the real mesh (:mod:`bench.accuracy_mesh`) on two phases: a short synthetic *calibration* load
(:func:`calibration_requests`), then the *measured* arrivals (the first D seconds of a workload file). The
measured arrivals are replayed in the simulator (:mod:`bench.accuracy_sim`) three ways, and a fourth:

* ``profile_only``: the shipped measured CPU profile as it is (what an offline ``slicesched simulate`` uses);
* ``calibrated`` (the headline): as the live simulator service runs it, with per-(device, segment kind)
  correction factors, the serving loop's per-iteration overhead and the request path's latency (client →
  worker, worker → client), all learned from the calibration phase only;
* ``online``: ``calibrated`` plus a causal drift factor per device, an EWMA of measured / predicted segment time
  over the step reports that ended before each moment (what a live twin following the events stream knows);
* ``in_sample`` (a diagnostic, not a prediction): ``calibrated`` with everything learned from the scored phase
  itself — what the model cannot explain even in hindsight.

Before the mesh starts, the machine's own steadiness is timed (:mod:`bench.machine_noise`).

Errors (:mod:`shared.costmodel.accuracy`): per-segment latency MAPE against the mean of each (segment, tokens
bucket), request TTFT/TPOT absolute percentage error, memory over time as a fraction of device capacity.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from shared.config import REPO_CONFIGS, ConfigError, load_cluster, load_tenants
from shared.costmodel.accuracy import (BucketStats, ape, ape_quantiles, constant_floor, memory_timeline_error,
                                       quantile_errors, segment_errors)

DEFAULT_WORKLOAD = REPO_CONFIGS / "workloads" / "tiny-bursty.yaml"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD), help="workload file (docs/loadgen.md)")
    p.add_argument("--cluster", default=str(REPO_CONFIGS / "cluster-tiny.yaml"), help="the mesh's cluster.yaml")
    p.add_argument("--tenants", default=str(REPO_CONFIGS / "tenants-tiny.yaml"), help="the mesh's tenants.yaml")
    p.add_argument("--duration-s", type=float, default=None,
                   help="measured window: arrivals in [0, D) (default 30; with --from-raw, the file's)")
    p.add_argument("--calibration-s", type=float, default=None,
                   help="seconds of synthetic calibration traffic replayed first (0: profile only)")
    p.add_argument("--calibration-from", choices=("synthetic", "trace"), default=None,
                   help="calibration traffic: synthetic Poisson (default) or a later window of the workload's own "
                        "traces (same shape, other requests)")
    p.add_argument("--min-count", type=int, default=20,
                   help="segment buckets with fewer measured executions are left out of the segment MAPE")
    p.add_argument("--json", dest="json_out", default=None, help="write the errors and their detail here")
    p.add_argument("--raw-out", default=None, help="also save the raw mesh measurements (JSON)")
    p.add_argument("--from-raw", default=None, help="analyse saved raw measurements instead of running the mesh")
    p.add_argument("--machine-noise-s", type=float, default=4.0,
                   help="seconds per window length (50 and 200 ms) of timing a fixed computation before the mesh "
                        "starts, to report how steady the machine is (0: skip; else at least 0.6)")


# ---------------------------------------------------------------- measured side, reduced
def measured_segments(m, pool_devices: bool = True) -> dict[tuple, BucketStats]:
    """Measured executions per (segment kind, tokens bucket) in ms (``attn[l]``/``mlp[l]`` pooled over layers;
    over devices too when ``pool_devices``, else keyed by device first)."""
    out: dict[tuple, BucketStats] = {}
    for s in m.segments:
        kind = s.segment.split("[")[0]
        key = (kind, s.tokens_bucket) if pool_devices else (s.device, kind, s.tokens_bucket)
        st = BucketStats(s.count, s.total_ms, s.sumsq_ms)
        out[key] = out[key] + st if key in out else st
    return out


def pool(pred: dict[tuple, BucketStats]) -> dict[tuple, BucketStats]:
    """(device, kind, bucket) -> (kind, bucket), summing executions."""
    out: dict[tuple, BucketStats] = {}
    for (_, kind, b), st in pred.items():
        out[(kind, b)] = out[(kind, b)] + st if (kind, b) in out else st
    return out


def match_requests(m) -> list[tuple[dict, dict]]:
    """Pairs (client record, worker record) of the same request: same tenant and token counts, the worker
    start nearest after the client's send (the gateway's request id is not visible to the client)."""
    pool_: dict[tuple, list[dict]] = {}
    for w in m.worker_requests:
        pool_.setdefault((w["tenant"], w["prompt_tokens"], w["completion_tokens"]), []).append(w)
    pairs = []
    for r in sorted(m.requests, key=lambda r: r["sent_ts"]):
        if r["status"] != "ok":
            continue
        cands = pool_.get((r["tenant"], r["input_tokens"], r["output_tokens"]), [])
        sent = r["sent_ts"] - m.t0_ts
        after = [w for w in cands if w["started"] >= sent - 0.005]
        if after:
            w = min(after, key=lambda w: w["started"])
            cands.remove(w)
            pairs.append((r, w))
    return pairs


def path_latency(m) -> tuple[float, float, float]:
    """Median (client send → worker start, worker first token → client first token, worker finish → client end of
    stream) in seconds. The client's TPOT runs from its first token to the end of the stream, so it is the
    worker's (finish − first token) plus the third minus the second, over (tokens − 1); the third can be below
    zero (the worker stamps its finish after it has published the last token). Without end times in the
    records, the third equals the second (the TPOT is the worker's)."""
    pairs = match_requests(m)
    if not pairs:
        return 0.0, 0.0, 0.0
    d_in = statistics.median(w["started"] - (r["sent_ts"] - m.t0_ts) for r, w in pairs)
    d_out = max(0.0, statistics.median((r["sent_ts"] - m.t0_ts + r["ttft_s"]) - w["first_token"] for r, w in pairs))
    ends = [(r["sent_ts"] - m.t0_ts + r["e2e_s"]) - w["finish"] for r, w in pairs if r.get("e2e_s") is not None]
    return max(0.0, d_in), d_out, statistics.median(ends) if ends else d_out


def solo_groups(m) -> dict[str, dict[tuple, list[tuple[str, float]]]]:
    """Requests that ran alone on their device (no other request there between their worker start and finish),
    grouped by identical work: TTFT by (device, tenant, prompt tokens), TPOT by (device, tenant, prompt tokens'
    power-of-two bucket) — every decode step of such a request is one sequence over a similar context. Values are
    (client request id, client-measured seconds)."""
    from services.worker.core import tokens_bucket

    spans: dict[str, list[tuple[float, float]]] = {}
    for w in m.worker_requests:
        spans.setdefault(w["device"], []).append((w["started"], w["finish"]))
    out: dict[str, dict[tuple, list[tuple[str, float]]]] = {"ttft": {}, "tpot": {}}
    for r, w in match_requests(m):
        a, b = w["started"], w["finish"]
        if sum(1 for s, e in spans[w["device"]] if s < b and e > a) > 1:  # itself, and another
            continue
        if r.get("ttft_s"):
            out["ttft"].setdefault((w["device"], w["tenant"], w["prompt_tokens"]), []).append((r["id"], r["ttft_s"]))
        if r.get("tpot_s"):
            key = (w["device"], w["tenant"], tokens_bucket(w["prompt_tokens"]))
            out["tpot"].setdefault(key, []).append((r["id"], r["tpot_s"]))
    return out


def noise_floor(m, min_size: int = 5) -> dict[str, Any]:
    """Per metric (``ttft``, ``tpot``): the median APE of the best constant predictor of each group of
    :func:`solo_groups` (:func:`constant_floor`), and the request ids scored (for the variants' error on the
    same requests)."""
    out: dict[str, Any] = {}
    for metric, groups in solo_groups(m).items():
        kept = [g for g in groups.values() if len(g) >= min_size]
        out[metric] = constant_floor([[v for _, v in g] for g in kept], min_size) | {
            "ids": sorted(i for g in kept for i, _ in g)}
    return out


def loop_overhead(m) -> dict[str, float]:
    """Per device: seconds per iteration the serving loop spends outside the segments while it has work.

    The time with work is the union of the device's requests' [worker start, finish] intervals; what of it the
    segments do not fill (the engine's step bookkeeping, the worker's hand-off to its compute thread, the
    event loop between steps, waiting for a CPU), divided by the iterations run."""
    active: dict[str, float] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for w in m.worker_requests:
        spans.setdefault(w["device"], []).append((w["started"], w["finish"]))
    for dev, iv in spans.items():
        total, end = 0.0, float("-inf")
        for a, b in sorted(iv):
            if b > end:
                total += b - max(a, end)
                end = b
        active[dev] = total
    seg: dict[str, list[float]] = {}
    for rep in m.reports:
        a = seg.setdefault(rep["device"], [0.0, 0.0])
        a[0] += rep["segment_ms"] / 1e3
        a[1] += rep["steps"]
    return {d: max(0.0, (active[d] - s) / n) for d, (s, n) in seg.items() if n and d in active}


def correction_factors(meas: dict[tuple, BucketStats], pred: dict[tuple, BucketStats],
                       min_bucket: int = 5) -> dict[str, dict[str, float]]:
    """Per device and segment kind: measured / predicted time over the buckets seen on both sides (the factor
    the live CorrectionTable converges to, computed in one batch, weighted by measured executions); and per
    ``kind@bucket`` with at least ``min_bucket`` measured executions, that bucket's own factor (what the live
    table learns under the same key)."""
    num: dict[tuple[str, str], float] = {}
    den: dict[tuple[str, str], float] = {}
    for key, m in meas.items():
        p = pred.get(key)
        if p is None or not p.count:
            continue
        dev, kind, _ = key
        num[(dev, kind)] = num.get((dev, kind), 0.0) + m.total
        den[(dev, kind)] = den.get((dev, kind), 0.0) + m.count * p.mean
    out: dict[str, dict[str, float]] = {}
    for (dev, kind), n in num.items():
        if den[(dev, kind)] > 0:
            out.setdefault(dev, {})[kind] = n / den[(dev, kind)]
    for (dev, kind, bucket), m in meas.items():  # each shape bucket's own factor, where it ran often enough
        p = pred.get((dev, kind, bucket))
        if p is not None and p.count and p.mean > 0 and m.count >= min_bucket:
            out.setdefault(dev, {})[f"{kind}@{bucket}"] = m.mean / p.mean
    return out


def drift(m, per_execution: dict[tuple, float], alpha: float = 0.3) -> dict[str, list[tuple[float, float]]]:
    """Causal drift per device: after each step report, an EWMA of (measured segment time) / (predicted
    segment time) over the report's executions, ``per_execution`` giving the predicted ms of one execution per
    (device, segment kind, bucket). The factor at time t uses only reports that ended before t, as the live
    simulator's correction does."""
    out: dict[str, list[tuple[float, float]]] = {}
    state: dict[str, float] = {}
    for rep in sorted(m.reports, key=lambda r: r["end"]):
        dev, meas, pred = rep["device"], 0.0, 0.0
        for seg, bucket, count, total in rep.get("segments", []):
            p = per_execution.get((dev, seg.split("[")[0], bucket))
            if p:
                meas += total
                pred += count * p
        if pred <= 0:
            continue
        g = meas / pred if dev not in state else (1 - alpha) * state[dev] + alpha * meas / pred
        state[dev] = g
        out.setdefault(dev, []).append((rep["end"], g))
    return out


# ---------------------------------------------------------------- errors of one replay
def evaluate(m, rep, min_count: int, floor: dict[str, Any] | None = None) -> dict[str, Any]:
    """All errors of one simulator replay against one measured phase (with ``floor``, :func:`noise_floor`'s
    result, also the median APE on the requests it scored)."""
    rows, seg = segment_errors(measured_segments(m), pool(rep.segment_predictions()), min_count)
    dev_rows, dev_seg = segment_errors(measured_segments(m, pool_devices=False), rep.segment_predictions(),
                                       min_count)
    ttft, tpot, sim_ttft, real_ttft, sim_tpot, real_tpot = [], [], [], [], [], []
    for r in m.requests:
        p = rep.requests.get(r["id"])
        if r["status"] != "ok" or p is None or r["ttft_s"] is None:
            continue
        ttft.append((p[0], r["ttft_s"]))
        sim_ttft.append(p[0])
        real_ttft.append(r["ttft_s"])
        if r.get("tpot_s") and p[1] is not None:
            tpot.append((p[1], r["tpot_s"]))
            sim_tpot.append(p[1])
            real_tpot.append(r["tpot_s"])
    mem, weights_only = {}, {}
    for d, pts in m.memory.items():
        if pts and d in rep.memory:
            cap = m.capacity_bytes.get(d) or rep.capacity[d]
            mem[d] = memory_timeline_error(rep.memory[d], pts, cap)
            # what a prediction of weights alone (no KV at all) would score: how much KV there was to predict
            weights_only[d] = memory_timeline_error(rep.memory[d][:1], pts, cap)["mean"]
    t_q, p_q = ape_quantiles(ttft), ape_quantiles(tpot)
    solo = {}
    for metric, field, i in (("ttft", "ttft_s", 0), ("tpot", "tpot_s", 1)):
        if floor and floor[metric]["ids"]:
            ids = set(floor[metric]["ids"])
            errs = [ape(rep.requests[r["id"]][i], r[field]) for r in m.requests if r["id"] in ids
                    and rep.requests.get(r["id"]) and rep.requests[r["id"]][i] is not None]
            solo[metric] = {"median_ape": statistics.median(errs) if errs else float("nan"), "requests": len(errs),
                            "noise_floor": floor[metric]["median"]}
    mem_mean = statistics.fmean(v["mean"] for v in mem.values()) if mem else float("nan")
    return {"segment_mape": seg["mape"], "ttft_median_ape": t_q["p50"], "tpot_median_ape": p_q["p50"],
            "memory_error_pct_capacity": mem_mean, "ttft_p90_ape": t_q["p90"], "tpot_p90_ape": p_q["p90"],
            "detail": {
                "segments": {"summary": seg, "min_count": min_count, "rows": [_row(r) for r in rows],
                             "per_device": {"summary": dev_seg, "rows": [_row(r) for r in dev_rows]}},
                "ttft": {"requests": len(ttft), "ape": t_q, "quantile_error": quantile_errors(sim_ttft, real_ttft),
                         "measured_ms": _q(real_ttft), "predicted_ms": _q(sim_ttft)},
                "tpot": {"requests": len(tpot), "ape": p_q, "quantile_error": quantile_errors(sim_tpot, real_tpot),
                         "measured_ms": _q(real_tpot), "predicted_ms": _q(sim_tpot)},
                "solo": solo,
                "memory": {"per_device": mem, "max": max((v["max"] for v in mem.values()), default=float("nan")),
                           "weights_only_baseline": weights_only}}}


def _row(r: dict) -> dict:
    return {"segment": "/".join(str(k) for k in r["key"][:-1]), "tokens_bucket": r["key"][-1], "count": r["count"],
            "measured_ms": r["measured"], "predicted_ms": r["predicted"], "error": r["error"], "cv": r["cv"],
            "rel_se": r["rel_se"]}


def _q(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None}
    s = sorted(values)
    return {"p50": statistics.median(s) * 1e3, "p90": s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3}


def fit(cluster, tenants, phase, requests: list, rounds: int = 3) -> tuple[Any, tuple[float, float, float],
                                                                           dict[str, Any]]:
    """What the calibrated replay learns from one measured phase whose arrivals were ``requests``: the cost model
    per (device, tenant) with per-(device, segment kind [@bucket]) correction factors and the serving loop's
    per-iteration overhead, and the request path's three delays (:func:`path_latency`); with the learned values
    for the report.

    The factors are measured / predicted time per bucket, the prediction taken over the batches a replay ran.
    The batches depend on the times (a slower device batches more), so a replay with the uncorrected profile
    runs other batches than the mesh did; the factors are therefore refitted ``rounds`` − 1 times over the
    batches of a replay with the previous round's factors (each round's prediction in the profile's own units)."""
    from bench.accuracy_sim import replay
    from shared.costmodel import ModelCost, load_profile

    meas = measured_segments(phase, pool_devices=False)
    loop = loop_overhead(phase)
    path = path_latency(phase)
    models = {t.name: t.model.config for t in tenants.tenants}
    kinds = {d.id: d.kind for d in cluster.devices}
    factors: dict[str, dict[str, float]] = {}

    def cost_of(device: str, tenant: str) -> ModelCost:
        prof = load_profile(kinds[device])
        prof = dataclasses.replace(prof, step_overhead_s=loop.get(device, prof.step_overhead_s))
        return ModelCost(models[tenant], prof, factors.get(device, {}))

    for i in range(max(1, rounds)):
        rep = replay(cluster, tenants, requests) if i == 0 else \
            replay(cluster, tenants, requests, cost_of=cost_of, arrival_shift_s=path[0])
        rep.costs = {d: ModelCost(c.config, load_profile(kinds[d])) for d, c in rep.costs.items()}
        factors = correction_factors(meas, rep.segment_predictions())
    learned = {"requests": len(phase.requests), "correction_factors": factors, "step_overhead_s": loop,
               "dispatch_s": path[0], "delivery_s": path[1], "end_of_stream_s": path[2], "fit_rounds": rounds}
    return cost_of, path, learned


def analyse(phases: dict, cluster, tenants, evaluated: list, calibration: list, min_count: int) -> dict[str, Any]:
    """The replays and their errors; the headline is the calibrated one when a calibration phase exists.

    ``in_sample`` is a diagnostic, not a prediction: the calibrated replay with everything learned from the
    scored phase itself. What it still misses is what this model (one factor per segment bucket, one loop
    overhead, one path delay) cannot explain even knowing the phase: per-request timing noise and load-dependent
    effects, as opposed to what changed between the calibration and the scored phase."""
    from bench.accuracy_sim import replay
    from shared.costmodel import load_profile

    run = phases["run"]
    plain = replay(cluster, tenants, evaluated)
    floor = noise_floor(run)
    out: dict[str, Any] = {"profile_only": evaluate(run, plain, min_count, floor)}
    if "calibration" in phases and calibration:
        cost_of, (d_in, d_out, d_done), learned = fit(cluster, tenants, phases["calibration"], calibration)
        calibrated = replay(cluster, tenants, evaluated, cost_of=cost_of, arrival_shift_s=d_in, delivery_s=d_out,
                            done_s=d_done)
        out["calibrated"] = evaluate(run, calibrated, min_count, floor)
        per_exec = {k: st.mean for k, st in calibrated.segment_predictions().items()}
        trend = drift(run, per_exec)
        online = replay(cluster, tenants, evaluated, cost_of=cost_of, arrival_shift_s=d_in, delivery_s=d_out,
                        done_s=d_done, drift=trend)
        out["online"] = evaluate(run, online, min_count, floor)
        out["online"]["drift"] = {d: {"mean": statistics.fmean(g for _, g in pts), "min": min(g for _, g in pts),
                                      "max": max(g for _, g in pts)} for d, pts in trend.items()}
        out["calibration"] = learned | {"profile_step_overhead_s": {d.id: load_profile(d.kind).step_overhead_s
                                                                    for d in cluster.devices}}
    own_cost, (i_in, i_out, i_done), own = fit(cluster, tenants, run, evaluated)
    out["in_sample"] = evaluate(run, replay(cluster, tenants, evaluated, cost_of=own_cost, arrival_shift_s=i_in,
                                            delivery_s=i_out, done_s=i_done), min_count, floor)
    out["in_sample"]["learned"] = own
    head = out.get("calibrated", out["profile_only"])
    out["noise_floor"] = {k: {x: v[x] for x in ("median", "items", "groups")} for k, v in floor.items()}
    return {k: head[k] for k in ("segment_mape", "ttft_median_ape", "tpot_median_ape", "memory_error_pct_capacity",
                                 "ttft_p90_ape", "tpot_p90_ape")} | {
        "headline": "calibrated" if "calibrated" in out else "profile_only", **out}


# ---------------------------------------------------------------- the command
NOISE_WINDOWS_S = (0.05, 0.2)  # about one TTFT and one request's decode on the default mesh


def measure_machine_noise(seconds: float) -> list[dict[str, float]]:
    """How steady the machine is before the mesh starts (:mod:`bench.machine_noise`), per window length."""
    from bench.machine_noise import steadiness

    if seconds <= 0:
        return []
    print(f"timing a fixed computation for {seconds * len(NOISE_WINDOWS_S):g} s (machine steadiness) ...",
          file=sys.stderr)
    return [steadiness(seconds, w) for w in NOISE_WINDOWS_S]


def calibration_requests(tenants, seconds: float, rate_rps: float = 2.0, seed: int = 12345) -> list:
    """Synthetic calibration traffic: every tenant gets Poisson arrivals at ``rate_rps`` for ``seconds`` with
    prompts of 16–256 and outputs of 8–64 tokens (uniform), so every device runs decode batches and prefills of
    many sizes. Deterministic for a seed; never the measured arrivals."""
    import random

    from shared.workload import WorkloadRequest

    rng = random.Random(seed)
    out = []
    for t in tenants.tenants:
        at, n = rng.expovariate(rate_rps), 0
        while at < seconds:
            out.append(WorkloadRequest(f"cal-{t.name}-{n}", at, t.name, rng.randint(16, 256), rng.randint(8, 64)))
            at += rng.expovariate(rate_rps)
            n += 1
    return sorted(out, key=lambda r: r.arrival_s)


def trace_calibration_requests(workload_file: str, seconds: float, gap_s: float = 300.0) -> list:
    """Calibration traffic shaped like the measured phase: the same workload file (traces, popularity, rate,
    caps) from a later window of each tenant's trace — its offset moved past the workload's duration by ``gap_s``
    — and another seed, so no measured request is among them."""
    import dataclasses

    from loadgen.workload import read_workload_spec, workload_from_spec
    from shared.workload import WorkloadRequest

    spec = read_workload_spec(workload_file)
    base = workload_from_spec(spec)
    shift = spec.duration_s + gap_s
    offsets = {t: m["offset_s"] + shift for t, m in base.meta["tenants"].items()}
    cal = workload_from_spec(dataclasses.replace(spec, offsets=offsets, duration_s=seconds, seed=spec.seed + 1))
    return [WorkloadRequest(f"cal-{r.request_id}", r.arrival_s, r.tenant, r.input_tokens, r.output_tokens)
            for r in cal.requests if r.arrival_s < seconds]


def measured_arrivals(workload_file: str, duration_s: float) -> tuple[Any, list]:
    """(workload, its arrivals in [0, D))."""
    from services.cli.simulate import load_workload_file

    w = load_workload_file(workload_file, None)
    evaluated = [r for r in w.requests if r.arrival_s < duration_s]
    if not evaluated:
        raise ConfigError(workload_file, "traces", f"no arrivals in the first {duration_s:g} s")
    return w, evaluated


def _fmt(x: float | None) -> str:
    return "–" if x is None or x != x else f"{x:.1%}"


VARIANT_LABELS = {"profile_only": "profile only", "calibrated": "calibrated", "online": "online",
                  "in_sample": "in-sample fit (diagnostic)"}


def print_report(res: dict[str, Any]) -> None:
    variants = [v for v in ("profile_only", "calibrated", "online", "in_sample") if v in res]
    labels = " | ".join(VARIANT_LABELS[v] for v in variants)
    print(f"| error | target | {labels} |")
    print("|---|---|" + "---:|" * len(variants))
    for key, label, target in (("segment_mape", "per-segment latency MAPE", "≤ 10%"),
                               ("ttft_median_ape", "TTFT median APE", "≤ 10%"),
                               ("ttft_p90_ape", "TTFT p90 APE", ""),
                               ("tpot_median_ape", "TPOT median APE", "≤ 10%"),
                               ("tpot_p90_ape", "TPOT p90 APE", ""),
                               ("memory_error_pct_capacity", "memory error (mean, % of capacity)", "≤ 5%")):
        print(f"| {label} | {target} | " + " | ".join(_fmt(res[v][key]) for v in variants) + " |")
    nf = res.get("noise_floor") or {}
    if any(v["items"] for v in nf.values()):
        print("\nrequests alone on their device, grouped by identical work: the noise floor (best one-value-per-group "
              "predictor) against each variant on the same requests")
        print(f"| metric | requests | noise floor | {labels} |")
        print("|---|---:|---:|" + "---:|" * len(variants))
        for k, label in (("ttft", "TTFT median APE"), ("tpot", "TPOT median APE")):
            if nf.get(k, {}).get("items"):
                print(f"| {label} | {nf[k]['items']} | {_fmt(nf[k]['median'])} | " + " | ".join(
                    _fmt(res[v]["detail"]["solo"].get(k, {}).get("median_ape")) for v in variants) + " |")
    for n in res.get("machine_noise") or []:
        print(f"\nmachine steadiness (one fixed single-threaded computation in {n['windows']} windows of "
              f"{n['window_s'] * 1e3:g} ms, before the mesh started): median deviation from the median window "
              f"{_fmt(n['median_abs_dev'])} (what a perfect predictor of fixed work scores), p10 {n['p10']:.2f}× / "
              f"p90 {n['p90']:.2f}× the median, consecutive windows correlated {n['lag1_autocorr']:.2f}")
    seg = res[res["headline"]]["detail"]["segments"]
    print(f"\nsegment buckets scored: {seg['summary']['keys']} (≥ {seg['min_count']} executions); noise floor of "
          f"the measured means {_fmt(seg['summary']['noise_floor'])}")
    print("| segment | tokens ≤ | executions | measured ms | predicted ms | error | per-execution CV |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in seg["rows"]:
        print(f"| {r['segment']} | {r['tokens_bucket']} | {r['count']} | {r['measured_ms']:.3f} | "
              f"{r['predicted_ms']:.3f} | {r['error']:+.1%} | {r['cv']:.2f} |")


def run(args: argparse.Namespace) -> int:
    from bench.accuracy_mesh import MeshMeasurement, run_mesh
    from services.cli.profile import machine_description
    from shared.costmodel import load_profile

    saved: dict = {}
    if args.from_raw and Path(args.from_raw).is_file():  # the phase lengths the measurements were taken with
        try:
            saved = json.loads(Path(args.from_raw).read_text()).get("settings") or {}
        except (ValueError, AttributeError):
            saved = {}
    if getattr(args, "calibration_from", None) is None:
        args.calibration_from = saved.get("calibration_from", "synthetic")
    elif args.from_raw and args.calibration_from != saved.get("calibration_from", "synthetic"):
        print(f"slicesched bench accuracy: --calibration-from {args.calibration_from} differs from the "
              f"{saved.get('calibration_from', 'synthetic')} the raw measurements in {args.from_raw} were taken with",
              file=sys.stderr)
        return 2
    for name, default in (("duration_s", 30.0), ("calibration_s", 10.0)):
        if getattr(args, name) is None:
            setattr(args, name, float(saved.get(name, default)))
        elif name in saved and float(saved[name]) != getattr(args, name):
            print(f"slicesched bench accuracy: --{name.replace('_', '-')} {getattr(args, name):g} differs from the "
                  f"{saved[name]:g} the raw measurements in {args.from_raw} were taken with", file=sys.stderr)
            return 2
    shortest = round(3 * max(NOISE_WINDOWS_S), 6)
    if args.duration_s <= 0 or args.calibration_s < 0 or args.min_count < 1 or not (
            args.machine_noise_s == 0 or args.machine_noise_s >= shortest):
        print("slicesched bench accuracy: --duration-s must be positive, --calibration-s >= 0, --min-count >= 1 "
              f"and --machine-noise-s 0 or >= {shortest:g} (three windows of the longest)", file=sys.stderr)
        return 2
    if args.from_raw and not Path(args.from_raw).is_file():
        raise ConfigError(args.from_raw, "(file)", "raw measurements file not found")
    cluster = load_cluster(args.cluster)
    tenants = load_tenants(args.tenants, cluster)
    w, evaluated = measured_arrivals(args.workload, args.duration_s)
    if args.calibration_s <= 0:
        calib = []
    elif args.calibration_from == "trace":
        calib = trace_calibration_requests(args.workload, args.calibration_s)
    else:
        calib = calibration_requests(tenants, args.calibration_s)
    missing = sorted({r.tenant for r in evaluated + calib} - set(tenants.names()))
    if missing:
        raise ConfigError(args.tenants, "tenants", f"the workload's tenant {missing[0]!r} is not served by this mesh")
    t0 = time.perf_counter()
    if args.from_raw:
        try:
            raw = json.loads(Path(args.from_raw).read_text())
            phases = {k: MeshMeasurement.from_dict(v) for k, v in raw["phases"].items()}
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(args.from_raw, "phases", f"not raw measurements of this bench: {e!r}") from None
        if "run" not in phases:
            raise ConfigError(args.from_raw, "phases.run", "missing: the measured phase")
        calib = calib if "calibration" in phases else []
        noise = raw.get("machine_noise") or []
    else:
        noise = measure_machine_noise(args.machine_noise_s)
        plan = ([("calibration", calib)] if calib else []) + [("run", evaluated)]
        print(f"running the CPU mesh: {len(calib)} calibration + {len(evaluated)} measured requests ...",
              file=sys.stderr)
        phases = run_mesh(args.cluster, args.tenants, plan)
        if args.raw_out:
            Path(args.raw_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.raw_out).write_text(json.dumps({
                "settings": {"workload": args.workload, "duration_s": args.duration_s,
                             "calibration_s": args.calibration_s, "calibration_from": args.calibration_from},
                "phases": {k: v.to_dict() for k, v in phases.items()}, "machine_noise": noise}))
    mesh_s = time.perf_counter() - t0
    res = analyse(phases, cluster, tenants, evaluated, calib, args.min_count)
    prof = load_profile(cluster.devices[0].kind)
    res.update(workload=args.workload, duration_s=args.duration_s, calibration_s=args.calibration_s if calib else 0,
               calibration_from=args.calibration_from if calib else None,
               requests=len(evaluated), machine=machine_description("cpu"),
               date=time.strftime("%Y-%m-%d", time.gmtime()), wall_s=time.perf_counter() - t0, mesh_s=mesh_s,
               profile={"kind": prof.kind, "source": prof.source, "file": prof.file},
               machine_load={k: {x: v.meta.get(x) for x in ("loadavg_1m", "machine_busy")} for k, v in phases.items()},
               machine_noise=noise)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=1, default=str))
    print_report(res)
    return 0
