"""Checkpoint directories: save/load round trip, partial loads, and errors that name the file and tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.config import ModelSpec
from shared.model.llama import LlamaModel
from shared.model.loader import build_model
from shared.model.tokenizer import ByteTokenizer, HFTokenizer
from shared.model.weights import CheckpointError, load_checkpoint


def test_round_trip_gives_identical_weights_and_logits(ckpt_dir, cfg2):
    src = LlamaModel(cfg2, seed=7)
    loaded = load_checkpoint(ckpt_dir)
    assert loaded.cfg == cfg2
    for seg in src.segments:
        a, b = src.segment_state_dict(seg), loaded.segment_state_dict(seg)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = [0, 5, 17, 200, 33]
    assert torch.equal(src.forward_reference(ids), loaded.forward_reference(ids))


def test_partial_load_reads_only_requested_segments(ckpt_dir):
    g = load_checkpoint(ckpt_dir, segments=["mlp[1]"])
    assert g.segments == ["mlp[1]"]
    full = load_checkpoint(ckpt_dir)
    x = torch.randn(3, full.cfg.hidden_size)
    assert torch.equal(g.run_segment("mlp[1]", x), full.run_segment("mlp[1]", x))


def test_build_model_from_specs(ckpt_dir, cfg2):
    model, tok = build_model(ModelSpec(config=cfg2, checkpoint=str(ckpt_dir)))
    assert isinstance(tok, HFTokenizer) and model.cfg == cfg2
    r1, t1 = build_model(ModelSpec(config=cfg2, preset="tiny-2l", seed=11))
    r2, _ = build_model(ModelSpec(config=cfg2, preset="tiny-2l", seed=11))
    assert isinstance(t1, ByteTokenizer)
    assert torch.equal(r1.forward_reference([1, 2, 3]), r2.forward_reference([1, 2, 3]))


def _copy(ckpt_dir, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(ckpt_dir, d)
    return d


def test_missing_tensor_names_tensor(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.self_attn.k_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.layers.1.self_attn.k_proj.weight: missing tensor") as e:
        load_checkpoint(d)
    assert str(d) in str(e.value)


def test_misshaped_tensor_names_file_and_tensor(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(4, 4)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: model.layers.0.mlp.gate_proj.weight: shape \(4, 4\)"):
        load_checkpoint(d)


def test_sharded_checkpoint_and_duplicate_tensor(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(t)
    save_file({k: t[k] for k in names[:10]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in names[10:]}, str(d / "model-00002-of-00002.safetensors"))
    assert load_checkpoint(d).cfg.num_hidden_layers == 2
    save_file({names[0]: t[names[0]]}, str(d / "model-extra.safetensors"))
    with pytest.raises(CheckpointError, match="also present in"):
        load_checkpoint(d)


def test_bad_config_and_missing_files(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: num_key_value_heads"):
        load_checkpoint(d)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_checkpoint(d)
    e = tmp_path / "empty"
    e.mkdir()
    (e / "config.json").write_text((ckpt_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"no \*.safetensors"):
        load_checkpoint(e)
    (e / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors: \\(file\\)"):
        load_checkpoint(e)
