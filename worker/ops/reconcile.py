"""The reconciler: one pass over the jobs redelivery cannot reach, so none stays pending or processing.

``python -m worker reconcile`` runs one pass and exits; a schedule runs it (the shipped systemd timer
config/voice-worker-reconcile.timer every 15 minutes, or an EventBridge scheduled ECS task with the
same command). Three rules, each independent of the others' failures:

1. **Lost worker** — a ``processing`` job whose lease ended more than RECONCILE_STALE_AFTER_SECONDS
   ago (default: the job time limit + visibility timeout + longest backoff + 1 h; a live worker
   whose store renewals fail keeps working up to the time limit, so less could strand a commit)
   becomes ``error`` WorkerLost, retryable. Files stay: the next attempt resumes from them.
2. **Never enqueued** — ``submit`` stamps ``enqueuedAt`` after a successful send, so a ``pending``
   job older than RECONCILE_PENDING_AFTER_SECONDS with no stamp may have no message. Its stored
   ``messageBody`` (or one rebuilt from the record's fields) is sent again and ``reenqueuedAt``
   stamped: once, ever. If the message did exist after all, the worker acknowledges the duplicate
   without work. A record no valid message can be built from becomes ``error`` InvalidMessage.
3. **Dead-lettered** — each DLQ message whose job is not completed or cancelled (and not under a live
   lease) makes the job ``error`` "dead-lettered after N receives" with the DLQ's error attributes.
   The message stays in the DLQ (``dlq redrive`` is the operator's decision); its id is remembered
   on the job, so it is applied once. A product retry of that job should redrive or delete the DLQ
   message, or keep the job's ``deadLetters`` field, or a later pass applies the old message.

A second pass changes nothing: every rule selects only records that are not yet in its end state.
Jobs are handled up to ``limit`` per rule per pass; the next pass takes the rest.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TextIO

import structlog

from worker.core.errors import InvalidMessage, WorkerError
from worker.core.logs import scrub
from worker.core.metrics import COUNT, NULL_METRICS, Metrics
from worker.core.queue import Queue
from worker.ops.dlq import DeadLetterQueue
from worker.voice.message import parse_job
from worker.voice.metrics import RECONCILE_METRICS
from worker.voice.records import Store
from worker.voice.records.recovery import may_record_dead_letter, worker_lost

log = structlog.get_logger(__name__)

RECONCILER_ID = "reconciler"


def message_body_for(job: dict) -> str:
    """The body to enqueue for a pending job: the one submit stored, else one rebuilt from the record."""
    stored = job.get("messageBody")
    if isinstance(stored, str):
        body = stored
    else:
        fields = {k: job[k] for k in ("profileId", "environment", "metadata", "input") if k in job}
        body = json.dumps({"_doc": {"_id": job["_id"]}, "jobId": job["_id"], **fields}, default=str)
    if parse_job(body).job_id != job["_id"]:
        raise InvalidMessage(f"the stored message names another job than {job['_id']}")
    return body


@dataclass
class ReconcileReport:
    worker_lost: list[str] = field(default_factory=list)
    reenqueued: list[str] = field(default_factory=list)
    unenqueueable: list[str] = field(default_factory=list)
    dead_lettered: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def counts(self) -> dict[str, int]:
        return {"worker_lost": len(self.worker_lost), "reenqueued": len(self.reenqueued),
                "unenqueueable": len(self.unenqueueable), "dead_lettered": len(self.dead_lettered),
                "failed": len(self.failures)}

    def lines(self) -> list[str]:
        c = self.counts()
        lines = [f"reconcile: {c['worker_lost']} worker lost, {c['reenqueued']} re-enqueued, "
                 f"{c['unenqueueable']} not enqueueable, {c['dead_lettered']} dead-lettered, "
                 f"{c['failed']} rules failed"]
        for label, ids in (("worker lost", self.worker_lost), ("re-enqueued", self.reenqueued),
                           ("not enqueueable", self.unenqueueable), ("dead-lettered", self.dead_lettered)):
            lines.extend(f"  {label:<16} {job_id}" for job_id in ids)
        lines.extend(f"  note             {scrub(note)}" for note in self.notes)
        lines.extend(f"  FAILED           {scrub(failure)}" for failure in self.failures)
        return lines


class Reconciler:
    def __init__(self, store: Store, sqs, queue_url: str, *, stale_after_s: float, pending_after_s: float,
                 dlq: DeadLetterQueue | None = None, metrics: Metrics = NULL_METRICS,
                 clock: Callable[[], datetime] | None = None, worker_id: str = RECONCILER_ID,
                 limit: int = 1000, dlq_hold_s: int = 120, dlq_wait_s: int = 1):
        self._store, self._sqs, self._queue_url = store, sqs, queue_url
        self._queue = Queue(sqs, queue_url)
        self._stale_after_s, self._pending_after_s = stale_after_s, pending_after_s
        self._dlq = dlq  # None: resolved from the queue's RedrivePolicy on each pass
        # The store's clock by default: leases were stamped on it, so they are judged on it too.
        self._metrics, self._clock, self._worker_id = metrics, clock or store.now, worker_id
        self._limit, self._dlq_hold_s, self._dlq_wait_s = limit, dlq_hold_s, dlq_wait_s

    def run(self) -> ReconcileReport:
        """One pass of the three rules; a failing rule is reported and does not stop the others."""
        report = ReconcileReport()
        for name, rule in (("lost workers", self._lost_workers), ("never enqueued", self._never_enqueued),
                           ("dead letters", self._dead_letters)):
            try:
                rule(report)
            except WorkerError as exc:
                log.error("reconcile.rule_failed", rule=name, error=str(exc), error_type=exc.error_type)
                report.failures.append(f"{name}: {exc}")
        self._metrics.emit({RECONCILE_METRICS[k]: (v, COUNT) for k, v in report.counts().items()},
                           event="reconcile")
        log.info("reconcile.done", **report.counts())
        return report

    def _lost_workers(self, report: ReconcileReport) -> None:
        now = self._clock()
        for job in self._store.find_stale(limit=self._limit):
            # Decided here first so a pass with nothing to do writes nothing; the store decides again.
            if not worker_lost(job, now, self._stale_after_s):
                continue
            if self._store.mark_worker_lost(job["_id"], stale_after_s=self._stale_after_s,
                                            worker=self._worker_id):
                log.warning("reconcile.worker_lost", job_id=job["_id"])
                report.worker_lost.append(job["_id"])

    def _never_enqueued(self, report: ReconcileReport) -> None:
        for job in self._store.find_unenqueued(self._pending_after_s, limit=self._limit):
            job_id = job["_id"]
            try:
                body = message_body_for(job)
            except InvalidMessage as exc:
                if self._store.record_error(
                        job_id, token=None, error_type="InvalidMessage", retryable=False,
                        message=f"never enqueued, and no valid message can be built from the record: {exc}"):
                    log.error("reconcile.not_enqueueable", job_id=job_id, error=str(exc))
                    report.unenqueueable.append(job_id)
                continue
            # Send first, stamp after: a crash in between re-sends next pass (a harmless duplicate);
            # the other order could lose the job's only message for good.
            # A FIFO deduplication id of its own: SQS must not drop this send as a repeat of the submit's.
            self._queue.send(body, group_id=job_id, dedup_id=f"{job_id}-reenqueue",
                             action=f"re-enqueue of job {job_id}")
            self._store.mark_enqueued(job_id, again=True)
            log.warning("reconcile.reenqueued", job_id=job_id)
            report.reenqueued.append(job_id)

    def _dead_letters(self, report: ReconcileReport) -> None:
        dlq = self._dlq or DeadLetterQueue.of(self._sqs, self._queue_url, wait_s=self._dlq_wait_s)
        if dlq is None:
            report.notes.append("the queue has no RedrivePolicy: no dead-letter queue to look at")
            return
        letters = dlq.peek(self._limit, hold_s=self._dlq_hold_s)
        try:
            now = self._clock()
            for letter in letters:
                if letter.job_id is None:
                    report.notes.append(f"DLQ message {letter.message_id} names no job")
                    continue
                job = self._store.get_job(letter.job_id)
                if job is None:
                    report.notes.append(f"DLQ message {letter.message_id}: no record of job {letter.job_id}")
                    continue
                # The store's own swap decides on the stored document: so does this look before it.
                if not may_record_dead_letter(job.document, letter.message_id, now):
                    continue
                if self._store.record_dead_letter(letter.job_id, dead_letter=letter.for_record(),
                                                  worker=self._worker_id):
                    log.warning("reconcile.dead_lettered", job_id=letter.job_id, message_id=letter.message_id)
                    report.dead_lettered.append(letter.job_id)
        finally:
            dlq.release(letters)


def cmd_reconcile(reconciler: Reconciler, out: TextIO | None = None) -> int:
    report = reconciler.run()
    print("\n".join(report.lines()), file=out or sys.stdout, flush=True)
    return 0 if report.ok else 1
