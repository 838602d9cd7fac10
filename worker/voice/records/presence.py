"""The rules of worker presence records (``worker.core.presence`` writes them, ``workers`` and the web
page read them), shared by both stores as the job rules are.

A record is keyed by ``workerId`` and holds only the fields below, each text clipped: the store keeps
what a worker said, never more. ``lastSeen`` is stamped by the store, on its own clock, so every
reader judges staleness against one clock. A record not seen for ``PRESENCE_KEPT_S`` is dropped
(by both stores on each write, on the store's clock: not a MongoDB TTL index, which judges on the
server's): a fleet that scaled in leaves no trace for ever.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime

WORKER_ID, LAST_SEEN = "workerId", "lastSeen"
TEXT_FIELDS = ("workerId", "host", "version", "state", "jobId", "device")
TIME_FIELDS = ("since",)
NUMBER_FIELDS = ("intervalS",)
TEXT_MAX_CHARS = 200
# A day: a worker gone for longer is history, not fleet.
PRESENCE_KEPT_S = 86_400
# Missed ticks before a record counts as stale, plus slack for a slow store write.
STALE_AFTER_TICKS = 3
STALE_SLACK_S = 30.0


def presence_record(presence: Mapping[str, object], now: datetime) -> dict:
    """The record a store keeps for ``presence``: the known fields only, text clipped, ``lastSeen`` now.

    ValueError when ``workerId`` is not a non-empty text: there would be nothing to key it by."""
    worker_id = presence.get(WORKER_ID)
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError("a presence record needs a workerId")
    record: dict = {}
    for name in TEXT_FIELDS:
        value = presence.get(name)
        record[name] = value[:TEXT_MAX_CHARS] if isinstance(value, str) else None
    for name in TIME_FIELDS:
        value = presence.get(name)
        record[name] = value if isinstance(value, datetime) and value.tzinfo is not None else None
    for name in NUMBER_FIELDS:
        record[name] = positive_seconds(presence.get(name))
    record[LAST_SEEN] = now
    return record


def positive_seconds(value: object) -> float | None:
    """``value`` as a finite number of seconds above 0, or None (a flag, text, nan: another writer's)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def stale_after_s(interval_s: float) -> float:
    """How old ``lastSeen`` may get before the worker counts as gone: a few of its own ticks."""
    return STALE_AFTER_TICKS * interval_s + STALE_SLACK_S


def is_stale(record: Mapping[str, object], now: datetime, default_interval_s: float) -> bool:
    """Whether the worker stopped writing: ``lastSeen`` older than ``stale_after_s`` of its own interval
    (the reader's heartbeat interval when the record names none). A record without a readable
    ``lastSeen`` is stale."""
    seen = record.get(LAST_SEEN)
    if not isinstance(seen, datetime) or seen.tzinfo is None:
        return True
    interval_s = positive_seconds(record.get("intervalS")) or default_interval_s
    return (now - seen).total_seconds() > stale_after_s(interval_s)
