"""The predicted side of ``slicesched bench accuracy``: the same arrivals replayed in the simulator.

The replay uses the live worker's batching (at most 256 tokens and 64 sequences per iteration, 16-token KV
blocks, KV reserved for prompt + max_tokens at admission), the ``container`` policy on the tenants file's own
home devices, and steps iteration by iteration (no closed-form decode runs) so that every iteration's batch is
recorded and can be expanded into its segments with the same cost model: that gives predicted means per
(segment, tokens bucket) exactly as the worker buckets its measurements.
"""
from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from services.worker.core import tokens_bucket
from shared.config import ClusterConfig, TenantsConfig
from shared.costmodel import ModelCost, cost_for
from shared.costmodel.accuracy import BucketStats, value_at
from shared.model.graph import segment_names
from shared.workload import Workload, WorkloadRequest

WORKER_BATCHING = dict(max_num_seqs=64, max_batched_tokens=256, kv_block_tokens=16)  # services/worker/__main__.py


@dataclass(frozen=True)
class Iteration:
    """One simulated iteration's batch on one device (``scale``: the drift factor applied to its time)."""

    device: str
    n_decode: int
    decode_kv: int
    prefill_tokens: int
    prefill_pairs: int
    prefill_reads: int
    sampled: int
    scale: float = 1.0


class _RecordingCost:
    """A :class:`ModelCost` that records the batch of every iteration it is asked to time, and scales the time
    by ``scale()`` (a drift factor that may change with simulated time)."""

    def __init__(self, cost: ModelCost, device: str, sink: list[Iteration], scale: Callable[[], float]) -> None:
        self._cost, self._device, self._sink, self._scale = cost, device, sink, scale

    def iteration_time(self, n_decode: int, decode_kv: int, prefill_tokens: int = 0, prefill_pairs: int = 0,
                       prefill_reads: int = 0, sampled: int | None = None) -> float:
        s = n_decode if sampled is None else sampled
        k = self._scale()
        self._sink.append(Iteration(self._device, n_decode, decode_kv, prefill_tokens, prefill_pairs,
                                    prefill_reads, s, k))
        return k * self._cost.iteration_time(n_decode, decode_kv, prefill_tokens, prefill_pairs, prefill_reads, s)

    def __getattr__(self, name: str):
        return getattr(self._cost, name)


@dataclass
class SimReplay:
    """What the simulator predicted for one replay (times in seconds from arrival 0 of the original arrivals)."""

    requests: dict[str, tuple[float, float | None]]  # request id -> (TTFT, TPOT or None for one token)
    memory: dict[str, list[tuple[float, int]]]  # device -> change points (t, bytes)
    capacity: dict[str, int]
    iterations: list[Iteration]
    costs: dict[str, ModelCost] = field(default_factory=dict)  # device -> the cost model used

    def segment_predictions(self, pool_layers: bool = True) -> dict[tuple, BucketStats]:
        """Predicted executions per (device, segment, tokens bucket) in ms, as the worker buckets them
        (``attn``/``mlp`` pooled over layers when ``pool_layers``)."""
        acc: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        names: dict[str, list[str]] = {}
        for it in self.iterations:
            cost = self.costs[it.device]
            t = it.n_decode + it.prefill_tokens
            b = tokens_bucket(t)
            attn = cost.attn_dense_time(t)
            if it.n_decode:
                attn += cost.decode_attention_time(it.n_decode, it.decode_kv, t)
            if it.prefill_tokens:
                attn += cost.prefill_attention_time(it.prefill_tokens, it.prefill_pairs, it.prefill_reads, t)
            times = {"embed": cost.embed_time(t), "attn": attn, "mlp": cost.mlp_time(t)}
            if it.sampled:
                times["head"] = cost.head_time(it.sampled, t)
            if it.scale != 1.0:
                times = {k: v * it.scale for k, v in times.items()}
            segs = names.get(it.device)
            if segs is None:
                segs = names[it.device] = segment_names(cost.layers)
            for seg in segs:
                kind = seg.split("[")[0]
                if kind not in times:
                    continue
                key = (it.device, kind if pool_layers else seg, b)
                ms = times[kind] * 1e3
                a = acc[key]
                a[0] += 1
                a[1] += ms
                a[2] += ms * ms
        return {k: BucketStats(int(c), tot, sq) for k, (c, tot, sq) in acc.items()}


def replay(cluster: ClusterConfig, tenants: TenantsConfig, requests: list[WorkloadRequest], *,
           cost_of: Callable[[str, str], ModelCost] | None = None, arrival_shift_s: float = 0.0,
           delivery_s: float = 0.0, done_s: float | None = None,
           drift: dict[str, list[tuple[float, float]]] | None = None, seed: int = 0) -> SimReplay:
    """Replay ``requests`` with the ``container`` policy on the tenants' home devices.

    ``cost_of(device_id, tenant)`` gives the cost model of a tenant's engine on a device (default: the shipped
    profile of the device's kind, uncorrected). ``arrival_shift_s`` delays every arrival (the request path
    from the client to the worker) and ``delivery_s`` is added to every first token (worker to client); both
    are reported against the original arrival times. ``done_s`` is added to every finish (worker to the client's
    end of stream; default ``delivery_s``), so the TPOT is the client's: (finish + ``done_s`` − first token −
    ``delivery_s``) / (tokens − 1), never below zero. ``drift`` maps a device to change points (t, factor) of a
    multiplier on its iteration times (t in seconds since arrival 0, the simulated clock's base).
    """
    from shared.policies import make_policy
    from shared.sim import SimConfig, Simulator

    records: list[Iteration] = []
    costs: dict[str, ModelCost] = {}
    models = {t.name: t.model.config for t in tenants.tenants}

    class _Replay(Simulator):
        def add_engine(self, dev, tenant, charge_weights=True):  # type: ignore[override]
            eng = super().add_engine(dev, tenant, charge_weights)
            if eng is not None:
                cost = cost_of(dev.id, tenant) if cost_of else cost_for(models[tenant], dev.kind)
                costs[dev.id] = cost
                points = (drift or {}).get(dev.id)
                scale = (lambda: 1.0) if not points else \
                    (lambda pts=points: value_at(pts, self.now) if self.now >= pts[0][0] else 1.0)
                eng.cost = _RecordingCost(cost, dev.id, records, scale)
            return eng

    shifted = tuple(dataclasses.replace(r, arrival_s=r.arrival_s + arrival_shift_s) for r in requests)
    duration = max((r.arrival_s for r in shifted), default=0.0) + 1.0
    w = Workload(name="accuracy", requests=shifted, tenants=tenants, duration_s=duration, seed=seed)
    cfg = SimConfig(closed_form=False, drain_s=600.0, **WORKER_BATCHING)
    sim = _Replay(cluster, tenants, make_policy("container", {"resize": False}), cfg, random.Random(seed))
    sim.run(w)
    out: dict[str, tuple[float, float | None]] = {}
    tail = (delivery_s if done_s is None else done_s) - delivery_s  # the client's end of stream vs first token
    for r in sim.requests:
        if r.first_token < 0 or r.finish < 0:
            continue
        ttft = r.first_token - (r.arrival - arrival_shift_s) + delivery_s
        out[r.rid] = (ttft, max(0.0, r.tpot() + tail / (r.output - 1)) if r.output > 1 else None)
    memory = {d.id: list(d.mem.timeline) for d in sim.devices.values()}
    capacity = {d.id: d.mem.capacity for d in sim.devices.values()}
    return SimReplay(out, memory, capacity, records, costs)
