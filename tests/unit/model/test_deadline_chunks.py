"""Deadline-aware chunked prefill (``shared/model/deadline.py``): the rule alone, the engine planning by it, and the
simulator's replicas doing the same (``SimConfig.deadline_chunks``)."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest

from shared.config import SLA
from shared.model.deadline import deadline_chunks
from shared.model.engine import Engine, SamplingParams
from shared.model.tokenizer import load_tokenizer
from shared.model.weights import load_checkpoint


def _linear(per_token: float = 1e-3, base: float = 0.01):
    """A step that costs ``base`` plus ``per_token`` per prefill token."""
    return lambda p, pairs, reads, done: base + per_token * p


def test_chunks_go_in_deadline_order_and_fill_the_budget_when_nobody_is_made_late():
    items = [("long", 0, 1500, 10.0), ("short", 0, 100, 5.0)]
    assert deadline_chunks(items, 2048, 0.0, _linear()) == [("short", 100), ("long", 1500)]


def test_a_chunk_that_would_make_a_completed_prompt_late_is_left_to_the_next_step():
    # the short prompt alone: 0.01 + 0.1 = 0.11 s, due at 0.15; with the long one's chunk 1.61 s: it would miss
    items = [("long", 0, 1500, 10.0), ("short", 0, 100, 0.15)]
    assert deadline_chunks(items, 2048, 0.0, _linear()) == [("short", 100)]


def test_no_cut_for_a_prompt_that_is_late_anyway_and_always_one_chunk():
    assert deadline_chunks([("long", 0, 1500, 10.0), ("short", 0, 100, 0.05)], 2048, 0.0,
                           _linear()) == [("short", 100), ("long", 1500)]  # 0.11 s > 0.05: late either way
    assert deadline_chunks([("only", 0, 3000, 0.01)], 2048, 0.0, _linear()) == [("only", 2048)]


def test_a_partial_chunk_sets_no_deadline_and_the_budget_caps_the_step():
    items = [("a", 0, 3000, 0.2), ("b", 0, 100, 0.3)]  # a's first chunk does not complete it: no deadline to keep
    assert deadline_chunks(items, 2048, 0.0, _linear()) == [("a", 2048)]
    assert deadline_chunks([("a", 0, 1000, 1.0), ("b", 500, 1000, 2.0)], 1200, 0.0,
                           _linear()) == [("a", 1000), ("b", 200)]


@pytest.fixture(scope="module")
def ck_model(ckpt_dir):
    model = load_checkpoint(ckpt_dir)
    return model, load_tokenizer(ckpt_dir, model.cfg)


def _first_tokens(eng: Engine) -> dict[str, int]:
    """Step until every request has its first token; the step index each got it in."""
    got: dict[str, int] = {}
    for i in range(100):
        for ev in eng.step().events:
            if ev.token_ids and ev.request_id not in got:
                got[ev.request_id] = i
        if len(got) == 2:
            return got
    raise AssertionError("no first token in 100 steps")


@pytest.mark.parametrize("by_deadline", [False, True])
def test_the_engine_gives_the_urgent_short_prompt_a_step_of_its_own(ck_model, by_deadline):
    model, tok = ck_model
    eng = Engine(model, tok, kv_blocks=64, block_size=4, max_batch_tokens=64)
    if by_deadline:
        eng.clock = lambda: 100.0
        eng.deadline_step = lambda n_dec, kv, p, pairs, reads, sampled: 0.01 + 1e-3 * p
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    eng.add("long", [5] * 40, params, deadline=200.0)  # arrived first, plenty of slack
    eng.add("short", [6] * 8, params, deadline=100.03)  # 8 tokens: 0.018 s alone, 0.058 s beside the long one
    steps = [eng._plan()]
    assert [(s.request_id, c.length) for s, c in steps[0]] == ([("short", 8)] if by_deadline
                                                              else [("long", 40), ("short", 8)])
    got = _first_tokens(eng)
    assert got["short"] == 0 and got["long"] == (1 if by_deadline else 0)


def test_the_engine_admits_by_deadline_when_the_running_slots_are_full(ck_model):
    model, tok = ck_model
    eng = Engine(model, tok, kv_blocks=64, block_size=4, max_batch_tokens=64, max_running=1)
    eng.deadline_step = lambda *a: 0.0
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.add("busy", [5] * 4, params)  # takes the only slot
    eng.add("late", [5] * 4, params, deadline=50.0)
    eng.add("soon", [5] * 4, params, deadline=10.0)
    eng.step()  # "busy" finishes; the next admission is the earliest deadline, not the oldest
    assert eng.running_ids() == ["soon"]


def _one_device_run(deadline: bool):
    from shared.policies import make_policy
    from shared.sim import SimConfig, Simulator
    from shared.sim.synthetic import small_cluster, small_tenants
    from shared.workload import Workload, WorkloadRequest
    c = small_cluster(1, 1)
    t = small_tenants(c, ["llama-7b"])
    ten = t.tenants[0]
    per_request = dataclasses.replace(ten.sla, slowdown=5.0, kind="h100-80gb")
    t = dataclasses.replace(t, tenants=(dataclasses.replace(ten, sla=per_request),))
    # the first request's step is running when the other two arrive: the next step chooses between them
    reqs = (WorkloadRequest("first", 0.0, "t0", 100, 2), WorkloadRequest("long", 0.001, "t0", 1800, 4),
            WorkloadRequest("short", 0.001, "t0", 200, 4))
    w = Workload("two", reqs, t, 1.0, 0)
    sim = Simulator(c, t, make_policy("container"), SimConfig(deadline_chunks=deadline), random.Random(0))
    sim.run(w)
    return {r.rid: r for r in sim.requests}, sim


def test_the_simulator_plans_the_same_way():
    fifo, _ = _one_device_run(False)
    edf, sim = _one_device_run(True)
    short_target = sim.request_targets(edf["short"])[0]
    assert fifo["short"].ttft() > short_target  # in arrival order its first token waits for the long prompt's chunk
    assert edf["short"].ttft() <= short_target < fifo["short"].ttft()
    assert edf["long"].ttft() <= sim.request_targets(edf["long"])[0]  # the long one still within its own target
    assert all(math.isfinite(r.finish) and r.finish > 0 for r in edf.values())
