"""deploy/grafana: the dashboard is importable JSON, covers every exported metric and queries them correctly."""
from __future__ import annotations

import json
import re

from deploy_support import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "slicesched-dashboard.json"
# The metrics the services export: name -> (type, labels).
METRICS = {
    "slicesched_ttft_seconds": ("histogram", {"tenant"}),
    "slicesched_tpot_seconds": ("histogram", {"tenant"}),
    "slicesched_e2e_seconds": ("histogram", {"tenant"}),
    "slicesched_sla_violations_total": ("counter", {"tenant"}),
    "slicesched_queue_depth": ("gauge", {"tenant"}),
    "slicesched_requests_total": ("counter", {"tenant", "outcome"}),
    "slicesched_device_busy_ratio": ("gauge", {"device"}),
    "slicesched_device_memory_bytes": ("gauge", {"device", "kind"}),
    "slicesched_leases_total": ("counter", {"event"}),
    "slicesched_scheduler_decision_seconds": ("histogram", set()),
    "slicesched_sim_prediction_error": ("gauge", {"device", "op"}),
    "slicesched_stream_lag": ("gauge", {"stream", "group"}),
    "slicesched_stream_pending": ("gauge", {"stream", "group"}),
}
_SUFFIXES = ("_bucket", "_sum", "_count")


def _dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _exprs(d: dict) -> list[str]:
    return [t["expr"] for p in _panels(d) for t in p.get("targets", [])]


def _metric_refs(expr: str) -> list[str]:
    return re.findall(r"\bslicesched_[a-z0-9_]+", expr)


def _base(name: str) -> str:
    for s in _SUFFIXES:
        if name.endswith(s) and name[: -len(s)] in METRICS:
            return name[: -len(s)]
    return name


def test_dashboard_is_well_formed():
    d = _dash()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    panels = _panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    boxes = [(p["gridPos"]["x"], p["gridPos"]["y"], p["gridPos"]["w"], p["gridPos"]["h"]) for p in panels]
    for x, y, w, h in boxes:
        assert 0 <= x and x + w <= 24 and h > 0
    for i, a in enumerate(boxes):  # no two panels overlap
        for b in boxes[i + 1:]:
            assert a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0] or a[1] + a[3] <= b[1] or b[1] + b[3] <= a[1], (a, b)
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs))
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "tenant", "device"} <= names


def test_every_metric_has_a_panel_and_only_known_metrics_are_queried():
    used = {_base(m) for e in _exprs(_dash()) for m in _metric_refs(e)}
    assert used == set(METRICS)


def test_queries_use_each_metric_type_correctly():
    for expr in _exprs(_dash()):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        for ref in _metric_refs(expr):
            base = _base(ref)
            kind, labels = METRICS[base]
            if kind == "histogram":
                assert ref == f"{base}_bucket" and "histogram_quantile(" in expr and "rate(" in expr, expr
            elif kind == "counter":
                assert re.search(rf"rate\({ref}\b", expr), f"counter {ref} must be rated: {expr}"
            else:
                assert f"rate({ref}" not in expr, f"gauge {ref} must not be rated: {expr}"
        for grouped in re.findall(r"by \(([^)]*)\)", expr):
            metric = _base(_metric_refs(expr)[0])
            extra = {g.strip() for g in grouped.split(",")} - METRICS[metric][1] - {"le", "job", "instance"}
            assert not extra, f"{expr}: grouping by labels {metric} does not have: {extra}"
