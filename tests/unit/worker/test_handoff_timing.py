"""When a hand-off's two sides touch the compute thread (services/worker/handoff.py): the guest exports a sequence
right after the step that gave its first token, so sending it never waits for the lane's next step; the home
imports, commits and resumes a received sequence at one step boundary (a pending op of its serve loop), without a
compute-thread round trip, so it joins the home's next step."""
import asyncio

from types import SimpleNamespace

import pytest

from services.worker.handoff import HandOffs, _Joining


class _Engine:
    def __init__(self) -> None:
        self.paused, self.exports = set(), []

    def pause(self, rid: str) -> bool:
        self.paused.add(rid)
        return True

    def resume(self, rid: str) -> None:
        self.paused.discard(rid)

    def export_sequence(self, rid: str):
        self.exports.append(rid)
        return SimpleNamespace(kv=[], output=[7], computed=10, pending="", generator_state=None, detok=[])


def _event(rid: str, completion_tokens: int = 1, finish=None):
    return SimpleNamespace(request_id=rid, token_ids=[7], completion_tokens=completion_tokens, finish_reason=finish)


def test_the_guest_exports_a_sequence_on_the_step_that_gave_its_first_token():
    eng = _Engine()
    h = HandOffs(SimpleNamespace(tracker=SimpleNamespace(items={"r1": object(), "r2": object()})))
    h.pause_first_tokens(eng, [_event("r1"), _event("r2", completion_tokens=2), _event("r3")])
    assert h.ready == {"r1"} and eng.paused == {"r1"}
    assert eng.exports == ["r1"]  # on this (compute) thread, before the lane's next step
    assert set(h._exported) == {"r1"}


@pytest.mark.asyncio
async def test_sending_uses_the_state_exported_with_the_first_token(monkeypatch):
    eng = _Engine()
    sent = []

    async def no_compute(fn, *args):  # the compute thread is busy with the lane's next step
        raise AssertionError(f"send waited for the compute thread: {fn}")

    class _Producer:
        async def add(self, stream, msg, durable=False):
            sent.append(msg)

    req = SimpleNamespace(request_id="r1", tenant="ta", prompt_ids=[1] * 10, max_tokens=4)
    track = SimpleNamespace(req=req, kv_blocks=1, seq=1, started_ts=0.0, first_token_ts=0.0, completion_tokens=1)
    w = SimpleNamespace(tracker=SimpleNamespace(items={"r1": track}), engine_of={"r1": eng}, producer=_Producer(),
                        redis=None, p="t:", worker_id="w", device=SimpleNamespace(id="g0"))
    h = HandOffs(w)
    h._on_compute = no_compute
    h.pause_first_tokens(eng, [_event("r1")])
    eng.blocks_needed = lambda n, m: 1
    eng.kv_bytes_per_block = 1

    async def home_for(req, need):
        return "h0"

    h._home_for = home_for
    steps = []

    async def handoff_step(redis, p, rid, op, *args):
        steps.append(op)
        return True  # begin: this guest owns the request; abort: no reply came, the guest gives up and keeps it

    monkeypatch.setattr("services.worker.handoff.handoff_step", handoff_step)
    monkeypatch.setattr("services.worker.handoff.HANDOFF_TIMEOUT_S", 0.01)
    resumed = []

    async def resume(eng_, rid, reason):
        resumed.append((rid, reason))

    h._resume = resume
    await h.send("r1")
    assert eng.exports == ["r1"], resumed  # exported once, with the first token
    assert resumed == [("r1", "timeout")], resumed
    assert len(sent) == 1 and sent[0].request.request_id == "r1" and sent[0].computed == 10
    assert steps == ["begin", "abort"] and resumed == [("r1", "timeout")]
    assert not h._exported


class _HomeEngine(_Engine):
    def __init__(self) -> None:
        super().__init__()
        self.imported, self.cancelled = [], []

    def import_sequence(self, state) -> None:
        self.imported.append(state.request_id)

    def cancel(self, rid: str) -> bool:
        self.cancelled.append(rid)
        return True


def _home(monkeypatch, committed: bool):
    eng, tracked = _HomeEngine(), {}

    async def no_compute(fn, *args):
        raise AssertionError(f"the join waited for the compute thread: {fn}")

    async def handoff_step(redis, p, rid, op, *args):
        assert op == "commit" and rid in eng.imported and rid in eng.paused  # imported (paused) before the commit
        return committed

    def add(req, entry_id, nblocks):
        tracked[req.request_id] = SimpleNamespace()
        return tracked[req.request_id]

    monkeypatch.setattr("services.worker.handoff.handoff_step", handoff_step)
    w = SimpleNamespace(engine=eng, redis=None, p="t:", worker_id="w", device=SimpleNamespace(id="h0"),
                        tracker=SimpleNamespace(add=add), engine_of={})
    h = HandOffs(w)
    h._on_compute = no_compute
    return h, eng, tracked, w


async def _join(h):
    req = SimpleNamespace(request_id="r1", tenant="ta")
    msg = SimpleNamespace(request=req, token="tok", seq=2, started_ts=1.0, first_token_ts=2.0, completion_tokens=1)
    j = _Joining(msg, SimpleNamespace(request_id="r1", kv=[]), "e-1", 3, asyncio.get_running_loop().create_future())
    await h.join(j)
    return j.done.result()


@pytest.mark.asyncio
async def test_the_home_commits_and_resumes_a_received_sequence_at_one_step_boundary(monkeypatch):
    h, eng, tracked, w = _home(monkeypatch, committed=True)
    assert await _join(h) == "ok"
    assert eng.imported == ["r1"] and not eng.paused and not eng.cancelled  # runs in the step planned next
    assert "r1" in tracked and w.engine_of["r1"] is eng and h.stats["received"] == 1


@pytest.mark.asyncio
async def test_a_sequence_the_guest_gave_up_on_is_dropped_at_the_boundary(monkeypatch):
    h, eng, tracked, w = _home(monkeypatch, committed=False)
    assert await _join(h) == "given_up"
    assert eng.cancelled == ["r1"] and not tracked and "r1" not in w.engine_of
