"""Metrics bookkeeping (SLA violations by TTFT/TPOT/outcome) and the OpenAPI document's validity."""
from __future__ import annotations

import jsonschema
from prometheus_client import CollectorRegistry

from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import openapi_document
from shared.config import parse_tenants

T = parse_tenants({"tenants": [{"name": "ta", "model": "tiny", "sla": {"ttft_ms": 100, "tpot_ms": 10},
                                "home_devices": ["d"]}]}).get("ta")


def sample(reg, name, **labels):
    return reg.get_sample_value(name, labels) or 0.0


def test_sla_violations_by_ttft_tpot_and_outcome():
    reg = CollectorRegistry()
    m = GatewayMetrics(reg)
    m.completed(T, ttft_s=0.05, e2e_s=0.05 + 9 * 0.005, completion_tokens=10)  # meets both targets
    assert sample(reg, "slicesched_sla_violations_total", tenant="ta") == 0
    m.completed(T, ttft_s=0.2, e2e_s=0.2, completion_tokens=1)  # TTFT over 100 ms
    m.completed(T, ttft_s=0.01, e2e_s=0.01 + 4 * 0.02, completion_tokens=5)  # TPOT 20 ms over 10 ms
    assert sample(reg, "slicesched_sla_violations_total", tenant="ta") == 2
    assert sample(reg, "slicesched_tpot_seconds_count", tenant="ta") == 2
    assert sample(reg, "slicesched_requests_total", tenant="ta", outcome="ok") == 3
    m.outcome("ta", "rejected_quota")
    m.outcome("ta", "bad_request")
    m.outcome(None, "bad_request")
    assert sample(reg, "slicesched_sla_violations_total", tenant="ta") == 3  # bad requests are not violations
    assert sample(reg, "slicesched_requests_total", tenant="unknown", outcome="bad_request") == 1


def test_openapi_schemas_are_valid_json_schema():
    doc = openapi_document()
    assert doc["openapi"] == "3.1.0"
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    req = {"$ref": "#/components/schemas/CompletionRequest", "components": doc["components"]}
    v = jsonschema.Draft202012Validator(req)
    assert v.is_valid({"model": "ta", "prompt": "x", "max_tokens": 3, "stop": ["a"], "stream": None})
    assert not v.is_valid({"model": "ta", "prompt": "x", "max_tokens": 0})
    assert not v.is_valid({"model": "ta"})
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert "200" in op["responses"], path
