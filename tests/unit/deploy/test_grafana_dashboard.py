"""deploy/grafana: the dashboard is importable JSON built by build_dashboard.py, covers every metric the services
define (checked against their source) and queries each with its real type and labels."""
from __future__ import annotations

import ast
import json
import re

from deploy_support import REPO, load_module

GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "slicesched-dashboard.json"
builder = load_module(GRAFANA / "build_dashboard.py", "build_dashboard")
METRICS = {name: (kind, set(labels)) for name, (kind, labels) in builder.METRICS.items()}
# The observability contract: these stay on the dashboard even before a service exports them.
CONTRACT = {"slicesched_ttft_seconds", "slicesched_tpot_seconds", "slicesched_e2e_seconds",
            "slicesched_sla_violations_total", "slicesched_queue_depth", "slicesched_requests_total",
            "slicesched_device_busy_ratio", "slicesched_device_memory_bytes", "slicesched_leases_total",
            "slicesched_scheduler_decision_seconds", "slicesched_sim_prediction_error", "slicesched_stream_lag",
            "slicesched_stream_pending"}
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


def _defined_in_source() -> dict[str, tuple[str, set[str]]]:
    """prometheus_client metric definitions in services/ and shared/: name -> (type, label names)."""
    found = {}
    for root in ("services", "shared"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                first = node.args[0]
                if func not in ("Counter", "Gauge", "Histogram", "Summary") or not (
                        isinstance(first, ast.Constant) and str(first.value).startswith("slicesched_")):
                    continue
                labels_node = node.args[2] if len(node.args) > 2 else next(
                    (k.value for k in node.keywords if k.arg == "labelnames"), None)
                labels = {e.value for e in getattr(labels_node, "elts", [])}
                found[first.value] = (func.lower(), labels)
    return found


def test_json_is_what_the_builder_builds():
    assert DASHBOARD.read_text() == builder.render(), "run: python3 deploy/grafana/build_dashboard.py"


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
    assert CONTRACT <= set(METRICS)


def test_queries_use_each_metric_type_and_labels_correctly():
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
        groupings = re.findall(r"by \(([^)]*)\) \((?:rate\()?(slicesched_[a-z0-9_]+)", expr)
        assert len(groupings) == expr.count(" by ("), f"unparsed grouping in {expr}"
        for grouped, ref in groupings:
            extra = {g.strip() for g in grouped.split(",")} - METRICS[_base(ref)][1] - {"le", "job", "instance"}
            assert not extra, f"{expr}: grouping by labels {ref} does not have: {extra}"
        for ref, matchers in re.findall(r"(slicesched_[a-z0-9_]+)\{([^}]*)\}", expr):
            names = set(re.findall(r"([a-z_]+)\s*=~?", matchers))
            assert names <= METRICS[_base(ref)][1], f"{expr}: {ref} has no label(s) {names - METRICS[_base(ref)][1]}"


def test_every_metric_the_services_define_is_on_the_dashboard_with_its_type_and_labels():
    defined = _defined_in_source()
    assert len(defined) >= 5, "the metric definitions were not found in services/ and shared/"
    for name, (kind, labels) in defined.items():
        assert name in METRICS, f"{name} is exported but has no panel: add it to deploy/grafana/build_dashboard.py"
        assert METRICS[name] == (kind, labels), f"{name}: the source defines a {kind} with labels {sorted(labels)}"
