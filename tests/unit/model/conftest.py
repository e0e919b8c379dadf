"""Fixtures for the model tests: small configs, a trained byte-level BPE tokenizer and a tiny checkpoint."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shared.model.config import PRESETS, ModelConfig
from shared.model.llama import LlamaModel
from shared.model.weights import save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_reference.py, shared by the exactness tests

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "slice scheduling places operators on idle accelerators",
    "a tenant's batch runs attention at home and the mlp on a guest",
    "héllo wörld, naïve café: ünïcödé text round-trips — 日本語も",
] * 20


@pytest.fixture(autouse=True)
def _one_thread():
    """Reduction order (and so bit-exact comparisons) must not depend on the host's thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def cfg2() -> ModelConfig:
    """Two layers, GQA (4 heads over 2 KV heads); bos/eos match the BPE tokenizer's special tokens."""
    return PRESETS["tiny-2l"].with_(bos_token_id=0, eos_token_id=1)


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> Path:
    """A 320-token byte-level BPE trained on a tiny corpus; ids 0/1 are <s>/</s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory, cfg2, tokenizer_json) -> Path:
    """A checkpoint directory (config.json, model.safetensors, tokenizer.json) of seeded random weights."""
    model = LlamaModel(cfg2, seed=7)
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt"), tokenizer_json=tokenizer_json)


@pytest.fixture(scope="session")
def model2(cfg2) -> LlamaModel:
    return LlamaModel(cfg2, seed=3)
