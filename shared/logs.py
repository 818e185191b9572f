"""structlog, set up once per process: console for people, JSON lines when asked.

Every log line about a request carries ``req_id``: bind it (``log.bind(req_id=...)``) or pass it
as a keyword. ``service`` is bound for the whole process by ``setup_logging``.
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def setup_logging(service: str, json: bool = False, level: str = "info") -> structlog.stdlib.BoundLogger:
    global _configured
    if not _configured:
        renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
            cache_logger_on_first_use=True,
        )
        _configured = True
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger()


def get_logger(**bound) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger().bind(**bound)
