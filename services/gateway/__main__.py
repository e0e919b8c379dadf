"""``python -m services.gateway``: build the config from the environment, set up logging, serve until SIGTERM.

Environment: REDIS_URL, SLICESCHED_PREFIX, SLICESCHED_CLUSTER, SLICESCHED_TENANTS, SLICESCHED_GATEWAY_HOST
(default 127.0.0.1), SLICESCHED_GATEWAY_PORT (8000; 0 picks a free port, logged as ``gateway_listening``),
SLICESCHED_LOG_FORMAT, SLICESCHED_LOG_LEVEL, SLICESCHED_DRAIN_S, SLICESCHED_MAX_BODY_BYTES,
SLICESCHED_MAX_INFLIGHT, SLICESCHED_ADMIT_SLA_FRACTION, SLICESCHED_REQUEST_IDLE_TIMEOUT_S,
SLICESCHED_REDIS_TIMEOUT_S.
"""
from __future__ import annotations

import asyncio
import os
import sys

from shared.config import ConfigError, Settings, load_cluster, load_tenants
from shared.logging import setup_logging


def main(env: dict[str, str] | None = None) -> int:
    e = dict(os.environ) if env is None else env
    try:
        from services.gateway.core import GatewayLimits

        settings = Settings.from_env(e)
        limits = GatewayLimits.from_env(e)
        cluster = load_cluster(settings.cluster_file)
        tenants = load_tenants(settings.tenants_file, cluster)
    except ConfigError as err:
        print(f"gateway: {err}", file=sys.stderr)
        return 2
    setup_logging("gateway", settings.log_format, settings.log_level)
    from services.gateway.service import GatewayService

    try:
        service = GatewayService(settings, tenants, limits)
    except ValueError as err:  # e.g. an unreadable tokenizer.json in a tenant's checkpoint
        print(f"gateway: {err}", file=sys.stderr)
        return 2
    try:
        asyncio.run(service.run())
    except OSError as err:  # e.g. the port is taken
        print(f"gateway: cannot serve on {settings.gateway_host}:{settings.gateway_port}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
