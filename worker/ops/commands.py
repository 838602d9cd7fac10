"""The operator's commands: submit, status, cancel, health, dlq list/redrive.

Each takes its clients, prints, and returns an exit code (the table is in worker/ops/cli.py's help texts).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from typing import Any, TextIO

from worker.core.errors import InvalidMessage, WorkerError
from worker.core.health import liveness_problem
from worker.core.logs import scrub
from worker.core.redact import strip_control
from worker.ops.dlq import MOVE_TASK, RECEIVE_SEND_DELETE, DeadLetterQueue
from worker.settings import Settings
from worker.voice.input_policy import SHAPE_ONLY, InputPolicy
from worker.voice.records import Store
from worker.voice.records.rules import (
    ERROR,
    FINAL_STATUSES,
    PENDING,
    PROCESSING,
    committing,
    failed_attempts,
    lease_live,
    usage,
)
from worker.voice.submit import prepare, submit_prepared

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_NOTHING_TO_DO, EXIT_TOO_LATE = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def cmd_submit(open_store: Callable[[], AbstractContextManager[Store]], sqs, queue_url: str, source: TextIO, *,
               as_json: bool, policy: InputPolicy = SHAPE_ONLY, out: TextIO | None = None,
               err: TextIO | None = None) -> int:
    """Refuses (exit 2) what the worker's ``policy`` would refuse before the store is even opened, so a
    refused submission leaves no record and no new STORE_URL file behind."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        payload = json.loads(source.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        print(f"submission is not valid JSON: {exc}", file=err)
        return EXIT_USAGE
    try:
        prepared = prepare(payload, policy)
        with open_store() as store:
            job_id, created = submit_prepared(store, sqs, queue_url, prepared)
    except InvalidMessage as exc:
        for line in exc.problems:
            print(line, file=err)
        return EXIT_USAGE
    except WorkerError as exc:
        print(f"submit failed: {exc}", file=err)
        return EXIT_FAILED
    if as_json:
        print(json.dumps({"jobId": job_id}), file=out)
    else:
        print(job_id if created else f"{job_id} (already submitted with this idempotency key)", file=out)
    return EXIT_OK


def status_document(store: Store, job_id: str) -> dict | None:
    job = store.get_job(job_id)
    if job is None:
        return None
    profile = store.get_profile(job["profileId"]) if job.get("profileId") else None
    # What the job cost so far (GPU-seconds of its trainer stages), summed from its attempts.
    cost = {**usage(job), "failedAttempts": failed_attempts(job)}
    return {"job": _jsonable(job), "profile": _jsonable(profile), "cost": cost}


def one_line(value: Any) -> str:
    """A record value as one line of terminal text: whoever wrote it cannot clear, retitle or add lines."""
    return strip_control(str(value), keep_lines=False)


def indented_lines(value: Any, indent: str) -> str:
    """A multi-line record value (a stage's log tail) with every line after the first indented, so
    none of its lines can pass for one of ours at the start of a line."""
    return f"\n{indent}".join(strip_control(str(value)).split("\n"))


def render_status(doc: dict) -> str:
    job, profile = doc["job"], doc["profile"] or {}
    o = one_line
    lines = [f"job {o(job['_id'])}: {o(job.get('status'))}  (attempts: {o(job.get('attempts', 0))})"]
    if job.get("progress"):
        p = job["progress"]
        lines.append(f"  progress   {o(p.get('stage'))} {p.get('percent', 0):.0f} %  "
                     f"(at {o(p.get('updatedAt'))})")
    if job.get("lease"):
        held = job["lease"]
        lines.append(f"  lease      held by {o(held.get('owner'))} until {o(held.get('expiresAt'))}")
    if cost := doc.get("cost"):
        lines.append(f"  cost       {cost['gpuSeconds']:.0f} GPU-s, of which {cost['wastedGpuSeconds']:.0f} wasted "
                     f"by attempts that did not commit; {cost['failedAttempts']} failed attempts")
    if job.get("cancelRequested") and job.get("status") != "cancelled":
        lines.append("  cancel     requested")
    if job.get("error"):
        e = job["error"]
        kind = "retryable" if e.get("retryable") else "permanent"
        message = indented_lines(e.get("message"), " " * 13 + "| ")
        lines.append(f"  error      {o(e.get('type'))} ({kind}): {message}")
    for h in job.get("history") or []:
        gpu = f"  {float(h['gpuSeconds']):.0f} GPU-s" if isinstance(h.get("gpuSeconds"), int | float) else ""
        lines.append(f"  attempt    {o(h.get('start'))} -> {o(h.get('end') or '…')}  {o(h.get('outcome'))}  "
                     f"on {o(h.get('worker'))}{gpu}")
    if job.get("completedAt"):
        lines.append(f"  completed  {o(job['completedAt'])}")
    profile_id, profile_status = profile.get("_id", job.get("profileId")), profile.get("status", "missing")
    lines.append(f"profile {o(profile_id)}: {o(profile_status)}")
    for key, path in (profile.get("modelPaths") or {}).items():
        lines.append(f"  {o(key):<18} {o(path)}")
    for key, uri in (profile.get("s3Paths") or {}).items():
        lines.append(f"  {o(key):<18} {o(uri)}")
    return "\n".join(lines)


def cmd_status(store: Store, job_id: str, *, as_json: bool, watch_s: float | None = None,
               out: TextIO | None = None, err: TextIO | None = None, sleep=time.sleep) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    while True:
        doc = status_document(store, job_id)
        if doc is None:
            print(f"no job {job_id}", file=err)
            return EXIT_NOT_FOUND
        print(json.dumps(doc) if as_json else render_status(doc), file=out, flush=True)
        job = doc["job"]
        permanent_error = job.get("status") == "error" and not (job.get("error") or {}).get("retryable")
        if not watch_s or job.get("status") in FINAL_STATUSES or permanent_error:
            return EXIT_OK
        sleep(watch_s)
        if not as_json:
            print("", file=out)


def cancel_outcome(job: dict, heartbeat_s: float, now: datetime) -> tuple[int, str]:
    """(EXIT_OK when a cancel request can still change anything, else why not as an exit code; what
    happens next) for this job."""
    job_id, status = job["_id"], job.get("status")
    if status in FINAL_STATUSES:
        return EXIT_NOTHING_TO_DO, f"job {job_id} is already {status}: nothing to cancel"
    error = job.get("error") or {}
    if status == ERROR and not error.get("retryable"):
        return EXIT_NOTHING_TO_DO, (f"job {job_id} already failed permanently ({error.get('type')}): "
                                    "nothing to cancel")
    if committing(job, now):
        return EXIT_TOO_LATE, (f"job {job_id} is committing on {job['lease'].get('owner')} (since "
                               f"{job['progress'].get('updatedAt')}): too late to cancel; it ends "
                               "completed unless the commit fails")
    if status == PROCESSING and lease_live(job, now):
        return EXIT_OK, (f"cancel requested for job {job_id}: the running attempt on {job['lease'].get('owner')} "
                      f"stops at its next heartbeat, within ~{math.ceil(heartbeat_s)} s "
                      "(SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS), and the job ends cancelled")
    if status == PENDING:
        return EXIT_OK, (f"job {job_id} is pending: it will be cancelled when a worker picks it up "
                      "(no training will start)")
    # A retryable error, or processing with a lapsed lease: SQS delivers the message again.
    return EXIT_OK, (f"job {job_id} has no running attempt ({status}, waiting to be retried): it will be "
                  "cancelled when a worker next receives it (no training will start)")


def cmd_cancel(store: Store, job_id: str, *, heartbeat_s: float, out: TextIO | None = None,
               err: TextIO | None = None, now: Callable[[], datetime] | None = None) -> int:
    # Resolved per call, not at import: pytest and wrappers replace sys.stdout after that.
    out, err = out or sys.stdout, err or sys.stderr
    job = store.get_job(job_id)
    if job is None:
        print(f"no job {job_id}", file=err)
        return EXIT_NOT_FOUND
    # The store's clock by default: it stamped the lease this decides on.
    clock = now or store.now
    code, text = cancel_outcome(job, heartbeat_s, clock())
    # request_cancel re-checks inside the store: a job that finished, or began committing, since the
    # read is not touched. Read it again to say which.
    if code == EXIT_OK and not store.request_cancel(job_id):
        code, text = cancel_outcome(store.get_job(job_id) or job, heartbeat_s, clock())
        if code == EXIT_OK:
            code, text = EXIT_NOTHING_TO_DO, f"job {job_id}: the store refused the request: nothing to cancel"
    if code != EXIT_OK:
        print(text, file=err)
        return code
    print(text, file=out)
    return EXIT_OK


def cmd_health(settings: Settings, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    problem = liveness_problem(settings.liveness_file, settings.liveness_age_limit_s)
    if problem:
        print(f"unhealthy: {problem}", file=out)
        return EXIT_FAILED
    print("healthy", file=out)
    return EXIT_OK


# ------------------------------------------------------------ the dead-letter queue

def format_age(age_s: float | None) -> str:
    if age_s is None:
        return "?"
    minutes, _ = divmod(int(age_s), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h" if days else (f"{hours}h{minutes:02d}m" if hours else f"{minutes}m")


def render_letter(summary: dict) -> str:
    # One line per message, whatever the attributes hold: anyone who can send to the queue set them.
    o = one_line
    error = (f"{o(summary['errorType'])}: {o(summary['errorMessage'] or '-')}" if summary["errorType"]
             else "(moved by SQS's redrive policy: no error attributes)")
    return (f"{o(summary['messageId'])}  job {o(summary['jobId'] or '-')}  "
            f"receives {o(summary['receiveCount'])}  age {format_age(summary['ageSeconds'])}  {error}")


def cmd_dlq_list(dlq: DeadLetterQueue, *, as_json: bool, max_messages: int = 1000,
                 out: TextIO | None = None) -> int:
    out = out or sys.stdout
    letters = dlq.peek(max_messages)
    dlq.release(letters)
    now_s = dlq.now_s()
    summaries = sorted((letter.summary(now_s) for letter in letters),
                       key=lambda s: -(s["ageSeconds"] or 0))
    if as_json:
        print(json.dumps(summaries), file=out)
    elif not summaries:
        print(f"the dead-letter queue is empty ({dlq.url})", file=out)
    else:
        print(f"{len(summaries)} message(s) in {dlq.url}, oldest first:", file=out)
        for summary in summaries:
            print(render_letter(summary), file=out)
    return EXIT_OK


@contextmanager
def first_interrupt_stops() -> Iterator[Callable[[], bool]]:
    """Yields "was Ctrl-C pressed?": the first Ctrl-C only asks to stop between messages, a second one
    interrupts at once (KeyboardInterrupt). Outside the main thread signals cannot be caught: never set."""
    # A plain flag, not a threading.Event: the handler runs between any two bytecodes of the main
    # thread, also while that thread holds the Event's lock, and taking it again there deadlocks.
    pressed = [False]
    if threading.current_thread() is not threading.main_thread():
        yield lambda: pressed[0]
        return

    def on_sigint(_signum, _frame):
        # No printing here: the handler can run in the middle of another write to stderr.
        if pressed[0]:
            raise KeyboardInterrupt
        pressed[0] = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: pressed[0]
    finally:
        signal.signal(signal.SIGINT, previous)


class Progress:
    """ "moved 10 of ~42" on stderr every ``every`` messages and at least every ``interval_s``."""

    def __init__(self, err: TextIO, *, every: int = 10, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self._err, self._every, self._interval_s, self._clock = err, every, interval_s, clock
        self._last = clock()

    def __call__(self, moved: int, expected: int) -> None:
        now = self._clock()
        if moved % self._every == 0 or now - self._last >= self._interval_s:
            print(f"moved {moved} of ~{expected}", file=self._err, flush=True)
            self._last = now


def cmd_dlq_redrive(dlq: DeadLetterQueue, *, max_messages: int | None, fallback: bool,
                    out: TextIO | None = None, err: TextIO | None = None,
                    clock: Callable[[], float] = time.monotonic) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    with first_interrupt_stops() as stop:
        result = dlq.redrive(max_messages=max_messages, fallback=fallback,
                             progress=Progress(err, clock=clock), stop=stop)
    if result.method == MOVE_TASK and result.error is None:
        print(f"started a message move task ({result.task_handle}): the dead-letter queue's messages "
              f"go back to {dlq.source_url} in the background; `dlq list` shows what is left", file=out)
        return EXIT_OK
    if result.method == RECEIVE_SEND_DELETE:
        print(f"moved {result.moved} message(s) back to {dlq.source_url} by receive, send, delete "
              f"({result.fallback_reason}); ~{'?' if result.expected is None else result.expected} "
              "were in the dead-letter queue at the start", file=out)
    if result.came_back:
        print(f"  {result.came_back} message(s) this run had moved came back to the dead-letter queue "
              "(dead-lettered again): left there, not moved twice; see `dlq list`", file=out)
    for message_id in result.not_deleted:
        print(f"  {message_id}: sent, but its delete from the dead-letter queue failed: it is in both "
              "queues (the worker acknowledges the duplicate without work)", file=out)
    if result.unsettled:
        print(f"  {result.unsettled}: interrupted between its send and its delete: it may be in both "
              "queues (the worker acknowledges the duplicate without work)", file=out)
    if result.interrupted:
        print(f"redrive interrupted after moving {result.moved} message(s); the rest stay in the "
              "dead-letter queue", file=err)
        return EXIT_INTERRUPTED
    if result.error:
        print(f"redrive stopped: {scrub(result.error)}", file=err)
        return EXIT_FAILED
    return EXIT_OK
