"""Structured logs: JSON lines by default, readable console output with LOG_FORMAT=console.

A last line of defence scrubs URL query strings, fragments and userinfo from every string value, since
presigned URLs carry credentials, and masks other credential shapes (``worker.core.redact.redact_secrets``:
userinfo in any scheme's URL, AWS key ids, ``password=...``); message bodies are never logged at all.
Terminal escape sequences and control characters (a stage's stderr in an error) are dropped too
(``worker.core.redact.strip_control``).
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import structlog

from worker.core.redact import redact_secrets, strip_control

_URL = re.compile(r"\b((?:https?|s3)://)(?:[^\s/@?#]*@)?([^\s?#]*)(?:\?[^\s#]*)?(?:#\S*)?", re.I)


def scrub(text: str) -> str:
    """``text`` with every http(s)/s3 URL cut down to scheme://host/path and secret shapes masked, and
    no terminal control sequence (console logs and command output reach terminals)."""
    return redact_secrets(_URL.sub(lambda m: m.group(1) + m.group(2), strip_control(text)))


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


def _scrub_event(_logger, _name, event_dict: dict) -> dict:
    for key, value in event_dict.items():
        event_dict[key] = scrub_value(value)
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
