"""TPOT-bounded chunked prefill (``shared/model/step_cap.py``): the rule alone, the engine planning by it, and the
simulator's replicas doing the same (``SimConfig.step_cap_s``)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from shared.model.engine import Engine, SamplingParams
from shared.model.step_cap import MIN_TOKENS, cap_chunks
from shared.model.tokenizer import load_tokenizer
from shared.model.weights import load_checkpoint


def _linear(per_token: float = 1e-4, base: float = 0.01):
    """A step that costs ``base`` (the decode batch) plus ``per_token`` per prefill token."""
    return lambda p, pairs, reads, done: base + per_token * p


def test_chunks_that_fit_are_kept_whole_and_in_order():
    chunks = [("b", 0, 100, 100), ("a", 0, 50, 50)]
    assert cap_chunks(chunks, 0.1, _linear()) == [("b", 100), ("a", 50)]


def test_the_chunk_that_crosses_the_cap_is_cut_to_the_largest_that_fits_and_the_rest_wait():
    # 0.01 + 1e-4 * p <= 0.05 holds up to p = 400: a keeps 300, b gets 100 of its 1,000, c none
    chunks = [("a", 0, 300, 300), ("b", 0, 1000, 1000), ("c", 0, 10, 10)]
    assert cap_chunks(chunks, 0.05, _linear()) == [("a", 300), ("b", 100)]


def test_a_prompt_progresses_when_the_decode_batch_alone_passes_the_cap():
    assert cap_chunks([("a", 0, 2048, 3000)], 0.005, _linear()) == [("a", MIN_TOKENS)]
    assert cap_chunks([("a", 0, 5, 5)], 0.005, _linear()) == [("a", 5)]  # shorter than the floor: all of it


def test_the_price_sees_the_tokens_already_computed_and_a_completed_prompt():
    seen = []

    def price(p, pairs, reads, done):
        seen.append((p, pairs, reads, done))
        return 0.0
    cap_chunks([("a", 10, 5, 5)], 1.0, price)
    assert seen == [(5, 5 * 10 + 15, 15, 1)]


@pytest.fixture(scope="module")
def ck_model(ckpt_dir):
    model = load_checkpoint(ckpt_dir)
    return model, load_tokenizer(ckpt_dir, model.cfg)


def test_the_engine_caps_prefill_only_while_sequences_decode(ck_model):
    model, tok = ck_model
    eng = Engine(model, tok, kv_blocks=128, block_size=4, max_batch_tokens=64)
    eng.step_cap = (0.03, lambda n_dec, kv, p, pairs, reads, sampled: 0.01 * n_dec + 1e-3 * p)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng.add("first", [5] * 40, params)
    assert [(s.request_id, c.length) for s, c in eng._plan()] == [("first", 40)]  # nothing decodes: no cap
    eng.step()
    eng.add("long", [6] * 60, params)
    plan = [(s.request_id, c.length) for s, c in eng._plan()]
    assert plan == [("first", 1), ("long", 20)]  # 0.01 + 1e-3 * 20 = 0.03: the largest chunk within the cap
    eng.step_cap = None
    assert [(s.request_id, c.length) for s, c in eng._plan()] == [("first", 1), ("long", 60)]


def _decode_beside_a_long_prompt(cap: float):
    """A short request decoding when a long prompt arrives on the same one-device container."""
    from shared.policies import make_policy
    from shared.sim import SimConfig, Simulator
    from shared.sim.synthetic import small_cluster, small_tenants
    from shared.workload import Workload, WorkloadRequest
    c = small_cluster(1, 1)
    t = small_tenants(c, ["llama-7b"])
    ten = t.tenants[0]
    t = dataclasses.replace(t, tenants=(dataclasses.replace(ten, sla=dataclasses.replace(
        ten.sla, slowdown=5.0, kind="h100-80gb")),))
    reqs = (WorkloadRequest("dec", 0.0, "t0", 100, 12), WorkloadRequest("long", 0.02, "t0", 16000, 4))
    sim = Simulator(c, t, make_policy("container"), SimConfig(step_cap_s=cap), random.Random(0))
    sim.run(Workload("two", reqs, t, 1.0, 0))
    return {r.rid: r for r in sim.requests}


def test_the_simulator_caps_the_steps_a_decoding_sequence_waits_through():
    free, capped = _decode_beside_a_long_prompt(0.0), _decode_beside_a_long_prompt(0.03)
    # uncapped, the 16,000-token prompt's 2,048-token chunks stretch the decoding sequence's steps; capped, they
    # stay near 30 ms and the prompt takes more, shorter steps
    assert capped["dec"].tpot() < 0.8 * free["dec"].tpot()
    assert capped["long"].ttft() > free["long"].ttft()
    assert all(r.finish > 0 for r in (*free.values(), *capped.values()))
