#!/usr/bin/env python3
"""Build ``slicesched-dashboard.json`` (Grafana) from the panel list below.

    python3 deploy/grafana/build_dashboard.py           # rewrite the JSON next to this file
    python3 deploy/grafana/build_dashboard.py --check   # exit 1 if the JSON is not what this script builds

``METRICS`` lists every metric the dashboard queries, with its type and labels; the test suite checks it against
the metric definitions in ``services/`` and ``shared/`` and every query against it. To add a metric: add it to
``METRICS``, give it a panel in :func:`panels`, run this script. Stdlib only.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "slicesched-dashboard.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
T = 'tenant=~"$tenant"'
D = 'device=~"$device"'

# name -> (type, label names)
METRICS: dict[str, tuple[str, frozenset[str]]] = {
    name: (kind, frozenset(labels)) for name, kind, labels in [
        # per tenant (gateway, scheduler, workers)
        ("slicesched_ttft_seconds", "histogram", {"tenant"}),
        ("slicesched_tpot_seconds", "histogram", {"tenant"}),
        ("slicesched_e2e_seconds", "histogram", {"tenant"}),
        ("slicesched_sla_violations_total", "counter", {"tenant"}),
        ("slicesched_requests_total", "counter", {"tenant", "outcome"}),
        ("slicesched_gateway_inflight", "gauge", {"tenant"}),
        ("slicesched_queue_depth", "gauge", {"tenant"}),
        ("slicesched_scheduler_admitted_total", "counter", {"tenant", "device"}),
        ("slicesched_scheduler_failed_total", "counter", {"tenant", "code"}),
        ("slicesched_worker_tokens_total", "counter", {"device", "tenant"}),
        ("slicesched_worker_fenced_results_total", "counter", {"device"}),
        # per device, leases
        ("slicesched_device_busy_ratio", "gauge", {"device"}),
        ("slicesched_device_memory_bytes", "gauge", {"device", "kind"}),
        ("slicesched_leases_total", "counter", {"event"}),
        ("slicesched_gmg_leases_expired_total", "counter", set()),
        # control plane
        ("slicesched_scheduler_decision_seconds", "histogram", set()),
        ("slicesched_sim_prediction_error", "gauge", {"device", "op"}),
        ("slicesched_sim_correction_factor", "gauge", {"device", "op"}),
        ("slicesched_sim_whatif_total", "counter", {"result"}),
        ("slicesched_sim_whatif_compute_seconds", "histogram", set()),
        ("slicesched_sim_twin_epoch", "gauge", set()),
        ("slicesched_scheduler_sim_steering_version", "gauge", set()),
        ("slicesched_scheduler_sim_steering_age_seconds", "gauge", set()),
        ("slicesched_scheduler_sim_steering_factors", "gauge", set()),
        ("slicesched_gmg_epoch", "gauge", set()),
        ("slicesched_gmg_devices_down", "gauge", set()),
        ("slicesched_gmg_events_total", "counter", {"type", "result"}),
        ("slicesched_gmg_streams_expired_total", "counter", set()),
        ("slicesched_stream_lag", "gauge", {"stream", "group"}),
        ("slicesched_stream_pending", "gauge", {"stream", "group"}),
    ]
}


def _q(metric: str, quantile: float, by: str, sel: str = "") -> str:
    sel = f"{{{sel}}}" if sel else ""
    return f"histogram_quantile({quantile}, sum by (le, {by}) (rate({metric}_bucket{sel}[{RI}])))"


def _p50_p99(metric: str, by: str, sel: str = "", legend: str = "") -> list[tuple[str, str]]:
    return [(_q(metric, 0.5, by, sel), f"p50 {legend}".strip()), (_q(metric, 0.99, by, sel), f"p99 {legend}".strip())]


def panels() -> list[list[tuple]]:
    """Rows of (title, [(expr, legend)], unit, description, stacked); each row holds up to three panels."""
    tenant_latency = [
        ("TTFT p50 / p99 by tenant", _p50_p99("slicesched_ttft_seconds", "tenant", T, "{{tenant}}"), "s",
         "Time to first token (histogram slicesched_ttft_seconds).", False),
        ("TPOT p50 / p99 by tenant", _p50_p99("slicesched_tpot_seconds", "tenant", T, "{{tenant}}"), "s",
         "Time per output token after the first.", False),
        ("E2E p50 / p99 by tenant", _p50_p99("slicesched_e2e_seconds", "tenant", T, "{{tenant}}"), "s",
         "End-to-end request latency.", False),
    ]
    tenant_sla = [
        ("SLA violation ratio by tenant",
         [(f"sum by (tenant) (rate(slicesched_sla_violations_total{{{T}}}[{RI}])) / "
           f"clamp_min(sum by (tenant) (rate(slicesched_requests_total{{{T}}}[{RI}])), 1e-9)", "{{tenant}}")],
         "percentunit", "Violations (TTFT or TPOT over target, rejected or failed) per finished request.", False),
        ("Requests by outcome", [(f"sum by (tenant, outcome) (rate(slicesched_requests_total{{{T}}}[{RI}]))",
                                  "{{tenant}} {{outcome}}")], "reqps", "", True),
        ("Output token throughput by tenant",
         [(f"sum by (tenant) (rate(slicesched_worker_tokens_total{{{T}}}[{RI}]))", "{{tenant}}")], "short",
         "Output tokens per second, counted by the workers.", True),
    ]
    tenant_queue = [
        ("Queue depth by tenant (scheduler)", [(f"sum by (tenant) (slicesched_queue_depth{{{T}}})", "{{tenant}}")],
         "short", "", False),
        ("In flight at the gateways", [(f"sum by (tenant) (slicesched_gateway_inflight{{{T}}})", "{{tenant}}")],
         "short", "", False),
        ("Scheduler admissions and failures",
         [(f"sum by (tenant) (rate(slicesched_scheduler_admitted_total{{{T}}}[{RI}]))", "admitted {{tenant}}"),
          (f"sum by (tenant, code) (rate(slicesched_scheduler_failed_total{{{T}}}[{RI}]))",
           "failed {{tenant}} {{code}}")], "reqps", "", False),
    ]
    devices = [
        ("Device busy ratio", [(f"avg by (device) (slicesched_device_busy_ratio{{{D}}})", "{{device}}")],
         "percentunit", "", False),
        ("Device memory", [(f'sum by (device, kind) (slicesched_device_memory_bytes{{{D}, kind=~"used|reserved|capacity"}})',
                            "{{device}} {{kind}}")], "bytes", "", False),
        ("Leases granted / revoked / expired",
         [(f"sum by (event) (rate(slicesched_leases_total[{RI}]))", "{{event}}"),
          (f"sum (rate(slicesched_gmg_leases_expired_total[{RI}]))", "expired by the GMG sweep")], "ops", "", False),
    ]
    control = [
        ("Scheduler decision latency", _p50_p99("slicesched_scheduler_decision_seconds", "job"), "s",
         "Time the scheduler takes for one decision.", False),
        ("Simulator prediction error", [(f"avg by (device, op) (slicesched_sim_prediction_error{{{D}}})",
                                         "{{device}} {{op}}")], "percentunit",
         "EWMA of |measured - predicted| / measured segment time, after correction.", False),
        ("Simulator correction factor", [(f"avg by (device, op) (slicesched_sim_correction_factor{{{D}}})",
                                          "{{device}} {{op}}")], "short",
         "Measured / modelled time per (device, operator); 1 means the cost model is right.", False),
    ]
    simulator = [
        ("What-if queries", [(f"sum by (result) (rate(slicesched_sim_whatif_total[{RI}]))", "{{result}}")], "reqps",
         "", True),
        ("What-if compute time", _p50_p99("slicesched_sim_whatif_compute_seconds", "job"), "s",
         "Simulator time to evaluate one what-if query.", False),
        ("GMG epoch and the simulator's twin", [("max(slicesched_gmg_epoch)", "GMG epoch"),
                                                ("max(slicesched_sim_twin_epoch)", "simulator twin epoch"),
                                                ("sum(slicesched_gmg_devices_down)", "devices down")], "short",
         "The twin trails the GMG by the epochs it has not applied yet.", False),
        ("Scheduler steered by the simulator", [("max(slicesched_scheduler_sim_steering_version)",
                                                 "copy version in use (0: none)"),
                                                ("max(slicesched_scheduler_sim_steering_age_seconds)", "copy age (s)"),
                                                ("max(slicesched_scheduler_sim_steering_factors)", "factors in use")],
         "short", "The sim:steering copy the scheduler's what-if applies; version 0: the uncorrected cost model "
                  "(no simulator, stale copy, or SLICESCHED_SIM_STEERING=0).", False),
    ]
    streams = [
        ("Fenced late results (zombie workers)",
         [(f"sum by (device) (rate(slicesched_worker_fenced_results_total[{RI}]))", "{{device}}")], "ops",
         "Terminal results a worker did not publish because the request had already ended elsewhere.", False),
        ("GMG events applied", [(f"sum by (type, result) (rate(slicesched_gmg_events_total[{RI}]))",
                                 "{{type}} {{result}}"),
                                (f"sum (rate(slicesched_gmg_streams_expired_total[{RI}]))",
                                 "streams expired (dead gateways, removed devices)")], "ops", "", False),
        ("Stream lag", [("sum by (stream, group) (slicesched_stream_lag)", "{{stream}} / {{group}}")], "short",
         "Entries not yet delivered to the consumer group.", False),
        ("Stream pending", [("sum by (stream, group) (slicesched_stream_pending)", "{{stream}} / {{group}}")],
         "short", "Entries delivered but not acknowledged (PEL size).", False),
    ]
    return [["Tenants: latency, SLA and throughput"], tenant_latency, tenant_sla, tenant_queue,
            ["Devices and leases"], devices, ["Control plane"], control, simulator, streams]


def _timeseries(pid: int, x: int, y: int, w: int, title, targets, unit, desc, stacked) -> dict:
    return {"type": "timeseries", "id": pid, "title": title, "description": desc, "datasource": DS,
            "gridPos": {"h": 8, "w": w, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit, "custom": {
                "lineWidth": 1, "fillOpacity": 10, "stacking": {"mode": "normal" if stacked else "none"}}},
                "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": e, "legendFormat": lf}
                        for i, (e, lf) in enumerate(targets)]}


def _variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query, "refresh": 2,
            "multi": True, "includeAll": True, "current": {"text": "All", "value": "$__all"}, "sort": 1}


def build() -> dict:
    """The dashboard as a JSON-ready dict."""
    out, pid, y = [], 0, 0
    for row in panels():
        if isinstance(row[0], str):  # a section header
            pid += 1
            out.append({"type": "row", "id": pid, "title": row[0], "collapsed": False,
                        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            y += 1
            continue
        w = 24 // len(row)
        for i, spec in enumerate(row):
            pid += 1
            out.append(_timeseries(pid, i * w, y, w, *spec))
        y += 8
    return {
        "title": "SliceScheduler", "uid": "slicesched-overview",
        "description": "Per-tenant latency and SLA, devices, leases and the control plane of a SliceScheduler mesh.",
        "tags": ["slicesched", "llm-serving"], "timezone": "browser", "editable": True, "graphTooltip": 1,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            _variable("tenant", "Tenant", "label_values(slicesched_requests_total, tenant)"),
            _variable("device", "Device", "label_values(slicesched_device_busy_ratio, device)"),
        ]},
        "panels": out,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    if argv[1:] == ["--check"]:
        if not OUT.exists() or OUT.read_text() != render():
            print(f"{OUT.name} is out of date: run python3 {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
