"""``python -m services.scheduler``: build config, set up logging, run the scheduler service."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from shared.config import DEFAULT_POLICY, ConfigError, load_runtime
from shared.logging import setup_logging
from services.scheduler.steering import steering_settings


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m services.scheduler")
    ap.add_argument("--policy", default=os.environ.get("SLICESCHED_POLICY") or DEFAULT_POLICY)
    args = ap.parse_args()
    try:
        settings, cluster, tenants = load_runtime()
        steering, stale_s = steering_settings()
    except ConfigError as e:
        print(f"scheduler: config error: {e}", file=sys.stderr)
        return 2
    setup_logging("scheduler", settings.log_format, settings.log_level)
    from services.scheduler.policy import load_live_policy
    from services.scheduler.service import SchedulerService

    try:
        policy = load_live_policy(args.policy, os.environ.get("SLICESCHED_POLICY_PARAMS", ""),
                                  cluster.policy_params.get(args.policy))
    except (KeyError, ValueError) as e:  # unknown name or bad parameters
        print(f"scheduler: --policy: {e}", file=sys.stderr)
        return 2
    asyncio.run(SchedulerService(settings, cluster, tenants, policy, sim_steering=steering,
                                 steering_stale_s=stale_s).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
