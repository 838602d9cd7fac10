"""Structured logs: JSON lines by default, readable console output with LOG_FORMAT=console.

A last line of defence scrubs URL query strings, fragments and userinfo from every string value, since
presigned URLs carry credentials; message bodies are never logged in the first place.
"""

from __future__ import annotations

import logging
import re
import sys

import structlog

_URL = re.compile(r"\b((?:https?|s3)://)(?:[^\s/@?#]*@)?([^\s?#]*)(?:\?[^\s#]*)?(?:#\S*)?", re.I)


def scrub(text: str) -> str:
    """``text`` with every URL cut down to scheme://host/path."""
    return _URL.sub(lambda m: m.group(1) + m.group(2), text)


def _scrub_event(_logger, _name, event_dict: dict) -> dict:
    for key, value in event_dict.items():
        if isinstance(value, str) and "://" in value:
            event_dict[key] = scrub(value)
    return event_dict


def configure_logging(level: str = "INFO", fmt: str = "json", stream=None) -> None:
    stream = stream or sys.stderr
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _scrub_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Third-party libraries log through the standard library; keep only their warnings.
    logging.basicConfig(level=logging.WARNING, stream=stream, format="%(levelname)s %(name)s %(message)s")
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
