"""Tokenizers: byte fallback, tokenizer.json, incremental detokenization, chat templates."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.model.config import PRESETS
from shared.model.tokenizer import (ByteTokenizer, HFTokenizer, IncrementalDetokenizer, load_tokenizer)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_fallback_round_trips_utf8(text):
    tok = ByteTokenizer(PRESETS["tiny"])
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    det = IncrementalDetokenizer(tok)
    pieces = [det.push([i]) for i in ids] + [det.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_byte_fallback_specials_and_bos():
    tok = load_tokenizer(None, PRESETS["tiny"])
    assert isinstance(tok, ByteTokenizer) and (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    assert tok.encode("hi", add_bos=True) == [256, 104, 105]
    assert tok.decode([256, 104, 105, 257, 300]) == "hi"
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(PRESETS["tiny"].with_(vocab_size=100))


def test_incremental_detokenizer_holds_partial_character_for_hf(tokenizer_json, cfg2):
    tok = HFTokenizer(tokenizer_json, cfg2)
    text = "héllo wörld, naïve café 日本語も"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    det = IncrementalDetokenizer(tok, tok.encode("prompt"))
    pieces = [det.push([i]) for i in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_load_tokenizer_from_checkpoint(ckpt_dir, cfg2):
    tok = load_tokenizer(ckpt_dir, cfg2)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("the quick", add_bos=True)[0] == 0
    assert tok.decode([0] + tok.encode("the quick") + [1]) == "the quick"


def test_simple_chat_template_and_checkpoint_template(tmp_path, tokenizer_json, cfg2):
    tok = ByteTokenizer(PRESETS["tiny"])
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"role": "user"}])
    d = tmp_path / "ck"
    d.mkdir()
    (d / "tokenizer.json").write_text(tokenizer_json.read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    hf = load_tokenizer(d, cfg2)
    assert hf.apply_chat_template(msgs) == "<s>[system]be brief[user]hi[assistant]"


def test_bad_tokenizer_json_names_file(tmp_path, cfg2):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path, cfg2)
