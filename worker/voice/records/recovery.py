"""The pure rules for records nobody will finish: what the reconciler may change, and into what.

Both stores decide with these functions and restate the same conditions in their atomic writes, as
they do with the rules in ``worker.voice.records.rules``. Every transition here only writes the job record (files,
uploads and the profile are left as they are), clears no live lease, never leaves a final status,
and appends exactly one history entry saying what the reconciler did.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from worker.voice.records.rules import (
    ERROR,
    ERROR_MESSAGE_MAX_CHARS,
    FAILED_ATTEMPTS,
    FINAL_STATUSES,
    PENDING,
    PROCESSING,
    close_attempt,
    lease_live,
    with_history,
)

ENQUEUED, REENQUEUED = "enqueuedAt", "reenqueuedAt"
WORKER_LOST, DEAD_LETTERED = "worker_lost", "dead_lettered"
# Dead-letter message ids already applied to a job, so a DLQ message is applied once, ever.
DEAD_LETTERS = "deadLetters"
DEAD_LETTERS_KEPT = 50


def cutoff(now: datetime, age_s: float) -> datetime:
    return now - timedelta(seconds=age_s)


def awaiting_enqueue(job: dict, now: datetime, older_than_s: float) -> bool:
    """Pending, older than ``older_than_s``, and no message was ever recorded as sent for it."""
    created = job.get("createdAt")
    return (job.get("status") == PENDING and job.get(ENQUEUED) is None
            and job.get(REENQUEUED) is None
            and created is not None and created <= cutoff(now, older_than_s))


def worker_lost(job: dict, now: datetime, stale_after_s: float) -> bool:
    """Processing, and its lease (or, once released, its last heartbeat) ended ``stale_after_s`` ago."""
    if job.get("status") != PROCESSING:
        return False
    lease = job.get("lease") if isinstance(job.get("lease"), dict) else None
    last = lease.get("expiresAt") if lease else (job.get("heartbeatAt") or job.get("startedAt"))
    try:
        return isinstance(last, datetime) and last <= cutoff(now, stale_after_s)
    except TypeError:
        return False  # a naive time another writer left: no attempt of ours stamped it


def may_record_dead_letter(job: dict, message_id: str, now: datetime) -> bool:
    """Not final, not under a live lease, and this DLQ message was not applied to it before."""
    return (job.get("status") not in FINAL_STATUSES and not lease_live(job, now)
            and message_id not in _dead_letters(job))


def _dead_letters(job: dict) -> list:
    """The DLQ message ids applied to the job; none when another writer left something else there."""
    applied = job.get(DEAD_LETTERS)
    return [item for item in applied if isinstance(item, str)] if isinstance(applied, list) else []


def stamped(job: dict, field: str, now: datetime) -> dict:
    return {**job, field: now}


def _reconciled(job: dict, *, error: dict, outcome: str, worker: str, now: datetime) -> dict:
    # The dead attempt's own entry (if still "running") is closed, then one entry says what we did.
    history = close_attempt(job.get("history"), "abandoned", now)
    history.append({"worker": worker, "token": None, "start": now, "end": now, "outcome": outcome})
    error = {**error, "message": str(error["message"])[:ERROR_MESSAGE_MAX_CHARS], "at": now}
    return {**with_history(job, history), "status": ERROR, "error": error, "lease": None}


def lost(job: dict, *, worker: str, now: datetime) -> dict:
    lease: dict = job["lease"] if isinstance(job.get("lease"), dict) else {}
    history = job.get("history") if isinstance(job.get("history"), list) else []
    last = history[-1] if history and isinstance(history[-1], dict) else {}
    last_owner = lease.get("owner") or last.get("worker") or "unknown"
    ended = lease.get("expiresAt") or job.get("heartbeatAt")
    message = (f"worker lost: {last_owner} stopped renewing its lease (last valid until {ended}) "
               "and no worker took the job over; its files are kept, retrying resumes from them")
    return _reconciled(job, error={"type": "WorkerLost", "message": message, "retryable": True},
                       outcome=WORKER_LOST, worker=worker, now=now)


def dead_lettered(job: dict, dead_letter: dict, *, worker: str, now: datetime) -> dict:
    """``dead_letter``: messageId, receiveCount, and the DLQ's errorType/errorMessage/sourceQueue."""
    count = dead_letter.get("receiveCount", "?")
    reason = f"dead-lettered after {count} receive{'' if str(count) == '1' else 's'}"
    if dead_letter.get("errorType") or dead_letter.get("errorMessage"):
        reason += f": {dead_letter.get('errorType') or 'error'}: {dead_letter.get('errorMessage') or '-'}"
    error = {"type": dead_letter.get("errorType") or "DeadLettered", "message": reason,
             "retryable": False, "deadLetter": dict(dead_letter)}
    applied = [*_dead_letters(job), dead_letter["messageId"]][-DEAD_LETTERS_KEPT:]
    # Whatever arrives for the job next is an operator's redrive or a resubmit: a fresh retry budget.
    return {**_reconciled(job, error=error, outcome=DEAD_LETTERED, worker=worker, now=now),
            DEAD_LETTERS: applied, FAILED_ATTEMPTS: 0}
