"""`python -m worker logs JOB_ID`: a job's stage logs as the workers shipped them (worker/voice/stage_logs.py).

Read from S3 under the job, so it works wherever the command runs, also after the worker's host is
gone. Every attempt's logs are printed, oldest first, each log under a header naming its attempt and
step; ``--follow`` then prints what is shipped next until the job ends. ``tail_lines`` is the reader
other views use (the web page's log tail).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, TextIO

from worker.ops.commands import EXIT_NOT_FOUND, EXIT_OK, job_over, one_line
from worker.voice.records import Store
from worker.voice.stage_logs import LOG_NAME, Chunk, S3Logs, ShippedLogs

FOLLOW_POLL_S = 2.0
DEFAULT_TAIL_LINES = 50


def shipped_logs(settings: Any, s3: Any) -> S3Logs | None:
    """The deployment's shipped logs (S3_BUCKET, S3_PREFIX), or None without a bucket."""
    if not settings.s3_bucket:
        return None
    return S3Logs(s3, settings.s3_bucket, settings.s3_prefix)


def chosen(chunks: Iterable[Chunk], *, stage: str | None = None, attempt: int | None = None) -> list[Chunk]:
    """The chunks of ``stage``'s logs and of attempt number ``attempt`` (None: any), in reading order."""
    return sorted(c for c in chunks
                  if (stage is None or c.step == stage) and (attempt is None or c.attempt_number == attempt))


def tail_lines(logs: ShippedLogs, job_id: str, count: int = DEFAULT_TAIL_LINES, *,
               stage: str | None = None) -> list[str]:
    """The last ``count`` lines of the job's newest shipped log (of ``stage``, when given), redacted and
    free of terminal controls; [] when none was shipped. Reads only the chunks those lines are in.
    Raises ``worker.voice.stage_logs.LogsUnavailable`` when S3 cannot be read."""
    picked = chosen(logs.chunks(job_id), stage=stage)
    if not picked or count <= 0:
        return []
    newest = picked[-1]
    lines: list[str] = []
    for chunk in reversed([c for c in picked if (c.attempt, c.log_name) == (newest.attempt, newest.log_name)]):
        lines = logs.read_chunk(chunk).splitlines() + lines
        if len(lines) >= count:
            break
    return lines[-count:]


def header(chunk: Chunk) -> str:
    """The line above a log: ``==> attempt 2 (0002-1a2b3c4d) train_full, started 2026-12-02 05:20:42Z <==``."""
    found = LOG_NAME.fullmatch(chunk.log_name)
    started = "?"
    if found:
        started = datetime.strptime(found["stamp"], "%Y%m%dT%H%M%S.%fZ").strftime("%Y-%m-%d %H:%M:%SZ")
    return f"==> attempt {chunk.attempt_number} ({chunk.attempt}) {chunk.step}, started {started} <=="


class LogPrinter:
    """Prints chunks once each, under a header whenever the log changes from the last one printed."""

    def __init__(self, logs: ShippedLogs, out: TextIO):
        self._logs, self._out = logs, out
        self._printed: set[str] = set()
        self._current: tuple[str, str] | None = None
        self._ends_line = True

    def print_new(self, chunks: list[Chunk]) -> int:
        """Print the chunks not printed yet, in order; how many were."""
        new = [c for c in chunks if c.key not in self._printed]
        for chunk in new:
            text = self._logs.read_chunk(chunk)
            if (chunk.attempt, chunk.log_name) != self._current:
                if not self._ends_line:
                    self._out.write("\n")
                self._out.write(("" if self._current is None else "\n") + header(chunk) + "\n")
                self._current = (chunk.attempt, chunk.log_name)
            self._out.write(text)
            self._ends_line = text.endswith("\n") or not text
            self._printed.add(chunk.key)
        if new:
            self._out.flush()
        return len(new)

    def close(self) -> None:
        if not self._ends_line:
            self._out.write("\n")
            self._out.flush()


def cmd_logs(logs: ShippedLogs, store: Store, job_id: str, *, stage: str | None = None, attempt: int | None = None,
             follow: bool = False, out: TextIO | None = None, err: TextIO | None = None,
             sleep: Callable[[float], None] = time.sleep, poll_s: float = FOLLOW_POLL_S) -> int:
    """Print the job's shipped logs (``--follow``: and what ships next, until the job ends)."""
    out, err = out or sys.stdout, err or sys.stderr
    job = store.get_job(job_id)
    printer = LogPrinter(logs, out)
    printed = printer.print_new(chosen(logs.chunks(job_id), stage=stage, attempt=attempt))
    if job is None and not printed:
        print(f"no job {one_line(job_id)}", file=err)
        return EXIT_NOT_FOUND
    if not printed:
        which = "".join([f" of stage {one_line(stage)}" if stage else "",
                         f" of attempt {attempt}" if attempt is not None else ""])
        print(f"no logs{which} shipped for job {one_line(job_id)} yet ({logs.location(job_id)})", file=err,
              flush=True)
    while follow and job is not None and not job_over(job):
        sleep(poll_s)
        job = store.get_job(job_id)
        # Listed after the record was read: what the last attempt shipped before the job ended is in.
        printer.print_new(chosen(logs.chunks(job_id), stage=stage, attempt=attempt))
    printer.close()
    return EXIT_OK
