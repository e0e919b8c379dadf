"""Emulated devices (DESIGN §8): the real worker service and batching logic, but no tensor math. An iteration
takes the time the device profile predicts for its batch (with seeded log-normal noise), memory is accounted
exactly as on a real device, and generated tokens are placeholders. Several emulated devices share one process.
Everything they produce is labelled "emulated".

``python -m services.worker.emulated --devices d0,d1,...``
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time

import torch

from shared.config import ConfigError, Settings, env_number, home_tenant_of, load_cluster, load_tenants
from shared.costmodel import cost_for
from shared.logging import setup_logging
from shared.model.config import ModelConfig
from shared.model.engine import Engine, StepResult, TokenEvent
from shared.model.graph import segment_names
from shared.model.kv_cache import BlockAllocator
from shared.model.tokenizer import load_tokenizer


class _AccountingKV:
    """KV cache that only accounts blocks (no tensors: a hand-off exports none)."""

    layers: tuple = ()

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int) -> None:
        self.bytes_per_block = cfg.kv_bytes_per_token() * block_size
        self.allocator = BlockAllocator(num_blocks, block_size, self.bytes_per_block)

    def allocate(self, seq: str, n_tokens: int) -> list[int]:
        return self.allocator.allocate(seq, n_tokens)

    def free(self, seq: str) -> int:
        return self.allocator.free(seq)

    def seq_slots(self, seq: str) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long)


class _EmulatedModel:
    """Just enough of a model for the engine's bookkeeping: shape, segments, weight bytes, an accounting KV."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.device = "emulated"
        self.segments = segment_names(cfg.num_hidden_layers)
        self.weight_bytes = cfg.weight_bytes()

    def new_kv_cache(self, num_blocks: int, block_size: int) -> _AccountingKV:
        return _AccountingKV(self.cfg, num_blocks, block_size)


class EmulatedEngine(Engine):
    """The engine's batching (same admission, chunked prefill and stop rules), with time from the cost model."""

    PLACEHOLDER_TOKEN = ord("x")

    def __init__(self, cfg: ModelConfig, device_kind: str, *, kv_blocks: int, block_size: int = 16,
                 max_batch_tokens: int = 2048, max_running: int = 256, noise_sigma: float = 0.05, seed: int = 0,
                 time_scale: float = 1.0, sleep=time.sleep) -> None:
        super().__init__(_EmulatedModel(cfg), load_tokenizer(None, cfg), kv_blocks=kv_blocks, block_size=block_size,
                         max_batch_tokens=max_batch_tokens, max_running=max_running)
        self.cost = cost_for(cfg, device_kind)
        self.rng = random.Random(seed)
        self.noise_sigma, self.time_scale, self._sleep = noise_sigma, time_scale, sleep
        self.time_hook = None  # (plan, predicted_s) -> seconds: set by the emulated lease agent

    def predicted_s(self, plan) -> float:
        n_dec = dec_kv = pre = pairs = reads = sampled = 0
        for seq, c in plan:
            if seq.prefilling:
                pre += c.length
                pairs += c.length * c.start + c.length * (c.length + 1) // 2
                reads += c.start + c.length
                sampled += int(c.start + c.length >= len(seq.prompt))
            else:
                n_dec += 1
                dec_kv += c.start + 1
        return self.cost.iteration_time(n_dec, dec_kv, pre, pairs, reads, sampled=n_dec + sampled)

    def step(self) -> StepResult:
        t0 = time.perf_counter()
        self._admit()
        plan = self._plan()
        if not plan:
            return StepResult([], {}, 0, 0, 0, 0.0)
        base = self.predicted_s(plan)
        if self.time_hook is not None:
            base = self.time_hook(plan, base)
        dur = base * math.exp(self.rng.gauss(0.0, self.noise_sigma)) * self.time_scale
        self._sleep(max(0.0, dur - (time.perf_counter() - t0)))
        events, pre, dec = [], 0, 0
        for seq, c in plan:
            done_prompt = c.start + c.length >= len(seq.prompt)
            if seq.prefilling:
                pre += c.length
            else:
                dec += 1
            seq.computed += c.length
            if done_prompt:
                events.append(self._advance(seq, self.PLACEHOLDER_TOKEN))
            else:
                events.append(TokenEvent(seq.request_id, [], "", None, len(seq.prompt), 0))
        self._admit()
        ms = (time.perf_counter() - t0) * 1e3
        return StepResult(events, {"iteration": ms}, len(plan), pre, dec, ms)


def emulated_time_scale(env=None) -> float:
    """``SLICESCHED_EMULATED_TIME_SCALE``: multiplies every emulated iteration time (> 0)."""
    return env_number("SLICESCHED_EMULATED_TIME_SCALE", 1.0, above=0, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m services.worker.emulated")
    ap.add_argument("--devices", default=os.environ.get("SLICESCHED_DEVICES", ""), help="comma-separated device ids")
    args = ap.parse_args()
    try:
        settings = Settings.from_env()
        cluster = load_cluster(settings.cluster_file)
        tenants = load_tenants(settings.tenants_file, cluster)
        ids = [d for d in args.devices.split(",") if d]
        if not ids:
            raise ConfigError("arguments", "--devices", "required")
        plan = []
        for did in ids:
            try:
                dev = cluster.device(did)
            except KeyError:
                raise ConfigError(cluster.source, "devices", f"no device with id {did!r}") from None
            if dev.backend != "emulated":
                raise ConfigError(cluster.source, f"devices[{did}].backend", "must be 'emulated' for this worker")
            plan.append((dev, home_tenant_of(cluster, tenants, did)))
        scale = emulated_time_scale()
    except ConfigError as e:
        print(f"worker: config error: {e}", file=sys.stderr)
        return 2
    setup_logging("worker", settings.log_format, settings.log_level, device=",".join(ids), backend="emulated")
    from services.worker.service import WorkerService, kv_blocks_for_device


    async def run_all() -> None:
        from services.worker.emulated_leases import EmulatedPeers

        peers = EmulatedPeers()  # drivers charge guests of this process the guest time they use
        services = []
        for i, (dev, tenant) in enumerate(plan):
            cfg = tenant.model.config
            blocks = kv_blocks_for_device(dev, cluster.headroom_fraction, cfg.weight_bytes(),
                                          cfg.kv_bytes_per_token() * 16)
            eng = EmulatedEngine(cfg, dev.kind, kv_blocks=blocks, seed=i, time_scale=scale)
            from services.worker.lanes import GuestLanes
            from services.worker.service import lane_kv_blocks

            def lane_engine(t, kv_blocks, _kind=dev.kind, _i=i):
                return EmulatedEngine(t.model.config, _kind, kv_blocks=kv_blocks, seed=1000 + _i, time_scale=scale)

            lanes = GuestLanes({t.name: t for t in tenants.tenants if t.name != tenant.name}, lane_engine,
                               lambda t, _d=dev, _w=cfg.weight_bytes(): lane_kv_blocks(_d, cluster.headroom_fraction,
                                                                                       _w, t))
            services.append(WorkerService(settings, cluster, dev, tenant, eng, tenants=tenants, lanes=lanes,
                                          lease_options=peers))
        await asyncio.gather(*(s.run() for s in services))

    asyncio.run(run_all())
    return 0


if __name__ == "__main__":
    sys.exit(main())
