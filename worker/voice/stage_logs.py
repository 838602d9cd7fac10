"""Stage logs shipped off the host while they are written, and read back from anywhere.

A stage's log (``pipeline.stages.open_step_log``: ``<job dir>/logs/<UTC stamp>-<step>.log``) lives on
the worker's disk, which a spot reclaim takes with it. While an attempt trains, a shipper thread sends
what its steps append to that directory, as immutable numbered chunks::

    <S3_PREFIX>/.logs/<jobId>/<attempt>/<UTC stamp>-<step>.log/<seq, 8 digits>.log

- **Per attempt.** ``<attempt>`` is the attempt directory's name (``pipeline.workdir.attempt_dir_name``:
  number and the start of the claim token), so an attempt writes only below its own prefix: a worker
  that lost its lease can add to its own logs, never change another attempt's. Only the files that
  appeared in ``logs/`` after the attempt began are its own (the job's earlier attempts' stay there).
- **Chunks.** A chunk holds whole lines (a line longer than a chunk is cut), starts where the one
  before ended, and is written once; so a reader that lists the prefix and joins the chunks in order
  has the log up to the last shipment, while the stage is still writing. A chunk that failed is sent
  again with the same number and the same start (at most with more lines), so it can only grow.
- **When.** Every ``interval_s`` when something new is there, at once when ``chunk_bytes`` are waiting,
  and once more when the attempt's training ends (a failure and a stop included), for at most
  ``FINAL_SHIP_BUDGET_S``. The job waits for that last shipment, except after a stop (a shutdown, a
  lease lost, a cancel), which it does not hold up: the shipment then runs beside the release, on the
  shipper's daemon thread, as long as the process lives (a spot stop's budget has no room for it).
- **Off the job's critical path.** A failure to ship is a ``logs.ship_failed`` warning and a retry at
  the next interval, never the job's failure; the final shipment gives up after its budget.
- **Redacted.** What is shipped went through ``worker.core.redact.redact_text`` (no presigned query
  strings, credential-shaped text masked, terminal escapes dropped). The stage environment holds no
  secrets in the first place (``pipeline.stage_env``).

The ``.logs`` directory starts with a dot, so it is never an environment's artifacts prefix. Reading
(``worker.ops.logs``) needs the bucket and the job id only, never the worker's disk. S3 is the one
implementation of ``ShippedLogs``; CloudWatch Logs would be a second one behind the same interface.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from pipeline.workdir import is_attempt_dir, work_layout
from worker.core.aws import aws_error_text
from worker.core.names import SAFE_NAME
from worker.core.redact import redact_text, redact_urls_in_text
from worker.voice.errors import LogsUnavailable

if TYPE_CHECKING:
    from pipeline.remote_work import Ledger
    from pipeline.run import Progress
    from worker.core.stop import StopSignal
    from worker.voice.job import Trainer
    from worker.voice.message import Job

log = structlog.get_logger(__name__)

LOGS_KEY_DIR = ".logs"
# The runner's log names (pipeline.stages.log_file_name); anything else a stage leaves in {log_dir} is its own.
LOG_NAME = re.compile(r"(?P<stamp>[0-9]{8}T[0-9]{6}\.[0-9]{6}Z)-(?P<step>[A-Za-z0-9_.-]{1,128})\.log", re.ASCII)
ATTEMPT_NAME = re.compile(r"(?P<number>[0-9]{1,9})-[A-Za-z0-9]{1,64}", re.ASCII)
_CHUNK_NAME = re.compile(r"(?P<seq>[0-9]{8})\.log", re.ASCII)
_SAFE_NAME = re.compile(SAFE_NAME, re.ASCII)
# A runaway trainer's log is not sent without end: past this many bytes of one log the rest stays on the host.
MAX_SHIPPED_BYTES_PER_LOG = 256 * 1024**2
# The last shipment, after the steps ended: bounded, so a slow S3 never holds the job (or a shutdown) up.
FINAL_SHIP_BUDGET_S = 5.0
_WAKE_S = 1.0


@dataclass(frozen=True)
class LogShippingConfig:
    """Where attempts ship their logs and how often (LOG_SHIP_INTERVAL_SECONDS, LOG_SHIP_CHUNK_KIB)."""

    bucket: str
    prefix: str
    interval_s: float
    chunk_bytes: int


@dataclass(frozen=True, order=True)
class Chunk:
    """One shipped piece of one log: sorts by attempt number, then log (its name starts with its UTC
    time), then sequence."""

    attempt_number: int
    attempt: str
    log_name: str
    seq: int
    key: str = field(compare=False)
    size: int = field(default=0, compare=False)

    @property
    def step(self) -> str:
        found = LOG_NAME.fullmatch(self.log_name)
        return found["step"] if found else "?"


def job_logs_prefix(prefix: str, job_id: str) -> str:
    """``<prefix>/.logs/<jobId>/``: every attempt's shipped logs of the job."""
    return "/".join(part for part in (prefix.strip("/"), LOGS_KEY_DIR, job_id) if part) + "/"


def chunk_key(prefix: str, job_id: str, attempt: str, log_name: str, seq: int) -> str:
    return f"{job_logs_prefix(prefix, job_id)}{attempt}/{log_name}/{seq:08d}.log"


def logs_location(bucket: str, prefix: str, job_id: str) -> str:
    """``s3://<bucket>/<prefix>/.logs/<jobId>/``: where `status` says the job's logs are."""
    return f"s3://{bucket}/{job_logs_prefix(prefix, job_id)}"


def parse_chunk_key(job_prefix: str, key: str, size: int = 0) -> Chunk | None:
    """The chunk a key names below ``job_prefix``, or None for any key not in the layout."""
    if not key.startswith(job_prefix):
        return None
    parts = key[len(job_prefix):].split("/")
    if len(parts) != 3:
        return None
    attempt, log_name, chunk_name = parts
    found_attempt, found_chunk = ATTEMPT_NAME.fullmatch(attempt), _CHUNK_NAME.fullmatch(chunk_name)
    if not (found_attempt and found_chunk and LOG_NAME.fullmatch(log_name)):
        return None
    return Chunk(int(found_attempt["number"]), attempt, log_name, int(found_chunk["seq"]), key, size)


class ShippedLogs(Protocol):
    """Where stage logs are shipped to and read back from: one implementation per service."""

    def put_chunk(self, job_id: str, attempt: str, log_name: str, seq: int, text: str) -> None: ...

    def chunks(self, job_id: str) -> list[Chunk]: ...

    def read_chunk(self, chunk: Chunk) -> str: ...

    def location(self, job_id: str) -> str: ...


class S3Logs:
    """``ShippedLogs`` in S3 under the job (see the module docstring); botocore errors become ``LogsUnavailable``."""

    def __init__(self, s3: Any, bucket: str, prefix: str = ""):
        self._s3, self._bucket, self._prefix = s3, bucket, prefix

    def put_chunk(self, job_id: str, attempt: str, log_name: str, seq: int, text: str) -> None:
        key = chunk_key(self._prefix, job_id, attempt, log_name, seq)
        with _translated(f"ship {log_name} chunk {seq}"):
            self._s3.put_object(Bucket=self._bucket, Key=key, Body=text.encode("utf-8"),
                                ContentType="text/plain; charset=utf-8")

    def chunks(self, job_id: str) -> list[Chunk]:
        if not _SAFE_NAME.fullmatch(job_id):
            return []  # no job has such an id (a message's is a safe name): nothing to list, above all no other prefix
        job_prefix = job_logs_prefix(self._prefix, job_id)
        found: list[Chunk] = []
        with _translated(f"list the logs of job {job_id}"):
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=job_prefix):
                for item in page.get("Contents", []):
                    chunk = parse_chunk_key(job_prefix, item["Key"], int(item.get("Size", 0)))
                    if chunk is not None:
                        found.append(chunk)
        return sorted(found)

    def read_chunk(self, chunk: Chunk) -> str:
        with _translated(f"read {chunk.log_name} chunk {chunk.seq}"):
            body = self._s3.get_object(Bucket=self._bucket, Key=chunk.key)["Body"]
            try:
                data = body.read()
            finally:
                body.close()
        # Written redacted; redacted again on the way out, since anyone with write access to the bucket
        # could have put a chunk there, and a terminal must never act on what it holds.
        return redact_text(data.decode("utf-8", errors="replace"))

    def location(self, job_id: str) -> str:
        return logs_location(self._bucket, self._prefix, job_id)


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise LogsUnavailable(f"could not {what}: {redact_urls_in_text(aws_error_text(exc))}") from exc


@dataclass
class _Shipped:
    """How far one log has been shipped."""

    offset: int = 0
    seq: int = 0
    capped: bool = False


def take_lines(data: bytes, *, final: bool, chunk_bytes: int) -> bytes:
    """What of ``data`` (read from a chunk's start, at most ``chunk_bytes``) the next chunk holds: whole
    lines, or with ``final`` all that is left when it fits; a line longer than a chunk is cut at
    ``chunk_bytes``; nothing while a line is unfinished."""
    data = data[:chunk_bytes]
    if final and len(data) < chunk_bytes:
        return data
    end = data.rfind(b"\n")
    if end >= 0:
        return data[:end + 1]
    return data if len(data) >= chunk_bytes else b""


class AttemptLogShipper:
    """Ships one attempt's new step logs from ``log_dir`` (see the module docstring), on a thread of its own."""

    def __init__(self, logs: ShippedLogs, config: LogShippingConfig, job_id: str, attempt: str, log_dir: Path, *,
                 clock: Callable[[], float] = time.monotonic, wake_s: float = _WAKE_S):
        self._logs, self._config, self._job_id, self._attempt, self._log_dir = logs, config, job_id, attempt, log_dir
        self._clock, self._wake_s = clock, min(wake_s, config.interval_s)
        # The earlier attempts' logs: the job's, not this attempt's to ship.
        self._before = set(self._listed())
        self._shipped: dict[str, _Shipped] = {}
        self._last_s = clock()  # the last shipment, or the start
        self._retry_at_s = 0.0
        self._done = threading.Event()
        self._complete = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"log-ship-{self._attempt}")
        self._thread.start()

    def finish(self, wait_s: float = FINAL_SHIP_BUDGET_S) -> bool:
        """Have the thread ship what is left (for at most ``FINAL_SHIP_BUDGET_S``) and wait for it at
        most ``wait_s``; whether everything got out by then. A shipper never started ships here."""
        self._done.set()
        if self._thread is None:
            self._final()
        else:
            self._thread.join(wait_s)
            if self._thread.is_alive():
                return False  # it goes on alone, within its budget
        return self._complete

    def _run(self) -> None:
        while not self._done.wait(self._wake_s):
            now_s = self._clock()
            if now_s >= self._retry_at_s:
                self._ship_safely(final=False)
        self._final()

    def _final(self) -> None:
        budget_s = FINAL_SHIP_BUDGET_S
        self._complete = self._ship_safely(final=True, deadline_s=self._clock() + budget_s)
        if not self._complete:
            log.warning("logs.ship_incomplete", attempt=self._attempt, budget_s=budget_s,
                        note="the rest of the logs stays on the host")

    def _ship_safely(self, *, final: bool, deadline_s: float | None = None) -> bool:
        try:
            return self.ship(final=final, deadline_s=deadline_s)
        except (LogsUnavailable, OSError) as exc:
            # Never the job's failure: the next interval tries again (the same chunk, from the same start).
            self._retry_at_s = self._clock() + self._config.interval_s
            log.warning("logs.ship_failed", attempt=self._attempt, error=str(exc),
                        retry_in_s=None if final else self._config.interval_s)
            return False

    def ship(self, *, final: bool, deadline_s: float | None = None) -> bool:
        """Ship what is due (everything with ``final``); whether nothing due was left behind."""
        now_s = self._clock()
        due = final or now_s - self._last_s >= self._config.interval_s
        dir_fd = self._open_dir()
        if dir_fd is None:
            return True
        complete = True
        try:
            for name in self._names(dir_fd):
                if name in self._before:
                    continue
                if deadline_s is not None and self._clock() >= deadline_s:
                    return False
                sent, left = self._ship_log(dir_fd, name, self._shipped.setdefault(name, _Shipped()), due=due,
                                            final=final, deadline_s=deadline_s)
                complete = complete and not left
                if sent:
                    self._last_s = now_s
        finally:
            os.close(dir_fd)
        return complete

    def _open_dir(self) -> int | None:
        """The log directory, opened without following a link (a stage knows {log_dir}); None when it is
        absent (the attempt has written no log yet) or not a real directory."""
        try:
            return os.open(self._log_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                return None
            raise

    def _listed(self) -> list[str]:
        dir_fd = self._open_dir()
        if dir_fd is None:
            return []
        try:
            return self._names(dir_fd)
        finally:
            os.close(dir_fd)

    @staticmethod
    def _names(dir_fd: int) -> list[str]:
        with os.scandir(dir_fd) as entries:
            return sorted(entry.name for entry in entries if LOG_NAME.fullmatch(entry.name))

    def _ship_log(self, dir_fd: int, name: str, shipped: _Shipped, *, due: bool, final: bool,
                  deadline_s: float | None) -> tuple[bool, bool]:
        """Ship the log's new lines as chunks: (whether any went out, whether the deadline left some behind)."""
        if shipped.capped:
            return False, False
        # A stage knows {log_dir}: a link planted there is never followed, a non-file never read.
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP):  # gone, or a link: nothing of ours to ship
                return False, False
            raise
        sent = False
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                return False, False
            size = info.st_size
            while shipped.offset < size:
                waiting = size - shipped.offset
                if not (due or waiting >= self._config.chunk_bytes):
                    break
                if deadline_s is not None and self._clock() >= deadline_s:
                    return sent, True
                if shipped.offset >= MAX_SHIPPED_BYTES_PER_LOG:
                    self._logs.put_chunk(self._job_id, self._attempt, name, shipped.seq,
                                         f"[shipper] this log is not shipped beyond {MAX_SHIPPED_BYTES_PER_LOG} "
                                         "bytes; the rest stays on the worker's disk\n")
                    shipped.capped = True
                    return True, False
                handle.seek(shipped.offset)
                data = take_lines(handle.read(self._config.chunk_bytes), final=final,
                                  chunk_bytes=self._config.chunk_bytes)
                if not data:
                    break
                self._logs.put_chunk(self._job_id, self._attempt, name, shipped.seq,
                                     redact_text(data.decode("utf-8", errors="replace")))
                shipped.offset += len(data)
                shipped.seq += 1
                sent = True
        return sent, False


class LogShipping:
    """Makes each attempt's shipper (``shipping``); built once at start-up from the settings."""

    def __init__(self, logs: ShippedLogs, config: LogShippingConfig):
        self.logs, self.config = logs, config

    @contextlib.contextmanager
    def shipping(self, job_id: str, work_dir: Path, stop: StopSignal | None = None) -> Iterator[None]:
        """Ship the attempt's step logs while the block runs, and what is left when it ends (however)."""
        if not is_attempt_dir(work_dir) or not ATTEMPT_NAME.fullmatch(work_dir.name):
            yield  # a lone job directory (tests, benchmarks): no attempt to ship under
            return
        shipper = AttemptLogShipper(self.logs, self.config, job_id, work_dir.name, work_layout(work_dir).logs)
        shipper.start()
        try:
            yield
        finally:
            # A stop (a shutdown within the spot notice's window, say) is not held up: the last shipment
            # goes on beside the release, on the shipper's daemon thread, as far as the process lives.
            stopping = stop is not None and stop.is_set()
            shipper.finish(0.0 if stopping else FINAL_SHIP_BUDGET_S + 1.0)


class ShippingTrainer:
    """A ``worker.voice.job.Trainer`` whose attempts ship their step logs while they train."""

    def __init__(self, train: Trainer, shipping: LogShipping):
        self._train, self._shipping = train, shipping

    def __call__(self, job: Job, work_dir: Path, stop: StopSignal, progress: Progress, ledger: Ledger,
                 /) -> dict[str, Path]:
        with self._shipping.shipping(job.job_id, work_dir, stop):
            return self._train(job, work_dir, stop, progress, ledger)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._train, name)  # forget_remote_work, downloader, ...
