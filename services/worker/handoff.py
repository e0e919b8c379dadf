"""Lane hand-off (docs/guest-execution.md, "Lane hand-off"): a guest lane whose lease says ``handback`` prefills a
sequence of another tenant, then hands it to a home device of that tenant, where it decodes in the home's batch.

Guest, once a lane step gives a sequence its first token: the compute thread pauses the sequence (no more tokens
here); when that token's chunk is published, :meth:`HandOffs.send` marks the request's journey hash with a token
(``handoff``, only while this worker owns it), exports the sequence (tokens, sampling state, detokenizer state; its
KV stays served by this worker's segment server, :class:`KVExports`), picks the home device of the lane's leases
with the most free memory (another device of the tenant's container when that one's predicted decode step with the
sequence would pass the fill bound of ``shared/handback.py``, or when it has no room for the KV) and puts a
:class:`HandOff` on its stream.

Home, :meth:`HandOffs.receive` (a task beside the stream handler, so that the fetch holds up no other entry): reserves
the sequence's KV in the GMG (evicting cached staged weights of other tenants that no lease pins, when they are what
stands in the way), fetches the KV from the guest (emulated devices wait the link's time instead); then, at the next
step boundary of its serve loop (:meth:`HandOffs.join`), imports the sequence, commits in the journey hash (worker and
device change, only while the guest's token is still there), tracks the request (its ``HandOff`` entry is acked when
the request ends, as an ``AssignRequest`` is) and resumes it in the step planned next; then it publishes
:class:`RequestMoved` (the scheduler moves its record and releases the guest's KV reservation) and answers
:class:`HandOffReply`. A cancel arriving meanwhile is applied after the commit.

Guest again: on ``ok`` it drops its copy and acks the request's ``AssignRequest``; on a refusal or no answer in
``HANDOFF_TIMEOUT_S`` it gives up in the journey hash (clears its token) and resumes the sequence where it paused.
If the home committed first, giving up fails and the guest drops its copy as on ``ok``. Either way exactly one
worker continues the request and its token chunks keep their numbering.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from services.worker.segment_server import Reply, SegmentClient, TensorMover
from services.worker.segment_wire import FrameError, KVQuery, KVTensor, wire_dtype
from shared.config_error import ConfigError
from shared.costmodel import cost_for
from shared.costmodel.sla import request_targets
from shared.gmg import Refused, Reservation, Room
from shared.handback import HANDBACK_FILL, best_fit, step_with
from shared.messages import (CancelAssigned, HandOff, HandOffReply, InferenceRequest, RequestMoved, events_stream,
                             worker_stream)
from shared.model.engine import SamplingParams, SequenceState
from shared.redis_util import REDIS_ERRORS
from shared.requests_state import handoff_step
from shared.streams import ACK, DEFER

if TYPE_CHECKING:
    from services.worker.service import WorkerService

log = structlog.get_logger(__name__)

HANDOFF_TIMEOUT_S = 5.0  # the guest gives up (and resumes the sequence) without an answer by then
EXPORT_KEEP_S = 30.0  # an exported sequence's KV stays fetchable this long at most


def sampling_params(r: InferenceRequest) -> SamplingParams:
    """A request's sampling parameters as the engine takes them."""
    return SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, seed=r.seed,
                          stop=tuple(s for s in r.stop if s), ignore_eos=r.ignore_eos, top_k=r.top_k,
                          presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                          repetition_penalty=r.repetition_penalty, logprobs=r.logprobs,
                          stop_token_ids=tuple(r.stop_token_ids))


class KVExports:
    """KV of sequences this worker is handing over, served to the home that asks with the hand-off's token
    (segment-server threads read it; the event loop adds and drops)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, tuple[str, str, list, float]] = {}  # rid -> (token, home, kv, expiry)

    def put(self, rid: str, token: str, home: str, kv: list) -> None:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, v in self._items.items() if v[3] < now]:
                del self._items[k]
            self._items[rid] = (token, home, kv, now + EXPORT_KEEP_S)

    def drop(self, rid: str) -> None:
        with self._lock:
            self._items.pop(rid, None)

    def handle(self, q: KVQuery, mover: TensorMover) -> Reply:
        """Two frames (K, V) per layer, or one refusal (or one empty frame for a sequence without tensors)."""
        with self._lock:
            item = self._items.get(q.request_id)
        if item is None or item[0] != q.token or item[1] != q.home_device:
            return [(KVTensor(request_id=q.request_id, error="unknown_sequence"), b"")]
        kv = item[2]
        if not kv:
            return [(KVTensor(request_id=q.request_id), b"")]
        out: Reply = []
        for layer, pair in enumerate(kv):
            for kind, t in zip("kv", pair):
                t = t.contiguous()
                handle, body = mover.pack(t, q.home_device)
                out.append((KVTensor(request_id=q.request_id, layer=layer, kind=kind, shape=list(t.shape),
                                     dtype=wire_dtype(t), handle=handle,
                                     last=layer == len(kv) - 1 and kind == "v"), body))
        return out


def fetch_kv(client: SegmentClient, mover: TensorMover, q: KVQuery,
             timeout_s: float = 30.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Ask a guest for a handed-over sequence's KV (per layer, K and V); ``RuntimeError`` if it refuses."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for msg, payload in client.tensor_replies(q, KVTensor, lambda m: m.request_id == q.request_id,
                                              f"the KV of {q.request_id}", timeout_s):
        if msg.kind:
            # copied: an inline tensor shares its frame's buffer
            out.setdefault(msg.layer, {})[msg.kind] = mover.unpack(msg.shape, msg.dtype, msg.handle, payload,
                                                                   "cpu", timeout_s=timeout_s).clone()
    return [(out[i]["k"], out[i]["v"]) for i in sorted(out)]


def _unreserved(row: dict[str, str]) -> int:
    """Bytes still reservable on a device, from its GMG row."""
    return int(row.get("limit") or 0) - int(row.get("reserved") or 0)


@dataclass
class _Sending:
    token: str
    reply: asyncio.Future


@dataclass
class _Joining:
    """A received sequence waiting for the step boundary where it joins the home's batch (:meth:`HandOffs.join`);
    ``done`` gets "ok" or the reason it was refused."""

    msg: HandOff
    state: SequenceState
    entry_id: str
    nblocks: int
    done: asyncio.Future


class HandOffs:
    """Both roles of the hand-off for one worker service."""

    def __init__(self, w: "WorkerService") -> None:
        self.w = w
        self.exports = KVExports()
        self.ready: set[str] = set()  # paused after their first token; sent once that token is published
        # their state, exported on the compute thread right after that step (dict set/pop are atomic)
        self._exported: dict[str, SequenceState] = {}
        self._sending: dict[str, _Sending] = {}
        self._tasks: set[asyncio.Task] = set()
        self._receiving: dict[str, str] = {}  # request id -> entry id of a hand-off being received here
        self._cancels: dict[str, CancelAssigned] = {}  # cancels that arrived while their hand-off was received
        self.stats = {"sent": 0, "refused": 0, "received": 0}

    # ------------------------------------------------------------ guest
    def pause_first_tokens(self, eng, events: list) -> None:
        """Compute thread, after a lane step of a ``handback`` lane: pause each sequence that just got its first
        token and is not done (it waits for :meth:`send`), and export its state now: :meth:`send` would otherwise
        wait for the compute thread to finish the lane's next step (a whole iteration of the guest) first."""
        for ev in events:
            rid = ev.request_id
            if ev.token_ids and ev.completion_tokens == 1 and ev.finish_reason is None \
                    and rid in self.w.tracker.items and eng.pause(rid):
                self.ready.add(rid)
                try:
                    self._exported[rid] = eng.export_sequence(rid)
                except ValueError:  # send() exports it then (and refuses it as before if it still cannot)
                    pass

    def published(self, events: list) -> None:
        """Event loop, once a step's chunks are in Redis: start the hand-off of the sequences paused in it."""
        for ev in events:
            if ev.request_id in self.ready:
                self.ready.discard(ev.request_id)
                task = asyncio.create_task(self.send(ev.request_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _on_compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.w.compute, fn, *args)

    async def _home_for(self, req: InferenceRequest, need: int) -> str | None:
        """Where the sequence goes: of the lane's leases' home devices (the simulator hands a sequence to its
        lease's home), the ready one with the most unreserved memory, unless another device of the container is
        picked by the fill rule (:meth:`_fill_target`); when that home has less than the ``need`` bytes of its KV,
        the ready device of the tenant's container with the most, if the KV fits there (the simulator's
        ``LeaseBook._other_home``). None when no lease's home is ready and no device of the container fits it."""
        tenant = req.tenant
        lane = self.w.lanes.lanes.get(tenant) if self.w.lanes is not None else None
        leases = [*lane.leases.values(), *lane.draining.values()] if lane is not None else []
        homes = {m.home_device for m in leases} - {self.w.device.id}
        rows = await self.w.gmg.devices()

        def best_of(ids) -> tuple[str | None, int]:  # a full one too: its reservation may evict cached weights
            best, room = None, -1
            for d in sorted(ids):
                r = rows.get(d, {})
                free = _unreserved(r)
                if r.get("state") == "ready" and free > room:
                    best, room = d, free
            return best, room

        best, room = best_of(homes)
        fit = self._fill_target(rows, req, best, need)
        if fit is not None:
            return fit
        if room < need:
            other, other_room = best_of(d for d, r in rows.items()
                                        if r.get("home_tenant") == tenant and d not in homes and d != self.w.device.id)
            if other is not None and other_room >= need:
                return other
        return best

    def _fill_target(self, rows: dict[str, dict[str, str]], req: InferenceRequest, home: str | None,
                     need: int) -> str | None:
        """The simulator's ``LeaseBook._fill_target`` on the GMG's device rows (``shared/handback.py``): another
        ready device of the container when ``home``'s step, predicted from its heartbeat (``running``, ``kv_used``,
        ``prefill_tokens``; with the GMG's live count of its requests, ``requests``, when that is larger: every
        guest of a burst would otherwise hand its sequences to the device whose heartbeat is oldest news, for up
        to 0.5 s) with this sequence added, is past ``HANDBACK_FILL`` × the request's TPOT target; of
        those with room for the KV, the one whose step is the longest still within it. None when the home is within
        it, no other device is, or the tenant's cost model has no profile for a device's kind."""
        spec = self.w.tenants_by_name.get(req.tenant)
        if spec is None:
            return None
        cfg = spec.model.config
        prompt = len(req.prompt_ids)
        bound = HANDBACK_FILL * request_targets(spec.sla, cfg, prompt, req.max_tokens)[1]
        per_token = max(1, cfg.kv_bytes_per_token())
        budget = self.w.engine.max_batch_tokens  # the mesh's workers share the engine's chunk budget

        def step(row: dict[str, str]) -> float | None:
            try:
                cost = cost_for(cfg, row.get("kind", ""))
            except ConfigError:
                return None
            running, context = int(row.get("running") or 0), int(row.get("kv_used") or 0) // per_token
            live = int(row.get("requests") or 0)
            if live > running:  # started or handed over since its heartbeat: each a sequence about this one's size
                context += (live - running) * (prompt + 1)
                running = live
            return step_with(cost, running, context, prompt, int(row.get("prefill_tokens") or 0), budget)

        if home is not None:
            s = step(rows.get(home, {}))
            if s is None or s <= bound:
                return None
        cands = []
        for d, r in sorted(rows.items()):
            if d in (home, self.w.device.id) or r.get("home_tenant") != req.tenant or r.get("state") != "ready" \
                    or _unreserved(r) < need:
                continue
            s = step(r)
            if s is not None:
                cands.append((d, s))
        return best_fit(cands, bound)

    async def send(self, rid: str) -> None:
        w = self.w
        exported = self._exported.pop(rid, None)
        t = w.tracker.items.get(rid)
        eng = w.engine_of.get(rid)
        if t is None or eng is None:
            return
        token, began = uuid.uuid4().hex, False
        try:
            home = await self._home_for(t.req, eng.blocks_needed(len(t.req.prompt_ids), t.req.max_tokens)
                                        * eng.kv_bytes_per_block)
            if home is None or not await handoff_step(w.redis, w.p, rid, "begin", w.worker_id, token):
                await self._resume(eng, rid, "no_home" if home is None else "not_owner")
                return
            began = True
            state = exported if exported is not None else await self._on_compute(eng.export_sequence, rid)
            self.exports.put(rid, token, home, state.kv)
            fut = asyncio.get_running_loop().create_future()
            self._sending[rid] = _Sending(token, fut)
            gen = state.generator_state
            await w.producer.add(worker_stream(w.p, home), HandOff(
                msg_id=uuid.uuid4().hex, request=t.req, from_device=w.device.id, token=token, kv_blocks=t.kv_blocks,
                seq=t.seq, started_ts=t.started_ts, first_token_ts=t.first_token_ts,
                completion_tokens=t.completion_tokens, output=list(state.output), computed=state.computed,
                pending=state.pending, generator_state=gen.numpy().tobytes() if gen is not None else b"",
                detok=list(state.detok)),
                durable=True)
            try:
                reply = await asyncio.wait_for(asyncio.shield(fut), HANDOFF_TIMEOUT_S)
            except asyncio.TimeoutError:
                reply = None
            if reply is not None and reply.ok:
                await self._moved(eng, rid, home)
            elif await handoff_step(w.redis, w.p, rid, "abort", token):
                await self._resume(eng, rid, reply.reason if reply is not None else "timeout")
            else:  # the home committed before we gave up: it runs the request now
                await self._moved(eng, rid, home)
        except (ValueError, RuntimeError) + REDIS_ERRORS as e:
            if began and not await self._abort_retrying(rid, token):
                await self._moved(eng, rid, "?")
            else:
                await self._resume(eng, rid, repr(e))
        finally:
            self._sending.pop(rid, None)
            self.exports.drop(rid)

    async def _abort_retrying(self, rid: str, token: str) -> bool:
        """Give up a hand-off through Redis trouble; False only when the home committed it."""
        delay = 0.1
        while True:
            try:
                return await handoff_step(self.w.redis, self.w.p, rid, "abort", token)
            except REDIS_ERRORS:
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _resume(self, eng, rid: str, reason: str) -> None:
        self.stats["refused"] += 1
        await self._on_compute(eng.resume, rid)
        self.w.wake.set()
        log.info("handoff_kept_on_guest", request_id=rid, reason=reason)

    async def _moved(self, eng, rid: str, home: str) -> None:
        """The home continues the request: drop this copy and the request's entry (the scheduler releases its KV
        reservation here when it reads the home's RequestMoved)."""
        w = self.w
        self.stats["sent"] += 1
        await self._on_compute(eng.cancel, rid)
        w.engine_of.pop(rid, None)
        t = w.tracker.items.pop(rid, None)
        log.info("handoff_sent", request_id=rid, home=home)
        if t is not None:
            await w.ack_retrying(t.entry_id)

    def on_reply(self, msg: HandOffReply) -> None:
        s = self._sending.get(msg.request_id)
        if s is not None and s.token == msg.token and not s.reply.done():
            s.reply.set_result(msg)

    # ------------------------------------------------------------ home
    def receiving(self, rid: str) -> bool:
        """Whether a hand-off of ``rid`` to this worker is being received (fetched, not yet committed)."""
        return rid in self._receiving

    def cancel_after(self, msg: CancelAssigned) -> None:
        """A cancel for a request being received: applied once the hand-off commits here (or forwarded to the
        guest, which keeps the request, if it is refused)."""
        self._cancels[msg.request_id] = msg

    async def receive(self, entry_id: str, msg: HandOff) -> str:
        """Stream handler: receive the hand-off in the background — its KV fetch must not hold up this worker's
        other messages (its own tenant's new requests, cancels, leases, other hand-offs) — and leave its entry
        pending: it is acked when the request ends here, or as soon as the hand-off is refused."""
        w, rid = self.w, msg.request.request_id
        if rid in w.tracker.items:  # our entry re-delivered stays pending; another copy is acked
            return DEFER if w.tracker.items[rid].entry_id == entry_id else ACK
        if rid in self._receiving:  # being received: the same for an entry reclaimed meanwhile
            return DEFER if self._receiving[rid] == entry_id else ACK
        self._receiving[rid] = entry_id
        task = asyncio.create_task(self._receive(entry_id, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return DEFER

    async def _receive(self, entry_id: str, msg: HandOff) -> None:
        w, rid = self.w, msg.request.request_id
        try:
            try:
                ok = await self._take(entry_id, msg)
            except REDIS_ERRORS as e:  # the entry stays pending and is reclaimed; the guest resumes meanwhile
                log.warning("handoff_receive_redis_error", request_id=rid, error=repr(e))
                return
            except Exception as e:  # the guard: a bad hand-off is refused, never left hanging
                log.exception("handoff_receive_failed", request_id=rid)
                await self._release_retrying(rid)
                with contextlib.suppress(*REDIS_ERRORS):  # unanswered, the guest gives up and resumes anyway
                    await self._refuse(msg, f"error: {e!r}")
                ok = False
            late = self._cancels.pop(rid, None)
            if not ok:
                await w.ack_retrying(entry_id)
                if late is not None:  # the guest keeps the request: the cancel is its to apply
                    await w.producer.add(worker_stream(w.p, msg.from_device), late)
            elif late is not None:
                w.pending_ops.append(("cancel", late))
                w.wake.set()
        finally:
            self._receiving.pop(rid, None)
            self._cancels.pop(rid, None)

    def _room(self) -> Room:
        """What the KV reservation of a received sequence may evict to fit: weights other tenants' leases staged
        here that no lease pins now, least recently used first by this worker's cache (the scheduler's placements
        make room the same way, and so does the simulator's hand-back): cached weights are reclaimable memory, and
        a refused hand-off leaves the sequence decoding on the lane at the guest's share."""
        agent = self.w.lease_agent
        weights, guest = getattr(agent, "weights", None), getattr(agent, "guest", None)
        order = weights.evictable(guest.pinned() if guest is not None else set()) if weights is not None else []
        return Room(self.w.device.id, (), {f"{t}|{s}": float(i + 1) for i, (t, s, _) in enumerate(order)})

    async def _take(self, entry_id: str, msg: HandOff) -> bool:
        """Reserve, fetch, import and commit ``msg``'s sequence; False when refused (the guest was told)."""
        w, r = self.w, msg.request
        rid = r.request_id
        t0 = time.time()  # the phases of the hand-off go into the ``handoff_received`` log line
        if r.tenant != w.tenant.name:
            return await self._refuse(msg, "not_home")
        eng = w.engine
        nblocks = eng.blocks_needed(len(r.prompt_ids), r.max_tokens)
        owner = f"kv:{rid}"
        res = await w.gmg.commit_making_room(
            "reserve", [Reservation(w.device.id, owner, "kv", r.tenant, nblocks * eng.kv_bytes_per_block)],
            [self._room()])
        if isinstance(res, Refused) and res.reason != "duplicate":
            return await self._refuse(msg, f"memory: {res.reason}")
        t1 = time.time()
        for device, tenant, seg, nbytes in ([] if isinstance(res, Refused) else res.evicted):
            # this worker's copy goes at its lease agent's next upkeep, which drops what the GMG no longer holds
            log.info("staged_weights_evicted", device=device, tenant=tenant, segment=seg, bytes=nbytes, by="handoff")
        try:
            kv = await w.lease_agent.fetch_kv(msg.from_device, KVQuery(request_id=rid, token=msg.token,
                                                                       home_device=w.device.id), msg) \
                if w.lease_agent is not None else []
            state = self._state(msg, kv)
        except (OSError, FrameError, TimeoutError, RuntimeError, ValueError) as e:
            await w.gmg.release(w.device.id, owner)
            return await self._refuse(msg, f"import: {e}")
        # import, commit and resume at the next step boundary, so that the sequence runs in the very next step
        t2 = time.time()
        j = _Joining(msg, state, entry_id, nblocks, asyncio.get_running_loop().create_future())
        w.pending_ops.append(("handoff", j))
        w.wake.set()
        outcome = await j.done
        t3 = time.time()
        if outcome != "ok":
            await w.gmg.release(w.device.id, owner)
            return await self._refuse(msg, outcome)
        # committed: this worker runs the request now, so what follows must get through Redis trouble
        moved = RequestMoved(msg_id=uuid.uuid4().hex, request_id=rid, tenant=r.tenant, from_device=msg.from_device,
                             device=w.device.id, worker_id=w.worker_id, kv_blocks=nblocks, ts=time.time())
        reply = HandOffReply(msg_id=uuid.uuid4().hex, request_id=rid, token=msg.token, ok=True)
        await w.retrying(lambda: w.producer.add(events_stream(w.p), moved, durable=True), "handoff_moved_retry",
                         request_id=rid)
        await w.retrying(lambda: w.producer.add(worker_stream(w.p, msg.from_device), reply), "handoff_reply_retry",
                         request_id=rid)
        log.info("handoff_received", request_id=rid, guest=msg.from_device, kv_layers=len(state.kv),
                 # seconds: the lane's first token → this handler (guest clock), the KV reservation, the KV fetch,
                 # and the wait for this worker's step boundary until the commit
                 delivered_s=round(t0 - msg.first_token_ts, 4) if msg.first_token_ts else None,
                 reserve_s=round(t1 - t0, 4), fetch_s=round(t2 - t1, 4), join_s=round(t3 - t2, 4))
        return True

    async def join(self, j: _Joining) -> None:
        """Serve loop, between two steps (the compute thread is idle): import ``j``'s sequence, commit in the
        journey hash (only while the guest's token is still there) and track it, then let it run in the step about
        to be planned — the simulator's hand-back joins the home's first step after the KV is there (importing on the
        compute thread and resuming after the commit's publishes held a sequence out of one or two more home steps).
        The outcome ("ok" or why not) goes to the waiting hand-off task."""
        if j.done.done():  # the waiting task was cancelled (the worker is stopping)
            return
        w, r = self.w, j.msg.request
        rid, eng = r.request_id, w.engine
        try:
            self._import_paused(j.state)
        except (RuntimeError, ValueError) as e:
            eng.cancel(rid)
            j.done.set_result(f"import: {e}")
            return
        try:
            committed = await handoff_step(w.redis, w.p, rid, "commit", j.msg.token, w.worker_id, w.device.id,
                                           f"{time.time():.6f}")
        except REDIS_ERRORS as e:  # the entry stays pending and is reclaimed; the guest resumes meanwhile
            eng.cancel(rid)
            if not j.done.done():
                j.done.set_exception(e)
            return
        if not committed or j.done.done():
            eng.cancel(rid)
            if not j.done.done():
                j.done.set_result("given_up")
            return
        t = w.tracker.add(r, j.entry_id, j.nblocks)
        t.seq, t.started_ts, t.first_token_ts = j.msg.seq, j.msg.started_ts, j.msg.first_token_ts
        t.completion_tokens = j.msg.completion_tokens
        w.engine_of[rid] = eng
        self.stats["received"] += 1
        eng.resume(rid)
        j.done.set_result("ok")

    async def _release_retrying(self, rid: str) -> None:
        """Drop this worker's KV reservation of a refused hand-off and its imported copy, if any."""
        w = self.w
        await self._on_compute(w.engine.cancel, rid)  # False (nothing dropped) when it was never imported
        await w.retrying(lambda: w.gmg.release(w.device.id, f"kv:{rid}"), "handoff_release_retry", request_id=rid)

    def _import_paused(self, state: SequenceState) -> None:
        """The imported sequence waits (paused) until this worker has committed and tracks it."""
        self.w.engine.import_sequence(state)
        self.w.engine.pause(state.request_id)

    @staticmethod
    def _state(msg: HandOff, kv: list) -> SequenceState:
        r = msg.request
        gen = torch.frombuffer(bytearray(msg.generator_state), dtype=torch.uint8) if msg.generator_state else None
        return SequenceState(r.request_id, list(r.prompt_ids), list(msg.output), sampling_params(r), msg.computed,
                             msg.pending, gen, tuple(msg.detok), kv)

    async def _refuse(self, msg: HandOff, reason: str) -> bool:
        """Tell the guest the hand-off is refused (it resumes the request); False, for :meth:`_take`."""
        log.info("handoff_refused", request_id=msg.request.request_id, guest=msg.from_device, reason=reason)
        await self.w.producer.add(worker_stream(self.w.p, msg.from_device), HandOffReply(
            msg_id=uuid.uuid4().hex, request_id=msg.request.request_id, token=msg.token, ok=False, reason=reason))
        return False

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
