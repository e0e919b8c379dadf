"""Every checkpoint is served exactly or refused: each unsupported case is refused by ``slicesched check-config``
and by ``slicesched up`` (before anything starts) with exit code 2 and one line naming the file and the field or
tensor; the worker refuses a model that does not fit its device at its own start too."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from services.cli.main import main
from shared.model.config import PRESETS
from shared.model.llama import LlamaModel
from shared.model.weights import save_checkpoint


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    cfg = PRESETS["tiny-2l"].with_(bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
    return save_checkpoint(LlamaModel(cfg, seed=1), tmp_path_factory.mktemp("base"))


def write_configs(tmp, ckpt, *, memory_gb=0.25, devices=("cpu0",)):
    cluster = {"cluster": {"name": "t"}, "devices": [{"id": d, "backend": "cpu", "kind": "cpu",
                                                       "memory_gb": memory_gb} for d in devices]}
    tenants = {"tenants": [{"name": "t", "model": {"checkpoint": str(ckpt)}, "sla": {"ttft_ms": 1000, "tpot_ms": 100},
                            "home_devices": ["cpu0"], "api_keys": ["sk-test-refusal-0001"]}]}
    c, t = tmp / "cluster.yaml", tmp / "tenants.yaml"
    c.write_text(yaml.safe_dump(cluster))
    t.write_text(yaml.safe_dump(tenants))
    return c, t


def both_refuse(tmp, c, t, capsys) -> list[str]:
    """check-config and up both exit 2 with one line; returns the two lines."""
    lines = []
    for argv in (["check-config", "--cluster", str(c), "--tenants", str(t)],
                 ["up", "--cluster", str(c), "--tenants", str(t), "--data-dir", str(tmp / "data"), "--port", "0",
                  "--timeout", "5"]):
        capsys.readouterr()
        assert main(argv) == 2, argv[0]
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("slicesched: config error: "), err
        lines.append(err[0])
    assert not (tmp / "data").exists(), "up started something before refusing"
    return lines


def mutate_config(**kw):
    def f(d):
        cfg = json.loads((d / "config.json").read_text())
        for k, v in kw.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return f


def mutate_tensors(fn):
    def f(d):
        t = load_file(str(d / "model.safetensors"))
        fn(t)
        save_file(t, str(d / "model.safetensors"))
    return f


CASES = [
    ("architecture", mutate_config(architectures=["GemmaForCausalLM"], model_type=None),
     r"config.json: architectures: \['GemmaForCausalLM'\] is not supported"),
    ("hidden_act", mutate_config(hidden_act="gelu_pytorch_tanh"), r"config.json: hidden_act: 'gelu_pytorch_tanh'"),
    ("rope type v4", mutate_config(rope_scaling={"type": "dynamic", "factor": 2.0}),
     r"config.json: rope_scaling.rope_type: 'dynamic' is not supported"),
    ("rope type v5", mutate_config(rope_scaling=None, rope_theta=None, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
     r"config.json: rope_parameters.rope_type: 'yarn' is not supported"),
    ("quantization", mutate_config(quantization_config={"quant_method": "gptq", "bits": 4}),
     r"config.json: quantization_config: quantized weights \(gptq\)"),
    ("mlp bias", mutate_config(mlp_bias=True), r"config.json: mlp_bias"),
    ("unread tensor", mutate_tensors(lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)})),
     r"model.safetensors: model.layers.0.self_attn.q_proj.bias: tensor that this model does not read"),
    ("missing tensor", mutate_tensors(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
     r"model.layers.1.mlp.up_proj.weight: missing tensor"),
    ("misshaped tensor", mutate_tensors(lambda t: t.update({"model.norm.weight": torch.ones(7)})),
     r"model.safetensors: model.norm.weight: shape \(7,\), expected \(128,\)"),
]


@pytest.mark.parametrize("name, mutate, message", CASES, ids=[c[0] for c in CASES])
def test_unsupported_checkpoints_are_refused(name, mutate, message, base_ckpt, tmp_path, capsys):
    d = tmp_path / "ck"
    shutil.copytree(base_ckpt, d)
    mutate(d)
    c, t = write_configs(tmp_path, d)
    for line in both_refuse(tmp_path, c, t, capsys):
        assert "tenants[0].model.checkpoint" in line and str(d) in line
        assert pytest.importorskip("re").search(message, line), line


def test_the_base_checkpoint_is_accepted(base_ckpt, tmp_path, capsys):
    c, t = write_configs(tmp_path, base_ckpt)
    assert main(["check-config", "--cluster", str(c), "--tenants", str(t)]) == 0
    assert capsys.readouterr().out.startswith("ok:")


def test_unsupported_gguf_architecture_is_refused(tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    f = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(f), "gemma")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    c, t = write_configs(tmp_path, f)
    for line in both_refuse(tmp_path, c, t, capsys):
        assert f"{f}: general.architecture: 'gemma' is not supported" in line


def test_a_model_larger_than_its_device_is_refused_with_sizes(base_ckpt, tmp_path, capsys):
    c, t = write_configs(tmp_path, base_ckpt, memory_gb=0.001)
    for line in both_refuse(tmp_path, c, t, capsys):
        assert "tenants[0].model: model model" not in line
        assert "does not fit device cpu0" in line and "MiB of weights" in line and "MiB usable" in line


def test_a_device_home_to_no_tenant_is_refused(base_ckpt, tmp_path, capsys):
    c, t = write_configs(tmp_path, base_ckpt, devices=("cpu0", "cpu1"))
    for line in both_refuse(tmp_path, c, t, capsys):
        assert "home_devices: device 'cpu1' must be home to exactly one tenant" in line and str(t) in line


def test_the_worker_refuses_a_model_that_does_not_fit(base_ckpt, tmp_path):
    import os
    import subprocess
    import sys
    c, t = write_configs(tmp_path, base_ckpt, memory_gb=0.001)
    env = dict(os.environ, SLICESCHED_CLUSTER=str(c), SLICESCHED_TENANTS=str(t), REDIS_URL="redis://127.0.0.1:1/0")
    r = subprocess.run([sys.executable, "-m", "services.worker", "--device", "cpu0"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "does not fit device cpu0" in r.stderr and "Traceback" not in r.stderr
