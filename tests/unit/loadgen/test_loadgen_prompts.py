"""Prompt synthesis to exact token counts."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from loadgen.prompts import ByteLevelSynthesizer, TokenizerSynthesizer, synthesizer_for
from shared.config import ConfigError, parse_tenants


def test_byte_level_exact_and_varied():
    s = ByteLevelSynthesizer()
    for n in (2, 3, 17, 256, 5000, 70000):
        p = s.prompt(n, salt=n)
        assert len(p.encode()) == n - 1 and p.isascii() and s.count(p) == n
    assert s.prompt(100, salt=1) != s.prompt(100, salt=2)
    assert s.prompt(100, salt=1) == s.prompt(100, salt=1)
    assert len(ByteLevelSynthesizer(add_bos=False).prompt(10)) == 10


def bpe_tokenizer(path):
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ["the cat sat on the mat and the dog sat by the door with one more word for all of us"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "[UNK]"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path))
    return path


def test_tokenizer_synthesizer_exact(tmp_path):
    s = TokenizerSynthesizer(bpe_tokenizer(tmp_path / "tokenizer.json"))
    assert s.special == 1 and "the" in s.words
    for n in (2, 5, 64, 333):
        for salt in (0, 1):
            assert s.count(s.prompt(n, salt)) == n


def test_synthesizer_for_tenants(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, '
                                    '"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}')
    bpe_tokenizer(ck / "tokenizer.json")
    cfg = parse_tenants({"tenants": [
        {"name": "x", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d"]},
        {"name": "y", "model": {"checkpoint": str(ck)}, "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d"]}]})
    assert isinstance(synthesizer_for(cfg.tenants[0]), ByteLevelSynthesizer)
    assert isinstance(synthesizer_for(cfg.tenants[1]), TokenizerSynthesizer)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        TokenizerSynthesizer(tmp_path / "bad.json")


def test_synthesizer_for_the_default_gguf_tenants_counts_like_the_server():
    from shared.config import REPO_CONFIGS, load_cluster, load_tenants
    from shared.model.tokenizer import load_tokenizer
    t = load_tenants(REPO_CONFIGS / "tenants.yaml", load_cluster(REPO_CONFIGS / "cluster.yaml")).tenants[0]
    s = synthesizer_for(t)
    tok = load_tokenizer(t.model.checkpoint, t.model.config)
    assert isinstance(s, TokenizerSynthesizer)
    for n in (3, 64, 301):
        assert len(tok.encode_prompt(s.prompt(n, salt=n))) == n
