"""Home-first time sharing between a worker's own engine and its guest lanes (services/worker/lanes.py)."""
from types import SimpleNamespace

from services.worker.lanes import GuestLanes, Lane


class _Eng:
    def __init__(self, work: bool) -> None:
        self.work = work

    def has_work(self) -> bool:
        return self.work


def _lanes(share: float) -> tuple[GuestLanes, _Eng, _Eng]:
    gl = GuestLanes({}, factory=lambda t, n: None, kv_blocks_for=lambda t: 0)
    guest = _Eng(True)
    gl.lanes["tb"] = Lane("tb", engine=guest, leases={"l1": SimpleNamespace(share=share)})
    return gl, _Eng(True), guest


def _run(gl: GuestLanes, home: _Eng, n: int) -> list[bool]:
    """n iterations of 10 ms each; True where a lane's engine ran."""
    out, t = [], 1000.0
    for _ in range(n):
        eng = gl.next_engine(home)
        guest = eng is not home
        gl.record(guest, t, t + 0.01)
        t += 0.01
        out.append(guest)
    return out


def test_a_lane_never_runs_twice_in_a_row_while_the_home_has_work(monkeypatch):
    gl, home, _ = _lanes(share=0.9)
    clock = iter(1000.0 + 0.01 * i for i in range(1000))
    monkeypatch.setattr("services.worker.lanes.time.time", lambda: next(clock))
    seq = _run(gl, home, 40)
    assert any(seq), "the lane got no iteration"
    assert not any(a and b for a, b in zip(seq, seq[1:])), seq


def test_an_idle_home_leaves_the_device_to_the_lane():
    gl, home, guest = _lanes(share=0.3)
    home.work = False
    assert all(gl.next_engine(home) is guest for _ in range(5))


def test_the_lane_keeps_within_its_share(monkeypatch):
    gl, home, _ = _lanes(share=0.2)
    clock = iter(1000.0 + 0.01 * i for i in range(1000))
    monkeypatch.setattr("services.worker.lanes.time.time", lambda: next(clock))
    seq = _run(gl, home, 100)
    assert 0.1 <= sum(seq) / len(seq) <= 0.25


def test_an_ended_lease_keeps_its_share_until_its_sequences_finish(monkeypatch):
    gl, home, guest = _lanes(share=0.4)
    gl.on_revoked(SimpleNamespace(tenant="tb", lease_id="l1"))
    lane = gl.lanes["tb"]
    assert not lane.accepting and gl.engine_for("tb") is None  # no new sequences
    assert lane.share() == 0.4  # but those admitted under the lease keep its share
    clock = iter(1000.0 + 0.01 * i for i in range(1000))
    monkeypatch.setattr("services.worker.lanes.time.time", lambda: next(clock))
    seq = _run(gl, home, 100)
    assert 0.3 <= sum(seq) / len(seq) <= 0.45
    guest.work = False  # done: the ended lease is forgotten
    gl.next_engine(home)
    assert lane.share() == 0.0 and not lane.draining


def test_accepting_names_the_lanes_that_take_new_sequences():
    gl = GuestLanes({}, factory=lambda t, n: None, kv_blocks_for=lambda t: 0)
    gl.lanes["tb"] = Lane("tb", engine=_Eng(False), leases={"l1": SimpleNamespace(share=0.5)})
    gl.lanes["tc"] = Lane("tc", engine=None, leases={"l2": SimpleNamespace(share=0.5)})  # not staged yet
    assert gl.accepting() == frozenset({"tb"})
    gl.on_revoked(SimpleNamespace(tenant="tb", lease_id="l1"))
    assert gl.accepting() == frozenset()
