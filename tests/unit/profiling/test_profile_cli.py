"""``slicesched profile``: a quick run measures the real operators and writes a loadable, measured profile."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from services.cli.main import main
from shared.costmodel import ModelCost, load_profile_file
from shared.costmodel.profiling import Case, SegmentBench, measure
from shared.model.config import PRESETS


def test_quick_profile_writes_a_loadable_measured_profile(tmp_path, capsys):
    out, js = tmp_path / "cpu.yaml", tmp_path / "fit.json"
    rc = main(["profile", "--device", "cpu", "--quick", "--threads", "1", "--out", str(out), "--json", str(js)])
    assert rc == 0
    prof = load_profile_file(out)
    raw = yaml.safe_load(out.read_text())
    assert prof.kind == "cpu" and prof.source == "measured" and prof.calibrated
    assert raw["threads"] == 1 and raw["torch"] == str(torch.__version__) and raw["date"] and raw["machine"]
    assert prof.step_overhead_s > 0 and set(prof.launch_overhead_by_class) <= {"gemm", "attention", "elementwise",
                                                                             "embedding"}
    # the fitted profile predicts the measured shapes to well within a factor of two
    doc = json.loads(js.read_text())
    assert doc["validation"] and doc["validation_mape"] < 0.5
    cost = ModelCost(PRESETS["tiny"], prof)
    assert 0 < cost.mlp_time(1) < cost.mlp_time(64) < cost.mlp_time(256)
    assert 1e-5 < cost.iteration_time(1, 100) < 0.1
    table = capsys.readouterr().out
    assert "| mlp |" in table and "MAPE" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_cuda_without_a_gpu_is_a_one_line_error(capsys, tmp_path):
    assert main(["profile", "--device", "cuda", "--out", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA" in err[0]
    assert not (tmp_path / "x.yaml").exists()


def test_unknown_model_is_a_one_line_error(capsys):
    assert main(["profile", "--model", "gpt-9"]) == 2
    assert "gpt-9" in capsys.readouterr().err


def test_segment_bench_runs_every_kind_of_case():
    cfg = PRESETS["tiny-2l"]
    bench = SegmentBench(cfg)
    cases = [Case("embed", 8), Case("mlp", 8), Case("head", 8), Case("attn", 3, decode_ctx=(40, 30, 20)),
             Case("attn", 16, prefill=((16, 32),)), Case("attn", 18, decode_ctx=(50, 60), prefill=((16, 0),))]
    ms = measure(bench, cases, budget_s=0.05, min_rounds=2)
    assert [m.case for m in ms] == cases
    assert all(len(m.samples_ms) >= 2 and m.value_ms > 0 for m in ms)
    assert ms[3].case.decode_kv == 90 and ms[4].case.prefill_work() == (16, 16 * 32 + 16 * 17 // 2, 48)
