"""``workers``: every worker that wrote a presence record, what each runs and for how long, stale ones marked.

Each worker writes its record on its own tick (``worker.core.presence``) and deletes it on a clean
exit; one that crashed, was killed or lost its store leaves it, and it shows ``STALE`` once its
``lastSeen`` (the store's clock) is older than a few of its ticks (``presence.is_stale``). ``for`` is
how long the worker has been in its state, ``seen`` how long ago it last wrote, both on the store's
clock (``since`` is the worker's, checked against the store's at its start).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from datetime import datetime
from typing import Any, TextIO

from worker.ops.commands import format_age, one_line
from worker.voice.records.presence import is_stale, stale_after_s

EXIT_OK = 0


def _seconds_between(earlier: object, later: datetime) -> float | None:
    if not isinstance(earlier, datetime) or earlier.tzinfo is None:
        return None
    return max(0.0, (later - earlier).total_seconds())


def worker_rows(records: list[dict], now: datetime, default_interval_s: float) -> list[dict]:
    """Each record with ``stale``, ``forS`` (time in its state) and ``seenAgoS``; live ones first, then
    by workerId. What ``workers --json`` prints and the web page shows."""
    rows = [{**record, "stale": is_stale(record, now, default_interval_s),
             "forS": _seconds_between(record.get("since"), now),
             "seenAgoS": _seconds_between(record.get("lastSeen"), now)} for record in records]
    return sorted(rows, key=lambda row: (row["stale"], str(row.get("workerId"))))


def short_age(age_s: float | None) -> str:
    """An age for a column: seconds under a minute, else ``format_age``'s minutes, hours, days."""
    if age_s is None:
        return "?"
    return f"{int(age_s)}s" if age_s < 60 else format_age(age_s)


def render_row(row: Mapping[str, Any]) -> str:
    """One worker on one line: id, state (STALE first when stale), the job, for how long, when last seen,
    device, version and host (every value another process wrote is made one line of plain text)."""
    def text(name: str) -> str:
        value = row.get(name)
        return "-" if value is None else one_line(value)

    state = f"STALE {text('state')}" if row["stale"] else text("state")
    job = f"job {text('jobId')}" if row.get("jobId") else "-"
    return (f"{text('workerId')}  {state}  {job}  for {short_age(row['forS'])}  "
            f"seen {short_age(row['seenAgoS'])} ago  {text('device')}  v{text('version')}  host {text('host')}")


def _jsonable(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def cmd_workers(store, *, as_json: bool, default_interval_s: float, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    now = store.now()
    rows = worker_rows(store.list_workers(), now, default_interval_s)
    if as_json:
        print(json.dumps({"now": now.isoformat(), "workers": [
            {key: _jsonable(value) for key, value in row.items()} for row in rows]}, indent=2), file=out)
        return EXIT_OK
    if not rows:
        print("no worker presence recorded: none running (or none in the last day)", file=out)
        return EXIT_OK
    stale = sum(row["stale"] for row in rows)
    print(f"{len(rows)} worker(s), {stale} stale (silent for over 3 of its ticks and 30 s: "
          f"{stale_after_s(default_interval_s):.0f} s with this heartbeat)", file=out)
    for row in rows:
        print(render_row(row), file=out)
    return EXIT_OK
