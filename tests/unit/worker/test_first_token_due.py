"""A worker with ``SLICESCHED_DEADLINE_CHUNKS=1`` hands each request's first-token deadline to the engine that runs it
and prices that engine's iterations with the cost model of its device's kind (``shared/model/deadline.py``)."""
import math
from types import SimpleNamespace

from shared.config import PRESETS, SLA
from shared.costmodel import cost_for
from shared.costmodel.sla import request_targets
from services.worker.service import WorkerService

CFG = PRESETS["llama-7b"]
SPEC = SimpleNamespace(sla=SLA(ttft_ms=200, tpot_ms=50, slowdown=5.0, kind="h100-80gb"),
                       model=SimpleNamespace(config=CFG))


def _worker(on: bool, kind: str = "h100-80gb"):
    return SimpleNamespace(s=SimpleNamespace(deadline_chunks=on), tenants_by_name={"ta": SPEC},
                           device=SimpleNamespace(kind=kind), _no_deadline=set())


def _req(arrival: float = 1000.0, n: int = 300):
    return SimpleNamespace(tenant="ta", prompt_ids=[1] * n, max_tokens=20, arrival_ts=arrival)


def test_off_by_default_the_engine_plans_in_arrival_order():
    eng = SimpleNamespace(deadline_step=None)
    assert WorkerService._first_token_due(_worker(False), eng, _req()) == math.inf
    assert eng.deadline_step is None


def test_on_the_deadline_is_the_arrival_plus_the_ttft_target_and_the_engine_prices_its_steps():
    eng = SimpleNamespace(deadline_step=None, time_scale=2.0)  # an emulated engine running at half speed
    due = WorkerService._first_token_due(_worker(True), eng, _req())
    assert due == 1000.0 + request_targets(SPEC.sla, CFG, 300, 20)[0]
    assert eng.deadline_step(4, 400, 300, 45150, 300, 5) == 2.0 * cost_for(CFG, "h100-80gb").iteration_time(
        4, 400, 300, 45150, 300, 5)


def test_a_kind_without_a_profile_keeps_arrival_order_and_says_so_once():
    w, eng = _worker(True, kind="no-such-kind"), SimpleNamespace(deadline_step=None)
    assert WorkerService._first_token_due(w, eng, _req()) == math.inf
    assert WorkerService._first_token_due(w, eng, _req()) == math.inf
    assert eng.deadline_step is None and w._no_deadline == {"ta"}
