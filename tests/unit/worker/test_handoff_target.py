"""Where a guest lane hands a prefilled sequence: the fill rule (shared/handback.py) and the worker's reading of it
on the GMG's device rows (services/worker/handoff.py ``HandOffs._fill_target``)."""
from types import SimpleNamespace

from services.worker.handoff import HandOffs
from shared.config import REPO_CONFIGS, load_cluster, load_tenants
from shared.costmodel import cost_for
from shared.handback import HANDBACK_FILL, best_fit, step_with
from shared.messages import InferenceRequest

PROMPT = 100
BUDGET = 2048


def test_best_fit_takes_the_longest_step_still_within_the_bound():
    assert best_fit([("a", 0.02), ("b", 0.09), ("c", 0.2)], 0.1) == "b"
    assert best_fit([("a", 0.1), ("b", 0.05)], 0.1) == "a"  # the bound itself is within
    assert best_fit([("a", 0.2)], 0.1) is None
    assert best_fit([], 0.1) is None


def test_a_step_grows_with_the_batch_and_its_context():
    cost = cost_for(_tenants()["em-a"].model.config, "cpu")
    assert step_with(cost, 0, 0, PROMPT) < step_with(cost, 8, 8 * 300, PROMPT) < step_with(cost, 8, 8 * 3000, PROMPT)


def test_a_step_carries_the_chunk_of_queued_prompt_tokens_the_budget_leaves():
    cost = cost_for(_tenants()["em-a"].model.config, "cpu")
    alone = step_with(cost, 8, 8 * 300, PROMPT)
    assert step_with(cost, 8, 8 * 300, PROMPT, 0, BUDGET) == alone  # nothing queued: the decode step
    assert alone < step_with(cost, 8, 8 * 300, PROMPT, 200, BUDGET) < step_with(cost, 8, 8 * 300, PROMPT, 4000, BUDGET)
    # the chunk is what the budget leaves beside the batch: a larger queue than that costs no more per step
    assert step_with(cost, 8, 8 * 300, PROMPT, 4000, BUDGET) == step_with(cost, 8, 8 * 300, PROMPT, 9000, BUDGET)


def _tenants():
    cluster = load_cluster(REPO_CONFIGS / "cluster-emulated8.yaml")
    return {t.name: t for t in load_tenants(REPO_CONFIGS / "tenants-emulated6.yaml", cluster).tenants}


def _row(running: int, free: int = 1 << 30, state: str = "ready", tenant: str = "em-a",
         prefill: int = 0) -> dict[str, str]:
    """A device row as the GMG keeps it: ``running`` sequences of 300 positions each, ``prefill`` prompt tokens
    queued."""
    kv_per_token = _tenants()[tenant].model.config.kv_bytes_per_token()
    return {"kind": "cpu", "home_tenant": tenant, "state": state, "running": str(running),
            "kv_used": str(running * 300 * kv_per_token), "limit": str(free), "reserved": "0",
            "prefill_tokens": str(prefill)}


def _target(rows: dict[str, dict[str, str]], need: int = 1 << 20) -> str | None:
    h = HandOffs(SimpleNamespace(tenants_by_name=_tenants(), device=SimpleNamespace(id="e2"),
                                 engine=SimpleNamespace(max_batch_tokens=BUDGET)))
    req = InferenceRequest(msg_id="m", request_id="r", tenant="em-a", gateway="gw", prompt_ids=[1] * PROMPT,
                           max_tokens=20)
    return h._fill_target(rows, req, "e0", need)


def test_the_worker_fills_another_device_of_the_container_once_the_homes_step_would_pass_the_target():
    """em-a's TPOT target is 150 ms: e0 with 64 sequences would step past 0.95 × that, e1 with 8 would not."""
    cost = cost_for(_tenants()["em-a"].model.config, "cpu")
    bound = HANDBACK_FILL * 0.150
    assert step_with(cost, 64, 64 * 300, PROMPT) > bound > step_with(cost, 32, 32 * 300, PROMPT)
    assert _target({"e0": _row(64), "e1": _row(8)}) == "e1"
    assert _target({"e0": _row(8), "e1": _row(0)}) is None  # the home is within: it keeps the sequence
    assert _target({"e0": _row(64), "e1": _row(64)}) is None  # nobody is within: the rule before applies
    assert _target({"e0": _row(64), "e1": _row(8, free=1000)}) is None  # no room for the KV
    assert _target({"e0": _row(64), "e1": _row(8, state="down")}) is None
    assert _target({"e0": _row(64), "e1": _row(8, tenant="em-b")}) is None  # not the tenant's container
    # best fit: of two devices within the bound, the fuller one
    assert _target({"e0": _row(64), "e1": _row(8), "e3": _row(32)}) == "e3"
    # ... priced with the prompts each still has to prefill: e3's queue puts its step past the bound
    assert step_with(cost, 32, 32 * 300, PROMPT, 2000, BUDGET) > bound
    assert _target({"e0": _row(64), "e1": _row(8), "e3": _row(32, prefill=2000)}) == "e1"
    # a home within the bound on its batch alone is past it while it prefills a queue
    assert _target({"e0": _row(32, prefill=2000), "e1": _row(8)}) == "e1"


def test_the_worker_counts_the_sequences_a_home_took_since_its_heartbeat():
    """The GMG's live ``requests`` count (starts and hand-offs as they happen) over a heartbeat's ``running``: a home
    whose last heartbeat showed 8 sequences but which has taken 120 more since is past the bound."""
    assert _target({"e0": _row(8), "e1": _row(8)}) is None
    assert _target({"e0": {**_row(8), "requests": "128"}, "e1": _row(8)}) == "e1"
    assert _target({"e0": {**_row(8), "requests": "4"}, "e1": _row(8)}) is None  # fewer: the heartbeat's own


def test_a_device_kind_without_a_profile_leaves_the_rule_before():
    assert _target({"e0": {**_row(64), "kind": "no-such-kind"}, "e1": _row(8)}) is None
