"""Handing a prefilled sequence from one engine to another (a guest lane's prompt, decoded at home): the tokens and
text are exactly those of the sequence left where it started; refusals change nothing."""
from __future__ import annotations

import pytest

from shared.model.config import PRESETS
from shared.model.engine import Engine, SamplingParams
from shared.model.llama import LlamaModel
from shared.model.tokenizer import ByteTokenizer, load_tokenizer
from shared.model.weights import load_checkpoint


def _run(eng: Engine, toks: dict, text: dict, finish: dict, max_steps: int = 1000, until=None) -> None:
    for _ in range(max_steps):
        if not eng.has_work() or (until is not None and until()):
            return
        for ev in eng.step().events:
            toks.setdefault(ev.request_id, []).extend(ev.token_ids)
            text[ev.request_id] = text.get(ev.request_id, "") + ev.text
            if ev.finish_reason:
                finish[ev.request_id] = ev.finish_reason


def _handoff(model, tok, prompts: dict, params: dict, hand: set, block_size: int = 4):
    """Run ``prompts`` on a guest engine; each id in ``hand`` moves to a home engine once it has its first token
    (the guest then cancels it) and the two engines step in turn. Returns tokens, text, finish reasons."""
    guest = Engine(model, tok, kv_blocks=64, block_size=block_size, max_batch_tokens=8)
    home = Engine(model, tok, kv_blocks=48, block_size=8, max_batch_tokens=8)  # another layout: other slots
    home.add("own", tok.encode("a tenant's own request"), SamplingParams(max_tokens=9, ignore_eos=True))
    for rid, p in prompts.items():
        guest.add(rid, p, params[rid])
    toks: dict = {}
    text: dict = {}
    finish: dict = {}
    moved: set = set()
    for _ in range(500):
        if not (guest.has_work() or home.has_work()):
            break
        _run(guest, toks, text, finish, max_steps=1)
        for rid in hand - moved:
            if toks.get(rid) and rid not in finish:
                home.import_sequence(guest.export_sequence(rid))
                assert guest.cancel(rid)
                moved.add(rid)
        _run(home, toks, text, finish, max_steps=1)
    assert moved == hand
    assert guest.kv_blocks_free == guest.kv_blocks_total and home.kv_blocks_free == home.kv_blocks_total
    return toks, text, finish


@pytest.fixture(scope="module")
def ck_model(ckpt_dir):
    model = load_checkpoint(ckpt_dir)
    return model, load_tokenizer(ckpt_dir, model.cfg)


def _reference(model, tok, prompts, params):
    eng = Engine(model, tok, kv_blocks=64, block_size=4, max_batch_tokens=8)
    for rid, p in prompts.items():
        eng.add(rid, p, params[rid])
    toks: dict = {}
    text: dict = {}
    finish: dict = {}
    _run(eng, toks, text, finish)
    return toks, text, finish


def test_handed_off_sequences_continue_exactly(ck_model):
    """Greedy, seeded sampling with penalties, and stop strings (text held back across the hand-off)."""
    model, tok = ck_model
    prompts = {"g": tok.encode("the quick brown fox"), "s": tok.encode("slice scheduling places"),
               "t": tok.encode("héllo wörld, naïve café")}
    params = {"g": SamplingParams(max_tokens=14, ignore_eos=True),
              "s": SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True,
                                  repetition_penalty=1.3),
              "t": SamplingParams(max_tokens=16, temperature=0.7, seed=5, stop=("zzq",), ignore_eos=True)}
    ref = _reference(model, tok, prompts, params)
    got = _handoff(model, tok, prompts, params, {"g", "s", "t"})
    for rid in prompts:
        assert got[0][rid] == ref[0][rid], rid
        assert got[1][rid] == ref[1][rid], rid
        assert got[2][rid] == ref[2][rid], rid


def test_handoff_with_the_byte_tokenizer_keeps_partial_characters(model2):
    tok = ByteTokenizer(model2.cfg)
    prompts = {"b": tok.encode("ünïcödé — 日本語")}
    params = {"b": SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)}
    ref = _reference(model2, tok, prompts, params)
    got = _handoff(model2, tok, prompts, params, {"b"})
    assert got[0]["b"] == ref[0]["b"] and got[1]["b"] == ref[1]["b"]


def test_export_refuses_a_sequence_still_in_its_prompt(model2):
    tok = ByteTokenizer(model2.cfg)
    eng = Engine(model2, tok, kv_blocks=64, block_size=4, max_batch_tokens=4)
    eng.add("r", tok.encode("a prompt longer than one chunk"), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="past its prompt"):
        eng.export_sequence("r")
    eng.step()
    with pytest.raises(ValueError, match="past its prompt"):
        eng.export_sequence("r")
    with pytest.raises(ValueError, match="past its prompt"):
        eng.export_sequence("nope")


def test_import_refusals_change_nothing(model2):
    tok = ByteTokenizer(model2.cfg)
    src = Engine(model2, tok, kv_blocks=64, block_size=4, max_batch_tokens=64)
    src.add("r", tok.encode("hand me over"), SamplingParams(max_tokens=8, ignore_eos=True))
    src.step()
    state = src.export_sequence("r")

    full = Engine(model2, tok, kv_blocks=5, block_size=4, max_batch_tokens=64)  # 20 positions < 12 + 8 + ...
    full.add("x", tok.encode("taken"), SamplingParams(max_tokens=4))
    before = full.kv_blocks_free
    with pytest.raises(ValueError, match="no running slot or KV blocks"):
        full.import_sequence(state)
    assert full.kv_blocks_free == before and full.running_ids() == ["x"]

    dup = Engine(model2, tok, kv_blocks=64, block_size=4, max_batch_tokens=64)
    dup.add("r", tok.encode("same id"), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="duplicate"):
        dup.import_sequence(state)

    other = LlamaModel(PRESETS["tiny-2l"].with_(num_key_value_heads=4), seed=1)
    wrong = Engine(other, ByteTokenizer(other.cfg), kv_blocks=64, block_size=4, max_batch_tokens=64)
    with pytest.raises(ValueError, match="does not match"):
        wrong.import_sequence(state)
    assert wrong.kv_blocks_free == wrong.kv_blocks_total and not wrong.has_work()


def test_a_paused_sequence_waits_and_resumes_exactly(model2):
    """While a hand-over is in flight the guest leaves the sequence out of its steps (KV kept); a refused
    hand-over resumes it with the tokens it would have produced anyway."""
    tok = ByteTokenizer(model2.cfg)
    params = {"p": SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
              "o": SamplingParams(max_tokens=6, ignore_eos=True)}
    prompts = {"p": tok.encode("pause me"), "o": tok.encode("others go on")}
    ref = _reference(model2, tok, prompts, params)
    eng = Engine(model2, tok, kv_blocks=64, block_size=4, max_batch_tokens=8)
    for rid, p in prompts.items():
        eng.add(rid, p, params[rid])
    toks: dict = {}
    text: dict = {}
    finish: dict = {}
    _run(eng, toks, text, finish, until=lambda: bool(toks.get("p")))
    assert eng.pause("p") and not eng.pause("nope")
    held = len(toks["p"])
    free = eng.kv_blocks_free
    _run(eng, toks, text, finish)  # only "o" runs
    assert len(toks["p"]) == held and finish.get("o") == "length"
    assert not eng.has_work() and eng.running_ids() == ["p"]
    assert eng.kv_blocks_free > free  # "o" freed its KV; "p" keeps its own
    eng.resume("p")
    _run(eng, toks, text, finish)
    assert toks == ref[0] and text == ref[1] and finish == ref[2]
    assert eng.kv_blocks_free == eng.kv_blocks_total
