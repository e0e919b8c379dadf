"""``python -m services.worker --device ID``: build the device's engine and run the worker service."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from shared.config import ConfigError, Settings, env_number, home_tenant_of, load_cluster, load_tenants
from shared.logging import setup_logging


def engine_knobs(env=None) -> dict:
    """The engine's settings from the environment (``ConfigError`` naming the variable when one is malformed)."""
    return {"kv_pool_mb": env_number("SLICESCHED_KV_POOL_MB", 0.0, float, minimum=0, env=env),
            "max_batch_tokens": env_number("SLICESCHED_MAX_BATCH_TOKENS", 256, int, minimum=1, env=env),
            "max_running": env_number("SLICESCHED_MAX_RUNNING", 64, int, minimum=1, env=env)}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m services.worker")
    ap.add_argument("--device", default=os.environ.get("SLICESCHED_DEVICE"), help="device id from cluster.yaml")
    args = ap.parse_args()
    try:
        settings = Settings.from_env()
        cluster = load_cluster(settings.cluster_file)
        tenants = load_tenants(settings.tenants_file, cluster)
        if not args.device:
            raise ConfigError("arguments", "--device", "required (or set SLICESCHED_DEVICE)")
        try:
            device = cluster.device(args.device)
        except KeyError:
            raise ConfigError(cluster.source, "devices", f"no device with id {args.device!r}") from None
        tenant = home_tenant_of(cluster, tenants, device.id)
        from shared.model.checks import fit_problem
        problem = fit_problem(tenant, device, cluster.headroom_fraction)
        if problem:
            raise ConfigError(tenants.source, "home_devices", problem)
        knobs = engine_knobs()
        from services.worker.lease_agent import LeaseOptions
        from services.worker.service import worker_env_threads
        lease_options = LeaseOptions.from_env()
        worker_env_threads(device)
    except ConfigError as e:
        print(f"worker: config error: {e}", file=sys.stderr)
        return 2
    setup_logging("worker", settings.log_format, settings.log_level, device=device.id)
    import torch

    from services.worker.service import WorkerService, kv_blocks_for_device, lane_kv_blocks, worker_env_threads
    from shared.model.engine import Engine
    from shared.model.loader import build_model

    if device.backend == "cpu":
        torch.set_num_threads(worker_env_threads(device))
        torch_device = "cpu"
    elif device.backend == "cuda":
        torch_device = f"cuda:{device.cuda_index or 0}"
    else:
        print(f"worker: device {device.id}: backend {device.backend!r} is served by the emulated worker",
              file=sys.stderr)
        return 2
    model, tokenizer = build_model(tenant.model, torch_device)
    cfg = tenant.model.config
    bpb = cfg.kv_bytes_per_token() * 16
    cap = int(knobs["kv_pool_mb"] * 2**20) or None
    blocks = kv_blocks_for_device(device, cluster.headroom_fraction, model.weight_bytes, bpb, cap)
    engine = Engine(model, tokenizer, kv_blocks=blocks, block_size=16, max_batch_tokens=knobs["max_batch_tokens"],
                    max_running=knobs["max_running"])
    from services.worker.lanes import GuestLanes

    def lane_engine(t, kv_blocks):  # a guest lane's engine: the tenant's full model, staged from checkpoint/seed
        m, tok = build_model(t.model, torch_device)
        return Engine(m, tok, kv_blocks=kv_blocks, block_size=16, max_batch_tokens=engine.max_batch_tokens,
                      max_running=engine.max_running)

    lanes = GuestLanes({t.name: t for t in tenants.tenants if t.name != tenant.name}, lane_engine,
                       lambda t: lane_kv_blocks(device, cluster.headroom_fraction, model.weight_bytes, t))
    asyncio.run(WorkerService(settings, cluster, device, tenant, engine, tenants=tenants,
                              lease_options=lease_options, lanes=lanes).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
