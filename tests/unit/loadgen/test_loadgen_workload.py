"""Workload files: semantics, determinism, speed, the shipped examples, and errors naming file and field."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import loadgen.workload as lw
from loadgen.mix import popularity_weights
from loadgen.workload import load_workload, read_workload_spec
from shared.config import ConfigError

REPO = Path(__file__).resolve().parents[3]
TRACES = REPO.parent / "shared" / "traces"
EXAMPLES = REPO / "configs" / "workloads"
needs_traces = pytest.mark.skipif(not (TRACES / "azure_llm_2023_conv.csv").is_file(), reason="shared traces absent")


def tenants_file(path: Path, n: int = 16) -> Path:
    """n tenants shaped like the 16-tenant mix: 3/4 llama-7b, 1/4 llama-13b, one home device each."""
    lines = ["tenants:"]
    for i in range(n):
        preset = "llama-7b" if i < n * 3 // 4 else "llama-13b"
        lines.append(f"  - {{name: t{i:02d}, model: {{preset: {preset}}}, sla: {{ttft_ms: 1000, tpot_ms: 100}}, "
                     f"home_devices: [g{i}], api_keys: [sk-test-{i:08d}]}}")
    path.write_text("\n".join(lines) + "\n")
    return path


def workload_file(tmp: Path, body: str, n: int = 16) -> Path:
    tenants_file(tmp / "tenants.yaml", n)
    p = tmp / "w.yaml"
    p.write_text("tenants: tenants.yaml\n" + body)
    return p


AZURE = """traces:
  - {path: "${SLICESCHED_TRACES}/azure_llm_2023_conv.csv", format: azure}
  - {path: "${SLICESCHED_TRACES}/azure_llm_2023_code.csv", format: azure}
"""


@needs_traces
def test_sixteen_tenant_hour_loads_fast_and_follows_popularity(tmp_path):
    p = workload_file(tmp_path, AZURE + "alpha: 1.3\nseed: 1\nduration_s: 3600\n")
    lw._cached_traces.cache_clear()
    t = time.process_time()  # CPU time: wall time on a shared 2-core machine depends on the neighbours
    w = load_workload(p)
    t1 = time.process_time() - t
    assert t1 < 3.0, f"1-hour 16-tenant workload took {t1:.2f} s"
    counts = Counter(r.tenant for r in w.requests)
    total_rate = len(w.requests) / 3600
    assert total_rate == pytest.approx(5.53 + 2.57, rel=0.03)  # the sum of the two traces' native rates
    weights = popularity_weights(16, 1.3)
    for i in range(4):
        assert counts[f"t{i:02d}"] / len(w.requests) == pytest.approx(weights[i], rel=0.1)
    assert w.meta["tenants"]["t00"]["trace"] == "azure_llm_2023_conv"
    assert w.meta["tenants"]["t03"]["trace"] == "azure_llm_2023_code"  # tenant k takes trace k mod 2
    assert all(r.input_tokens + r.output_tokens <= 4096 for r in w.requests)
    assert max(r.input_tokens for r in w.requests) > 3000  # capped, not truncated wholesale

    lw._cached_traces.cache_clear()
    t = time.process_time()
    w20 = load_workload(p, rate_scale=20)
    t20 = time.process_time() - t
    assert t20 < 15.0, f"rate scale 20 took {t20:.2f} s"
    assert len(w20.requests) == pytest.approx(20 * len(w.requests), rel=0.02)
    assert w20.rate_scale == 20 and w20.requests[-1].arrival_s < 3600


@needs_traces
def test_deterministic_and_seed_sensitive(tmp_path):
    p = workload_file(tmp_path, AZURE + "alpha: 0.7\nseed: 3\nduration_s: 300\n", n=4)
    a, b = load_workload(p), load_workload(p)
    assert a.requests == b.requests and len(a.requests) > 1000
    p.write_text(p.read_text().replace("seed: 3", "seed: 4"))
    assert load_workload(p).requests != a.requests


@needs_traces
def test_native_rates_base_rate_offsets_and_caps(tmp_path):
    p = workload_file(tmp_path, AZURE + "alpha: native\nbase_rate_rps: 2.0\nseed: 1\nduration_s: 600\n"
                      "offsets: {t00: 100, t01: 0}\ncaps: {max_input_tokens: 256, max_output_tokens: 64}\n", n=2)
    w = load_workload(p)
    conv, code = Counter(r.tenant for r in w.requests)["t00"], Counter(r.tenant for r in w.requests)["t01"]
    assert (conv + code) / 600 == pytest.approx(2.0, rel=0.2)
    assert w.meta["tenants"]["t00"]["offset_s"] == 100.0
    assert w.meta["tenants"]["t00"]["target_rate_rps"] / w.meta["tenants"]["t01"]["target_rate_rps"] == \
        pytest.approx(5.53 / 2.57, rel=0.02)
    assert max(r.input_tokens for r in w.requests) == 256 and max(r.output_tokens for r in w.requests) == 64


def test_traces_env_var(tmp_path, monkeypatch):
    d = tmp_path / "traces"
    d.mkdir()
    (d / "t.jsonl").write_text("".join(f'{{"timestamp": {i * 500}, "input_length": 9, "output_length": 3}}\n'
                                       for i in range(20)))
    monkeypatch.setenv("SLICESCHED_TRACES", str(d))
    p = workload_file(tmp_path, 'traces: ["${SLICESCHED_TRACES}/t.jsonl"]\nalpha: 0\nseed: 1\nduration_s: 10\n', n=2)
    w = load_workload(p)
    assert len(w.requests) == pytest.approx(20, abs=8)  # 2 req/s in total, split evenly
    assert {r.input_tokens for r in w.requests} == {9}


@pytest.mark.parametrize("body,field", [
    ("alpha: 1\nseed: 1\nduration_s: 10\n", "traces"),
    ("traces: [x.jsonl]\nalpha: -1\nseed: 1\nduration_s: 10\n", "alpha"),
    ("traces: [x.jsonl]\nalpha: 1\nduration_s: 10\n", "seed"),
    ("traces: [x.jsonl]\nalpha: 1\nseed: 1\nduration_s: 0\n", "duration_s"),
    ("traces: [x.jsonl]\nalpha: 1\nseed: 1\nduration_s: 5\nrate_scael: 2\n", "rate_scael"),
    ("traces: [{path: x.csv, format: csv}]\nalpha: 1\nseed: 1\nduration_s: 5\n", "traces[0].columns"),
    ("traces: [{path: x.csv, format: parquet}]\nalpha: 1\nseed: 1\nduration_s: 5\n", "traces[0].format"),
    ("traces: [x.jsonl]\nalpha: 1\nseed: 1\nduration_s: 5\ncaps: {max_output_tokens: 0}\n", "caps.max_output_tokens"),
    ("traces: [missing.jsonl]\nalpha: 1\nseed: 1\nduration_s: 5\n", "traces[0].path"),
    ("traces: [x.jsonl]\nalpha: 1\nseed: 1\nduration_s: 5\noffsets: {nobody: 3}\n", "offsets.nobody"),
])
def test_bad_workload_files_name_file_and_field(tmp_path, body, field):
    (tmp_path / "x.jsonl").write_text('{"timestamp": 0, "input_length": 9, "output_length": 3}\n'
                                      '{"timestamp": 10, "input_length": 9, "output_length": 3}\n')
    p = workload_file(tmp_path, body, n=2)
    with pytest.raises(ConfigError) as e:
        load_workload(p)
    assert e.value.file == str(p) and e.value.field_path == field


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "w.yaml"
    p.write_text("tenants: [unclosed\n")
    with pytest.raises(ConfigError, match=r"line 2, column 1: invalid YAML"):
        read_workload_spec(p)
    with pytest.raises(ConfigError, match="file not found"):
        read_workload_spec(tmp_path / "none.yaml")


def test_every_example_parses():
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert {f.name for f in files} >= {"azure-16mix-a0.7.yaml", "azure-16mix-a1.3.yaml", "azure-16mix-a2.1.yaml",
                                       "servegen-16mix.yaml", "tiny-bursty.yaml"}
    for f in files:
        spec = read_workload_spec(f)
        assert spec.seed is not None and spec.duration_s > 0


@needs_traces
@pytest.mark.parametrize("name", ["azure-16mix-a0.7", "azure-16mix-a1.3", "azure-16mix-a2.1", "servegen-16mix"])
def test_sixteen_tenant_examples_load(name):
    if not (REPO / "configs" / "tenants-16mix.yaml").is_file():
        pytest.skip("configs/tenants-16mix.yaml not present")
    w = load_workload(EXAMPLES / f"{name}.yaml")
    counts = Counter(r.tenant for r in w.requests)
    assert len(counts) == 16 and len(w.requests) / 3600 == pytest.approx(8.1, rel=0.05)
    assert w.cluster is not None and len(w.cluster.devices) == 32
    contexts = {t.name: t.model.config.max_position_embeddings for t in w.tenants.tenants}
    assert all(r.input_tokens + r.output_tokens <= contexts[r.tenant] for r in w.requests)
    if name.startswith("azure"):
        alpha = float(name.rsplit("a", 1)[1])
        first = counts[w.tenants.names()[0]] / len(w.requests)
        assert first == pytest.approx(popularity_weights(16, alpha)[0], rel=0.1)


@needs_traces
def test_tiny_bursty_example():
    w = load_workload(EXAMPLES / "tiny-bursty.yaml")
    assert w.tenants.names() == ["tiny-a", "tiny-b"] and w.cluster is not None and w.duration_s == 60
    a, b = w.for_tenant("tiny-a"), w.for_tenant("tiny-b")
    assert len(a) > 4 * len(b) > 0
    assert max(r.input_tokens for r in w.requests) <= 256 and max(r.output_tokens for r in w.requests) <= 64
    per_s = np.bincount([int(r.arrival_s) for r in a], minlength=60)
    assert per_s.max() >= 5 and (per_s == 0).sum() >= 20  # bursts between idle seconds


@needs_traces
def test_servegen_selection_error_names_workload_field(tmp_path):
    p = workload_file(tmp_path, 'traces:\n  - {path: "${SLICESCHED_TRACES}/servegen_client_rates_600s.csv.gz", '
                      'format: servegen, model: deepseek-r1, clients: 500, start_s: 0}\n'
                      'alpha: native\nseed: 1\nduration_s: 600\n', n=2)
    with pytest.raises(ConfigError) as e:
        load_workload(p)
    assert e.value.file == str(p) and e.value.field_path == "traces[0].clients"
    assert "asked for 500" in e.value.problem
