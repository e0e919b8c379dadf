"""``python -m services.simulator``: build config, set up logging, run the simulator service."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from shared.config import ConfigError, load_runtime
from shared.logging import setup_logging


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m services.simulator")
    ap.add_argument("--name", default=os.environ.get("SLICESCHED_NAME", "simulator"),
                    help="instance name: health key and stream consumer name (stable across restarts)")
    args = ap.parse_args()
    try:
        settings, cluster, tenants = load_runtime()
    except ConfigError as e:
        print(f"simulator: config error: {e}", file=sys.stderr)
        return 2
    setup_logging("simulator", settings.log_format, settings.log_level)
    from services.simulator.service import SimulatorService

    asyncio.run(SimulatorService(settings, cluster, tenants, args.name).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
