"""``python -m services.gmg``: build config, set up logging, run the GMG state service."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from shared.config import ConfigError, load_runtime
from shared.logging import setup_logging


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m services.gmg")
    ap.add_argument("--name", default=os.environ.get("SLICESCHED_NAME", "gmg"),
                    help="instance name: health key and stream consumer name (stable across restarts)")
    args = ap.parse_args()
    try:
        settings, cluster, tenants = load_runtime()
        from services.gmg.reconcile import ReconcileOptions, ReconcileRefused

        options = ReconcileOptions.from_env()
    except ConfigError as e:
        print(f"gmg: config error: {e}", file=sys.stderr)
        return 2
    setup_logging("gmg", settings.log_format, settings.log_level)
    from services.gmg.service import GMGService

    try:
        asyncio.run(GMGService(settings, cluster, tenants, args.name, options=options).run())
    except ReconcileRefused as e:
        print("gmg: refusing to start: " + "; ".join(e.conflicts), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
