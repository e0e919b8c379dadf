"""The segment RPC in one process: a guest stages a tenant's MLPs from the home, serves calls bit-identically,
refuses what it must, and the driver side falls back on timeouts and dead connections."""
from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import torch

from services.worker.device_lock import DeviceLock
from services.worker.driver import DriverLink, DriverOptions, HomeWeights, LeaseRemote, fetch_weights
from services.worker.guest import GuestHost, StagedWeights
from services.worker.segment_server import AsyncSegmentServer, SegmentClient, SegmentServer, TensorMover
from services.worker.segment_wire import LeaseStatusQuery, WeightsQuery
from shared.messages import LeaseGranted
from shared.model.config import PRESETS
from shared.model.llama import LlamaModel
from shared.transport import ShmTransport

CFG = PRESETS["tiny-2l"]
SEGS = ["mlp[0]", "mlp[1]"]
# tests about results, refusals and transports wait up to 2 s for a reply: the 25 ms default floor is about
# timeouts (tested with its own options below), and a first call on a busy 2-core VM can take longer
PATIENT = DriverOptions(timeout_floor_ms=2000.0)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Site:
    """A home (tenant ``a``) and a guest device, each with a segment server, in this process."""

    def __init__(self, mover_home: TensorMover, mover_guest: TensorMover, source=None) -> None:
        self.model = LlamaModel(CFG, seed=4)
        self.home_weights = HomeWeights("a", self.model, mover_home)
        self.home_server = SegmentServer(self, torch_threads=1)
        self.home_addr = self.home_server.start()
        self.lock = DeviceLock()
        self.weights = StagedWeights("cpu")
        self.fetch_client: SegmentClient | None = None
        self.mover_guest = mover_guest
        self.guest = GuestHost("g0", {"a": CFG}, self.lock, self.weights, source or self._fetch, mover_guest)
        self.guest_server = SegmentServer(self.guest, torch_threads=1)
        self.guest_addr = self.guest_server.start()

    def handle(self, msg, payload):
        return self.home_weights.handle(msg)

    def _fetch(self, lease, segment):
        if self.fetch_client is None or self.fetch_client.closed:
            self.fetch_client = SegmentClient(self.home_addr)
        return fetch_weights(self.fetch_client, self.mover_guest, WeightsQuery(
            lease_id=lease.lease_id, tenant=lease.tenant, segment=segment, guest_device="g0"))

    def lease(self, lid="L1", segments=SEGS, end_in=60.0) -> LeaseGranted:
        now = time.time()
        msg = LeaseGranted(msg_id=lid, lease_id=lid, tenant="a", home_device="h0", guest_device="g0",
                           segments=list(segments), start_ts=now, end_ts=now + end_in, share=1.0)
        self.home_weights.allow(msg)
        self.guest.grant(lid, "a", "h0", list(segments), msg.end_ts, 1.0)
        return msg

    def wait_ready(self, lid="L1", timeout=10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.guest.leases[lid].state != "ready":
            assert self.guest.leases[lid].state == "staging", self.guest.leases[lid]
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def close(self) -> None:
        self.guest.close()
        for s in (self.home_server, self.guest_server):
            s.close()
        if self.fetch_client is not None:
            self.fetch_client.close()


@pytest.fixture
def site():
    s = Site(TensorMover("h0"), TensorMover("g0"))
    yield s
    s.close()


def _remote(site: Site, msg: LeaseGranted, opts: DriverOptions | None = None) -> tuple[LeaseRemote, DriverLink]:
    link = DriverLink(msg, state="ready", client=SegmentClient(site.guest_addr))
    return LeaseRemote({s: link for s in msg.segments}, TensorMover("h0"), torch.device("cpu"),
                       opts or PATIENT), link


def test_staged_weights_and_guest_results_are_bit_identical(site):
    msg = site.lease()
    site.wait_ready()
    for seg in SEGS:
        staged = site.weights.models["a"].segment_state_dict(seg)
        for name, t in site.model.segment_state_dict(seg).items():
            assert torch.equal(staged[name], t), name
    remote, link = _remote(site, msg)
    x = torch.randn(8, CFG.hidden_size)
    tickets = [remote.submit("mlp[0]", 0, x[:4]), remote.submit("mlp[1]", 1, x[4:])]  # pipelined on one connection
    outs = [remote.collect(t) for t in tickets]
    assert torch.equal(outs[0], site.model.run_segment("mlp[0]", x[:4]))
    assert torch.equal(outs[1], site.model.run_segment("mlp[1]", x[4:]))
    assert link.calls == 2 and link.fallbacks == 0 and site.guest.leases["L1"].served == 2
    link.client.close()


def test_guest_refusals(site):
    gate = threading.Event()

    def gated(lease, segment):
        gate.wait(5)
        return site._fetch(lease, segment)

    site.guest.source = gated
    msg = site.lease()
    remote, link = _remote(site, msg)
    x = torch.randn(4, CFG.hidden_size)
    assert remote.collect(remote.submit("mlp[0]", 0, x)) is None and link.errors == {"not_staged": 1}
    gate.set()
    site.wait_ready()
    assert remote.collect(remote.submit("mlp[0]", 0, x)) is not None
    st, _ = SegmentClient(site.guest_addr).request(LeaseStatusQuery(lease_id="L1"))
    assert st.state == "ready" and st.staged == SEGS
    other = DriverLink(msgspec.structs.replace(msg, segments=["mlp[0]", "attn[0]"]), state="ready",
                       client=link.client)
    r2 = LeaseRemote({"attn[0]": other}, TensorMover("h0"), torch.device("cpu"), PATIENT)
    assert r2.collect(r2.submit("attn[0]", 0, x)) is None and other.errors == {"bad_request": 1}
    bad_shape = remote.submit("mlp[0]", 0, torch.randn(4, CFG.hidden_size + 1))
    assert remote.collect(bad_shape) is None and link.errors["bad_request"] == 1
    site.guest.revoke("L1", "test")
    assert remote.collect(remote.submit("mlp[0]", 0, x)) is None and link.errors["lease_inactive"] == 1
    assert link.state == "ended"
    st, _ = SegmentClient(site.guest_addr).request(LeaseStatusQuery(lease_id="nope"))
    assert st.state == "unknown"


def test_expired_lease_and_invalid_grants(site):
    site.lease("L2", end_in=-1.0)
    time.sleep(0.05)
    assert site.guest.leases["L2"].state in ("staging", "ready")
    site.guest.expire()
    assert site.guest.leases["L2"].state == "ended"
    assert site.guest.grant("L3", "zz", "h0", SEGS, time.time() + 9, 1.0).state == "failed"
    assert site.guest.grant("L4", "a", "h0", ["attn[0]"], time.time() + 9, 1.0).state == "failed"
    assert site.guest.pinned() == set()


def test_home_serves_weights_only_for_its_leases(site):
    client = SegmentClient(site.home_addr)
    mover = TensorMover("g0")
    with pytest.raises(RuntimeError, match="unknown_lease"):
        fetch_weights(client, mover, WeightsQuery(lease_id="x", tenant="a", segment="mlp[0]", guest_device="g0"))
    with pytest.raises(RuntimeError, match="not_home"):
        fetch_weights(client, mover, WeightsQuery(lease_id="x", tenant="b", segment="mlp[0]", guest_device="g0"))
    site.lease("L5", segments=["mlp[1]"])
    with pytest.raises(RuntimeError, match="unknown_lease"):  # not a segment of that lease
        fetch_weights(client, mover, WeightsQuery(lease_id="L5", tenant="a", segment="mlp[0]", guest_device="g0"))
    client.close()


def test_timeout_falls_back_cools_down_and_the_late_reply_is_dropped(site):
    msg = site.lease()
    site.wait_ready()
    opts = DriverOptions(timeout_floor_ms=30.0, cooldown_s=0.2)
    remote, link = _remote(site, msg, opts)
    x = torch.randn(4, CFG.hidden_size)
    with site.lock.home():  # the guest's own work holds its device
        t = remote.submit("mlp[0]", 0, x)
        t0 = time.monotonic()
        assert remote.collect(t) is None
        assert 0.025 < time.monotonic() - t0 < 0.5
        # the driver gives up first, or reads the guest's own "busy" refusal if that is already there
        assert link.fallbacks == 1 and (link.timeouts == 1 or link.errors == {"busy": 1})
        assert not remote.remote("mlp[0]")  # cooling down
        time.sleep(0.05)
    time.sleep(0.25)
    assert remote.remote("mlp[0]")
    out = remote.collect(remote.submit("mlp[1]", 0, x))  # the late reply to the first call is skipped
    assert torch.equal(out, site.model.run_segment("mlp[1]", x))


def test_dead_connection_breaks_the_link(site):
    msg = site.lease()
    site.wait_ready()
    broken = []
    remote, link = _remote(site, msg)
    link.on_broken = broken.append
    x = torch.randn(4, CFG.hidden_size)
    with site.lock.home():
        t = remote.submit("mlp[0]", 0, x)
        site.guest_server.close()  # the guest goes away with the call in flight
        assert remote.collect(t) is None
    assert link.state == "broken" and broken == [link] and link.fallbacks == 1
    assert not remote.remote("mlp[0]")


def test_large_tensors_go_over_the_shm_transport():
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    th_h, th_g = ShmTransport("h0"), ShmTransport("g0")
    site = Site(TensorMover("h0", th_h, loop, inline_max_bytes=0), TensorMover("g0", th_g, loop, inline_max_bytes=0))
    try:
        msg = site.lease()
        site.wait_ready()
        link = DriverLink(msg, state="ready", client=SegmentClient(site.guest_addr))
        mover = TensorMover("h0", th_h, loop, inline_max_bytes=0)
        remote = LeaseRemote({s: link for s in SEGS}, mover, torch.device("cpu"), PATIENT)
        x = torch.randn(16, CFG.hidden_size)
        out = remote.collect(remote.submit("mlp[0]", 0, x))
        assert torch.equal(out, site.model.run_segment("mlp[0]", x))
        assert mover.sent_transport == 1 and site.mover_guest.sent_transport == 1
        assert site.home_weights.mover.sent_transport == 8  # four tensors per MLP segment, two segments
    finally:
        site.close()
        for t in (th_h, th_g):
            asyncio.run_coroutine_threadsafe(t.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)


async def test_async_server_speaks_the_same_protocol():
    model = LlamaModel(CFG, seed=4)
    guest = GuestHost("g0", {"a": CFG}, DeviceLock(), StagedWeights("cpu"),
                      lambda lease, seg: model.segment_state_dict(seg), TensorMover("g0"))
    guest.grant("L", "a", "h0", ["mlp[0]"], time.time() + 30, 1.0)
    server = AsyncSegmentServer(guest)
    addr = await server.start()
    while guest.leases["L"].state != "ready":
        await asyncio.sleep(0.01)
    msg = LeaseGranted(msg_id="m", lease_id="L", tenant="a", home_device="h0", guest_device="g0",
                       segments=["mlp[0]"], start_ts=time.time(), end_ts=time.time() + 30)
    link = DriverLink(msg, state="ready", client=await asyncio.to_thread(SegmentClient, addr))
    remote = LeaseRemote({"mlp[0]": link}, TensorMover("h0"), torch.device("cpu"),
                         DriverOptions(timeout_floor_ms=5000))  # a cold first call
    x = torch.randn(4, CFG.hidden_size)
    out = await asyncio.to_thread(lambda: remote.collect(remote.submit("mlp[0]", 0, x)))
    assert torch.equal(out, model.run_segment("mlp[0]", x))
    link.client.close()
    guest.close()
    await server.close()


def test_a_re_sent_grant_extends_the_lease_it_does_not_restart_it(site):
    site.lease("L5", end_in=0.5)
    site.wait_ready("L5")
    later = time.time() + 30.0
    again = site.guest.grant("L5", "a", "h0", SEGS, later, 0.5)  # the scheduler extended it
    assert again is site.guest.leases["L5"] and again.state == "ready"  # not staged again
    assert again.end_ts == later and again.share == 0.5
    time.sleep(0.6)
    site.guest.expire()
    assert site.guest.leases["L5"].state == "ready"  # the first window has passed; the extended one has not
    site.guest.revoke("L5", "revoked")
    assert site.guest.grant("L5", "a", "h0", SEGS, later + 10, 1.0).end_ts == later  # an ended lease stays ended
