"""A worker with ``SLICESCHED_DEADLINE_CHUNKS=1`` hands each request's first-token deadline to the engine that runs it
and prices that engine's iterations with the cost model of its device's kind (``shared/model/deadline.py``); with
``SLICESCHED_STEP_CAP_S`` it caps that engine's steps (``shared/model/step_cap.py``)."""
import math
from types import SimpleNamespace

from shared.config import PRESETS, SLA
from shared.costmodel import cost_for
from shared.costmodel.sla import request_targets
from services.worker.service import WorkerService

CFG = PRESETS["llama-7b"]
SPEC = SimpleNamespace(sla=SLA(ttft_ms=200, tpot_ms=50, slowdown=5.0, kind="h100-80gb"),
                       model=SimpleNamespace(config=CFG))


def _worker(on: bool, kind: str = "h100-80gb", cap: float = 0.0):
    return SimpleNamespace(s=SimpleNamespace(deadline_chunks=on, step_cap_s=cap), tenants_by_name={"ta": SPEC},
                           device=SimpleNamespace(kind=kind), _no_deadline=set())


def _req(arrival: float = 1000.0, n: int = 300):
    return SimpleNamespace(tenant="ta", prompt_ids=[1] * n, max_tokens=20, arrival_ts=arrival)


def test_off_by_default_the_engine_plans_in_arrival_order():
    eng = SimpleNamespace(deadline_step=None, step_cap=None)
    assert WorkerService._first_token_due(_worker(False), eng, _req()) == math.inf
    assert eng.deadline_step is None and eng.step_cap is None


def test_on_the_deadline_is_the_arrival_plus_the_ttft_target_and_the_engine_prices_its_steps():
    eng = SimpleNamespace(deadline_step=None, step_cap=None, time_scale=2.0)  # an emulated engine running at half speed
    due = WorkerService._first_token_due(_worker(True), eng, _req())
    assert due == 1000.0 + request_targets(SPEC.sla, CFG, 300, 20)[0]
    assert eng.deadline_step(4, 400, 300, 45150, 300, 5) == 2.0 * cost_for(CFG, "h100-80gb").iteration_time(
        4, 400, 300, 45150, 300, 5)


def test_a_kind_without_a_profile_keeps_arrival_order_and_says_so_once():
    w, eng = _worker(True, kind="no-such-kind"), SimpleNamespace(deadline_step=None, step_cap=None)
    assert WorkerService._first_token_due(w, eng, _req()) == math.inf
    assert WorkerService._first_token_due(w, eng, _req()) == math.inf
    assert eng.deadline_step is None and w._no_deadline == {"ta"}


def test_a_step_cap_alone_caps_the_engine_with_the_same_prices_and_keeps_arrival_order():
    eng = SimpleNamespace(deadline_step=None, step_cap=None, time_scale=2.0)
    assert WorkerService._first_token_due(_worker(False, cap=0.04), eng, _req()) == math.inf
    assert eng.deadline_step is None
    cap, step = eng.step_cap
    assert cap == 0.04
    assert step(4, 400, 300, 45150, 300, 5) == 2.0 * cost_for(CFG, "h100-80gb").iteration_time(4, 400, 300, 45150,
                                                                                             300, 5)


def test_both_options_share_one_price_of_a_step():
    eng = SimpleNamespace(deadline_step=None, step_cap=None)
    due = WorkerService._first_token_due(_worker(True, cap=0.05), eng, _req())
    assert math.isfinite(due) and eng.step_cap[0] == 0.05 and eng.step_cap[1] is eng.deadline_step
