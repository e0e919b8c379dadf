"""Generation as users expect it: EOS lists, stop token ids, seeded sampling that repeats exactly, top-k,
penalties, logprobs, generation_config.json defaults, and BOS and chat templates handled as transformers does."""
from __future__ import annotations

import json
import math

import pytest
import torch

from shared.model.checkpoint import inspect_checkpoint
from shared.model.engine import Engine, SamplingParams
from shared.model.hf_config import GenerationDefaults, parse_hf_config
from shared.model.sampling import SamplingOptions, apply_penalties, make_generator, sample_row, token_logprobs
from shared.model.tokenizer import ByteTokenizer, HFTokenizer, NoChatTemplate, load_tokenizer
from shared.model.weights import save_checkpoint


def run(eng: Engine) -> tuple[dict, dict, dict]:
    toks, finish, lps = {}, {}, {}
    while eng.has_work():
        for ev in eng.step().events:
            toks.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.logprobs is not None:
                lps.setdefault(ev.request_id, []).append(ev.logprobs)
            if ev.finish_reason:
                finish[ev.request_id] = ev.finish_reason
    return toks, finish, lps


def test_every_id_of_an_eos_list_stops_and_stop_token_ids_too(model2):
    tok = ByteTokenizer(model2.cfg)
    prompt = tok.encode("eos list")
    eng = Engine(model2, tok, kv_blocks=64, block_size=8)
    eng.add("ref", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    greedy = run(eng)[0]["ref"]
    second = greedy[4]
    listed = model2.cfg.with_(eos_token_id=(999 % model2.cfg.vocab_size, second))  # Llama 3: [eos, eot]
    eng2 = Engine(type(model2)(listed, seed=3), ByteTokenizer(listed), kv_blocks=64, block_size=8)
    eng2.add("a", prompt, SamplingParams(max_tokens=12))
    eng2.add("b", prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(greedy[2],)))
    toks, finish, _ = run(eng2)
    assert toks["a"] == greedy[:greedy.index(second) + 1] and finish["a"] == "stop"
    assert toks["b"] == greedy[:greedy.index(greedy[2]) + 1] and finish["b"] == "stop"


def test_a_seeded_sample_repeats_exactly(model2):
    tok = ByteTokenizer(model2.cfg)
    prompt = tok.encode("sampling")
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=40, seed=1234, ignore_eos=True,
                       presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)

    def once(params, others=0):
        eng = Engine(model2, tok, kv_blocks=64, block_size=8)
        for i in range(others):  # other requests in the batch do not change this one's draws
            eng.add(f"o{i}", tok.encode(f"other {i}"), SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                                                                      ignore_eos=True))
        eng.add("x", prompt, params)
        return run(eng)[0]["x"]

    a = once(p)
    assert a == once(p) == once(p, others=2)
    from dataclasses import replace
    assert a != once(replace(p, seed=1235))


def test_top_k_and_penalties():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    g = make_generator(0)
    assert {sample_row(logits, 1.0, 1.0, g, top_k=2) for _ in range(300)} == {0, 1}
    assert {sample_row(logits, 1.0, 1.0, g, top_k=1) for _ in range(20)} == {0}
    out = apply_penalties(logits, SamplingOptions(presence_penalty=0.5, frequency_penalty=0.25), None, [0, 0, 3])
    assert out.tolist() == [3.0 - 0.5 - 0.5, 2.0, 1.0, 0.0 - 0.5 - 0.25, -1.0]
    out = apply_penalties(logits, SamplingOptions(repetition_penalty=2.0), torch.tensor([1]), [4])
    assert out.tolist() == [3.0, 1.0, 1.0, 0.0, -2.0]  # positive logits divided, negative multiplied
    assert logits.tolist() == [3.0, 2.0, 1.0, 0.0, -1.0]  # not modified in place


def test_penalties_change_a_greedy_continuation(model2):
    tok = ByteTokenizer(model2.cfg)
    prompt = tok.encode("aaaa")
    eng = Engine(model2, tok, kv_blocks=64, block_size=8)
    eng.add("plain", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add("pen", prompt, SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=2.0))
    toks = run(eng)[0]
    assert toks["plain"] != toks["pen"]
    assert len(set(toks["pen"])) >= len(set(toks["plain"]))


def test_logprobs_are_the_models_own(model2):
    tok = ByteTokenizer(model2.cfg)
    prompt = tok.encode("logprobs")
    eng = Engine(model2, tok, kv_blocks=64, block_size=8)
    eng.add("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))
    toks, _, lps = run(eng)
    ref = torch.log_softmax(model2.forward_reference(prompt + toks["a"][:-1]), -1)
    assert len(lps["a"]) == 6
    for k, (lp, top) in enumerate(lps["a"]):
        row = ref[len(prompt) - 1 + k]
        assert math.isclose(lp, float(row[toks["a"][k]]), abs_tol=1e-4)
        assert [t for t, _ in top] == row.topk(3).indices.tolist() and top[0][0] == toks["a"][k]
    assert token_logprobs(torch.tensor([0.0, 0.0]), 1, 0) == (pytest.approx(math.log(0.5)), [])


def test_generation_config_and_eos_lists_are_read(tmp_path, model2):
    d = save_checkpoint(model2, tmp_path / "ck")
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                          "repetition_penalty": 1.05, "eos_token_id": [1, 7]}))
    info = inspect_checkpoint(d)
    assert info.generation == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05,
                                                 eos_token_ids=(1, 7))
    assert info.config.eos_token_ids == (1, 7)  # config.json's 1 and generation_config.json's 7 both stop
    (d / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p: out of range"):
        inspect_checkpoint(d)


def test_a_config_without_bos_or_eos_gets_none_not_made_up_ids():
    cfg = parse_hf_config({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
                           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4})
    assert cfg.bos_token_id is None and cfg.eos_token_ids == () and cfg.attention_bias


@pytest.fixture
def hf_tok_dir(tmp_path, tokenizer_json, cfg2):
    """A tokenizer saved by transformers: <s> added by the post-processor, a chat template writing bos_token."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, processors
    t = Tokenizer.from_file(str(tokenizer_json))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tpl = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
           "{% if add_generation_prompt %}[assistant] {% endif %}")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                                chat_template=tpl)
    fast.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok", fast


def test_bos_and_chat_template_as_transformers(hf_tok_dir, cfg2):
    d, ref = hf_tok_dir
    ref = __import__("transformers").AutoTokenizer.from_pretrained(str(d))
    tok = load_tokenizer(d, cfg2)
    assert isinstance(tok, HFTokenizer) and tok.add_bos
    for text in ["the quick brown fox", "naïve café", ""]:
        assert tok.encode_prompt(text) == ref(text).input_ids
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy dog"}]
    ids = tok.encode_chat(msgs)
    assert ids == list(ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert ids.count(0) == 1 and ids[0] == 0  # the template's BOS, once


def test_a_checkpoint_without_a_chat_template_refuses_chat(ckpt_dir, cfg2):
    from services.gateway.core import ApiError, ParsedRequest
    from services.gateway.prompt import render_prompt
    tok = load_tokenizer(ckpt_dir, cfg2)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(NoChatTemplate):
        tok.apply_chat_template(msgs)
    with pytest.raises(ApiError) as e:
        render_prompt(tok, ParsedRequest(chat=True, model="t", messages=tuple(msgs)))
    assert (e.value.status, e.value.code, e.value.param) == (400, "unsupported_parameter", "messages")
    assert "no chat template" in e.value.message
