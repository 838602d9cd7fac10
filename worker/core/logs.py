"""Structured logs: JSON lines by default, readable console output with LOG_FORMAT=console.

A last line of defence passes every string value through ``worker.core.redact.redact_text``, the same
verb that makes an error message safe for a record or a dead letter: URLs of any scheme are cut to
scheme://host/path (presigned URLs carry credentials in their query), other credential shapes are
masked (userinfo, AWS key ids, ``password=...``), and terminal escape sequences and control
characters (a stage's stderr in an error) are dropped. Message bodies are never logged at all.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger

from worker.core.redact import redact_text

# One rule for what a URL or a secret may show, wherever the text goes: records, dead letters, logs,
# Sentry and the operators' terminals (``dlq list``, ``reconcile``) all get redact_text's reading.
scrub = redact_text


# Deep enough for any log field or Sentry event; a bound keeps a cyclic structure from recursing forever.
_MAX_DEPTH = 64


def scrub_value(value: Any, *, drop_keys: frozenset = frozenset(), _depth: int = 0) -> Any:
    """``value`` with every string in it scrubbed, through lists, tuples and dicts (minus ``drop_keys``).

    Nested too: a list of failures or a dict of paths carries the same URLs as a plain string.
    """
    if isinstance(value, str):
        return scrub(value)
    if _depth >= _MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {k: scrub_value(v, drop_keys=drop_keys, _depth=_depth + 1)
                for k, v in value.items() if k not in drop_keys}
    if isinstance(value, list | tuple):
        return [scrub_value(v, drop_keys=drop_keys, _depth=_depth + 1) for v in value]
    return value


def _scrub_event(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    for key, value in event_dict.items():
        event_dict[key] = scrub_value(value)
    return event_dict


class AddFields:
    """Adds fixed fields to every line (``worker_id``, ``version``), unless the line sets them itself."""

    def __init__(self, fields: Mapping[str, str]):
        self._fields = dict(fields)

    def __call__(self, _logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
        for key, value in self._fields.items():
            event_dict.setdefault(key, value)
        return event_dict


def configure_logging(level: str = "INFO", fmt: str = "json", stream=None,
                      fields: Mapping[str, str] | None = None) -> None:
    """Structured logging for the process; ``fields`` go on every line (which worker, which release)."""
    stream = stream or sys.stderr
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            AddFields(fields or {}),
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
