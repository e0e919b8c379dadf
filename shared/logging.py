"""structlog setup: JSON under the launcher/containers, console when interactive; every line carries ``service``."""
from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(service: str, fmt: str = "auto", level: str = "info", **context: str) -> structlog.BoundLogger:
    lvl = getattr(logging, level.upper(), logging.INFO)
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, **context)
    return structlog.get_logger()
