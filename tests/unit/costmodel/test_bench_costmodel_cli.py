"""``slicesched bench costmodel``: the comparison table, its JSON, bad input, and a reproducible fit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from services.cli.main import main
from shared.costmodel import load_profile_file
from shared.costmodel.profiles import PROFILE_DIR

VIDUR = Path(__file__).resolve().parents[3].parent / "shared" / "profiles" / "vidur"
needs_data = pytest.mark.skipif(not VIDUR.is_dir(), reason=f"measured GPU timings not present at {VIDUR}")


def test_missing_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "costmodel", "--against", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nowhere" in err[0] and "not found" in err[0]


@needs_data
def test_table_and_json(tmp_path, capsys):
    js = tmp_path / "cm.json"
    assert main(["bench", "costmodel", "--against", str(VIDUR), "--gpu", "a100", "--json", str(js),
                 "--max-mape", "0.10"]) == 0
    out = capsys.readouterr().out
    assert "| A100 | meta-llama/Meta-Llama-3-8B |" in out and "| GEMM | norm | rotary |" in out
    assert "a100_dgx | intra-node | A100 nvlink" in out and "H100" not in out.split("send/recv")[0]
    doc = json.loads(js.read_text())
    assert doc["before"] is None and doc["fit"] is None
    rows = [r for r in doc["after"]["compute"] if r["model"] == "meta-llama/Llama-2-7b-hf"]
    assert {r["family"] for r in rows} == {"gemm", "norm", "rotary", "activation", "residual", "embedding"}
    assert all(0 <= r["mape"] <= 0.10 for r in rows)
    # a stricter bound than the profiles meet exits 1
    assert main(["bench", "costmodel", "--against", str(VIDUR), "--gpu", "a100", "--max-mape", "0.01"]) == 1


@needs_data
def test_bad_holdout_names_the_measured_models(capsys):
    assert main(["bench", "costmodel", "--against", str(VIDUR), "--fit-out", "x", "--holdout", "gpt-5"]) == 2
    err = capsys.readouterr().err
    assert "gpt-5" in err and "meta-llama/Llama-2-7b-hf" in err


@needs_data
def test_fit_out_writes_loadable_profiles_with_provenance(tmp_path, capsys):
    """A fit on one measured model (fast) from the shipped profiles: H100 fitted, H200 derived, both loadable."""
    data = tmp_path / "vidur"
    data.mkdir()
    for name in ("compute__h100__meta-llama__Llama-2-7b-hf-mlp.csv.gz", "network__h100_dgx__send_recv.csv.gz"):
        shutil.copy(VIDUR / name, data / name)
    base = tmp_path / "base"
    base.mkdir()
    for kind in ("h100-80gb", "h200"):
        shutil.copy(PROFILE_DIR / f"{kind}.yaml", base / f"{kind}.yaml")
    out = tmp_path / "out"
    assert main(["bench", "costmodel", "--against", str(data), "--gpu", "h100", "--profiles", str(base),
                 "--fit-out", str(out), "--max-mape", "0.10"]) == 0
    h100, h200 = load_profile_file(out / "h100-80gb.yaml"), load_profile_file(out / "h200.yaml")
    assert h100.calibrated and not h200.calibrated and "derived" in h200.source
    prov = yaml.safe_load((out / "h100-80gb.yaml").read_text())["provenance"]
    assert "7d47513" in prov["data"] and "first principles" in prov["not_fitted"]
    assert prov["files"][0].startswith("compute__h100__meta-llama__Llama-2-7b-hf")
    assert prov["mape_after_fit"]["gemm"] <= 0.10
    assert "not measured" in yaml.safe_load((out / "h200.yaml").read_text())["provenance"]["derived"]
    assert h200.memory_eff == h100.memory_eff and h200.mem_bandwidth == 4.8e12
    assert "| H100 | meta-llama/Llama-2-7b-hf |" in capsys.readouterr().out
