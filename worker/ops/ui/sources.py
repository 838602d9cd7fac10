"""Where the page's data comes from: the records store (read-only), the queue's counts, the workers'
presence records and a job's shipped stage log. The CLI builds one ``Sources`` from the settings;
the tests build one around a store they write to while the page is open.

Each reader answers what it found or why there is nothing to show (the queue's and the log's
failures included); a store failure is the project's own error (``WorkerError``), which the server
turns into a 503 page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from worker.core.errors import LeaseLost, QueueError, WorkerError
from worker.ops.ui import views
from worker.voice.records import Store
from worker.voice.records.view import job_view

# The jobs list reads this many of the newest jobs matching status and since, then filters by id text:
# the stores have no substring index, and the page is for looking, not for reports.
SEARCH_WINDOW = 500
MAX_LISTED = 200
LOG_TAIL_LINES = 60

QueueLook = Callable[[], tuple[Any, Any]]  # queue_view.look bound to its clients: (main, dlq)
LogTail = Callable[[str, int], str | None]  # (job id, lines) -> the newest stage log's last lines


@dataclass
class Sources:
    store: Store
    queue_look: QueueLook | None = None
    log_tail: LogTail | None = None
    presence_interval_s: float = 60.0  # a presence naming no interval of its own is judged on this
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)

    def jobs(self, *, status: str | None, since: datetime | timedelta | None, id_text: str) -> list[dict[str, Any]]:
        if isinstance(since, timedelta):
            since = self.store.now() - since  # on the store's clock, which stamped createdAt (as `jobs`)
        window = SEARCH_WINDOW if id_text else MAX_LISTED
        records = self.store.list_jobs(status=status, since=since, limit=window)
        rows = [views.job_row(job_view(record)) for record in records]
        if id_text:
            rows = [row for row in rows if id_text.lower() in row["id"].lower()]
        return rows[:MAX_LISTED]

    def job(self, job_id: str) -> dict[str, Any] | None:
        job = self.store.get_job(job_id)
        if job is None:
            return None
        profile = self.store.get_profile(job.profile_id) if job.profile_id else None
        return views.job_detail(job, profile, self.clock(), self._tail(job_id))

    def _tail(self, job_id: str) -> tuple[str | None, str]:
        """(the log tail, a note on it): the note says why there is none."""
        if self.log_tail is None:
            return None, "no shipped stage logs to read here (S3_BUCKET is not set)"
        try:
            tail = self.log_tail(job_id, LOG_TAIL_LINES)
        except WorkerError as exc:
            return None, f"stage logs unavailable: {exc}"
        if not tail:
            return None, "no stage log shipped for this job yet"
        return tail, f"the last {LOG_TAIL_LINES} lines of the job's newest stage log"

    def workers(self) -> tuple[list[dict[str, str]], str]:
        """(rows, a note): the note says why there are no rows."""
        # lastSeen is stamped on the store's clock: judged on it too, never on this host's.
        rows = views.worker_rows(self.store.list_workers(), self.store.now(), self.presence_interval_s)
        return rows, "" if rows else "no worker has a presence record"

    def queue(self) -> tuple[dict[str, Any] | None, str]:
        """(the queue's view, or None and why not)."""
        if self.queue_look is None:
            return None, "SQS_QUEUE_URL is not set: no queue to show"
        try:
            return views.queue_rows(*self.queue_look()), ""
        except (QueueError, LeaseLost) as exc:
            return None, f"the queue could not be read: {exc}"
