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


def test_idle_lane_engines_whose_weights_were_evicted_are_dropped():
    gl = GuestLanes({}, factory=lambda t, n: None, kv_blocks_for=lambda t: 0)
    gl.lanes["ta"] = Lane("ta", engine=_Eng(False))  # idle, weights still resident: kept
    gl.lanes["tb"] = Lane("tb", engine=_Eng(False))  # idle, evicted: dropped
    gl.lanes["tc"] = Lane("tc", engine=_Eng(True))  # evicted but its sequences still run: kept
    gl.lanes["td"] = Lane("td", engine=_Eng(False), leases={"l1": SimpleNamespace(share=0.3)})  # leased: kept
    assert sorted(gl.idle_engines()) == ["ta", "tb"]
    assert gl.drop_evicted({"ta|*"}) == ["tb"]
    assert gl.lanes["tb"].engine is None and gl.lanes["ta"].engine is not None
    assert gl.lanes["tc"].engine is not None and gl.lanes["td"].engine is not None
    gl.lanes["tb"].leases["l2"] = SimpleNamespace(share=0.3)
    assert gl.needs_staging("tb")  # the next lease stages the weights again


class _Home(_Eng):
    def __init__(self, backlog: int) -> None:
        super().__init__(True)
        self.backlog = backlog

    def prefill_backlog(self):
        return self.backlog, ["r"] * bool(self.backlog)


def test_no_lane_iteration_while_the_home_has_prompts_to_prefill(monkeypatch):
    """The simulator's rule (shared/guest_share.py): the home's prompts (its TTFT) come before any lane."""
    gl, _, _ = _lanes(share=0.9)
    home = _Home(backlog=300)
    clock = iter(1000.0 + 0.01 * i for i in range(1000))
    monkeypatch.setattr("services.worker.lanes.time.time", lambda: next(clock))
    assert not any(_run(gl, home, 30))
    assert gl.yield_share(home) == 0.0  # what the heartbeat reports: the policy prices the lane at nothing now
    home.backlog = 0
    assert any(_run(gl, home, 30))
    assert gl.yield_share(home) == 0.9


def test_a_home_near_its_tpot_target_yields_only_its_slack(monkeypatch):
    """A home step of 70 ms against a 100-ms TPOT target leaves 1 − 0.07 / (0.8 × 0.1) = 12.5 % to the lanes, however
    large the lease's share; at 80 ms and above, the floor (2 %)."""
    from shared.guest_share import MIN_GUEST_SHARE
    gl, _, _ = _lanes(share=0.6)
    gl.tpot_s = 0.1
    home = _Home(backlog=0)
    gl.record(False, 0.0, 0.07)
    assert abs(gl.yield_share(home) - 0.125) < 1e-9
    gl.record(False, 0.0, 0.09)
    assert gl.yield_share(home) == 0.0
    clock = iter(1000.0 + 0.01 * i for i in range(10000))
    monkeypatch.setattr("services.worker.lanes.time.time", lambda: next(clock))
    seq = _run(gl, home, 400)  # its steps are recorded as 10 ms from here: it yields all the lease allows
    assert 0.45 <= sum(seq) / len(seq) <= 0.5  # (never two lane iterations in a row: at most half)
    gl, _, _ = _lanes(share=0.6)
    gl.tpot_s = 0.0125  # 10-ms steps within 0.8 × 12.5 ms: no slack, the floor only
    clock = iter(1000.0 + 0.01 * i for i in range(10000))
    seq = _run(gl, home, 400)
    assert 0 < sum(seq) / len(seq) <= MIN_GUEST_SHARE + 0.01
