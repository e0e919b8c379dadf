"""``slicesched up``: start the whole mesh on this machine and serve the gateway until Ctrl-C."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from shared.config import (DEFAULT_POLICY, REPO_CONFIGS, ConfigError, dev_api_keys, env_number, load_cluster,
                           load_tenants)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=os.environ.get("SLICESCHED_CLUSTER", str(REPO_CONFIGS / "cluster.yaml")))
    p.add_argument("--tenants", default=os.environ.get("SLICESCHED_TENANTS", str(REPO_CONFIGS / "tenants.yaml")))
    p.add_argument("--data-dir", default=os.environ.get("SLICESCHED_DATA_DIR", ".data"),
                   help="Redis AOF and service logs (default .data)")
    p.add_argument("--host", default=os.environ.get("SLICESCHED_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=None,
                   help="gateway port (0 = a free port; default $SLICESCHED_GATEWAY_PORT or 8000)")
    p.add_argument("--policy", default=None,
                   help=f"the scheduler's policy (default $SLICESCHED_POLICY or {DEFAULT_POLICY}; docs/policies.md)")
    p.add_argument("--prefix", default=os.environ.get("SLICESCHED_PREFIX", "slicesched:"))
    p.add_argument("--log-format", default="json", choices=["json", "console"], help="services' log format")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for all services to be healthy")


def run(args: argparse.Namespace) -> int:
    from services.launcher import Launcher
    from services.scheduler.policy import load_live_policy

    from shared.model.checks import check_deployment

    cluster = load_cluster(args.cluster)
    tenants = load_tenants(args.tenants, cluster)  # validate before starting anything
    check_deployment(cluster, tenants)  # homes, model fit, checkpoint tensors (as check-config)
    if args.port is None:
        args.port = env_number("SLICESCHED_GATEWAY_PORT", 8000, int, minimum=0, maximum=65535)
    named = ("arguments", "--policy")
    if args.policy is None:
        args.policy = os.environ.get("SLICESCHED_POLICY") or DEFAULT_POLICY
        named = ("environment", "SLICESCHED_POLICY")
    # the scheduler would refuse these at its start; say so now, not after the services' start timeout
    params_json = os.environ.get("SLICESCHED_POLICY_PARAMS", "")
    for where, field, params in ((*named, ""), ("environment", "SLICESCHED_POLICY_PARAMS", params_json)):
        try:
            load_live_policy(args.policy, params, cluster.policy_params.get(args.policy))
        except (KeyError, ValueError) as e:
            raise ConfigError(where, field, str(e).strip("'\"")) from None
    launcher = Launcher(cluster, cluster_file=str(Path(args.cluster).resolve()),
                        tenants_file=str(Path(args.tenants).resolve()), data_dir=Path(args.data_dir).resolve(),
                        gateway_host=args.host, gateway_port=args.port, prefix=args.prefix, policy=args.policy,
                        redis_url=os.environ.get("REDIS_URL") or None, log_format=args.log_format)
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
    print(launcher.banner(dev_api_keys(args.tenants), {t.name: t.model.label for t in tenants.tenants}), flush=True)
    try:
        while not stop["flag"]:
            time.sleep(0.5)
            launcher.supervise_once()
    finally:
        print("slicesched: stopping ...", file=sys.stderr, flush=True)
        launcher.stop()
        print("slicesched: stopped", file=sys.stderr, flush=True)
    return 0
