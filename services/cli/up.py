"""``slicesched up``: start the whole mesh on this machine and serve the gateway until Ctrl-C."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from services.cli.check_config import add_config_args, check_mesh
from shared.config import ConfigError, dev_api_keys, env_number


def configure(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--data-dir", default=os.environ.get("SLICESCHED_DATA_DIR", ".data"),
                   help="Redis AOF and service logs (default .data)")
    p.add_argument("--host", default=os.environ.get("SLICESCHED_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=None,
                   help="gateway port (0 = a free port; default $SLICESCHED_GATEWAY_PORT or 8000)")
    p.add_argument("--prefix", default=os.environ.get("SLICESCHED_PREFIX", "slicesched:"))
    p.add_argument("--log-format", default="json", choices=["json", "console"], help="services' log format")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for all services to be healthy")
    p.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                   help="start a private Redis Cluster of N masters (N >= 3), one replica each, instead of one "
                        "redis-server (ignored when REDIS_URL is set)")


def run(args: argparse.Namespace) -> int:
    from services.launcher import Launcher

    if args.redis_cluster and args.redis_cluster < 3:
        raise ConfigError("arguments", "--redis-cluster", f"a Redis Cluster needs at least 3 masters, not "
                                                          f"{args.redis_cluster}")
    # everything a service would refuse at its start, before starting anything (the same checks as check-config)
    mesh = check_mesh(args.cluster, args.tenants, args.policy)
    cluster, args.policy = mesh.cluster, mesh.policy
    if args.port is None:
        args.port = env_number("SLICESCHED_GATEWAY_PORT", 8000, int, minimum=0, maximum=65535)
    launcher = Launcher(cluster, cluster_file=str(Path(args.cluster).resolve()),
                        tenants_file=str(Path(args.tenants).resolve()), data_dir=Path(args.data_dir).resolve(),
                        gateway_host=args.host, gateway_port=args.port, prefix=args.prefix, policy=args.policy,
                        redis_url=os.environ.get("REDIS_URL") or None, log_format=args.log_format,
                        redis_cluster=args.redis_cluster)
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print("slicesched: starting Redis and services ...", file=sys.stderr, flush=True)
    try:
        launcher.start(timeout_s=args.timeout)
    except RuntimeError as e:
        print(f"slicesched: {e}", file=sys.stderr, flush=True)
        launcher.stop(drain_s=5)
        return 1
    if stop["flag"]:
        launcher.stop()
        return 0
    print(launcher.banner(dev_api_keys(args.tenants), {t.name: t.model.label for t in mesh.tenants.tenants}), flush=True)
    try:
        while not stop["flag"]:
            time.sleep(0.5)
            launcher.supervise_once()
    finally:
        print("slicesched: stopping ...", file=sys.stderr, flush=True)
        launcher.stop()
        print("slicesched: stopped", file=sys.stderr, flush=True)
    return 0
