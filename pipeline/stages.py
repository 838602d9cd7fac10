"""The stage runner: one configured command, run as an argv array in its own session.

Why it is shaped this way:
- The command never sees a shell, and each placeholder is substituted inside one argv element, so
  job data cannot become syntax.
- The stage gets an explicit, secret-free environment (``pipeline.stage_env``), never the worker's.
- A stop or a timeout ends every process the stage started, also those that left its process group
  (``pipeline.proctree``): SIGTERM, then SIGKILL to whatever is left after the grace.
- The command runs under a stage keeper (``pipeline.stage_keeper``) that ends the stage's whole tree
  when the worker dies, ``kill -9`` included, and exits as the stage did (code or signal).
- Before a step of a job starts, every process of that job still alive on this host (an earlier
  attempt's trainer: the environment's ``VOICE_WORKER_JOB``) is ended, so two trainings of one job
  never run side by side here (``stage.survivor_ended``).
- A step can be started ahead of its turn and supervised later (``start_supervised``; held: its
  stdin is a pipe it waits on for a line) or ended unsupervised (``StartedStage.end``): the job starts
  its dataset child before the downloads, so that the child's start-up overlaps them.
- Output goes through a pipe that a reader thread copies line by line into a timestamped log (kept
  across retries) while it picks out ``PROGRESS n``, ``NOTE`` and ``METRIC step=<n> <name>=<value> ...``
  lines (``parse_metric``: bounded, a malformed line is only logged). The reader can be ended without
  end-of-file, so a process that still holds the pipe never keeps ``run_stage`` waiting. The
  progress callback runs on the caller's thread, so an error it raises (``StaleWrite``) reaches the
  caller after the stage is stopped, never silently in a thread.
- The caller's thread blocks on the keeper's exit itself (a pidfd) in slices of ``poll_interval_s``
  between checks of the stop signal and the timeout: the stage's end is seen at once, a stop or the
  timeout within one slice, nothing spins. Where pidfds are unavailable it blocks on the stop signal
  instead, and the end is seen within one slice.
- A failed stage is reported only after its output is in the log, with the log's tail redacted
  (``worker.core.redact.redact_text``): the message goes to the job record, DLQ attributes, logs and Sentry.
- A stage whose manifest verifies is not run again; otherwise its declared outputs (and, unless it
  is resumable, its checkpoint directory) are removed first, so nothing half-written survives. A run
  that fails (any exit but a verified success, a stop, a full disk) has its declared outputs removed
  too: a file under a declared name exists only beside the manifest that vouches for it.
- The directories the worker removes, creates or writes in for a stage (``checkpoints/<stage>``,
  ``output/``, ``output/.manifests``) are walked from the attempt without following links
  (``pipeline.files.real_directory``): a stage that made one of them a link out of the job gets the
  link removed, never followed, so no outside file is deleted or written.
"""

from __future__ import annotations

import math
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import structlog

from pipeline.config import StageSpec, render_argv
from pipeline.errors import HostCondition, StageFailed, StageFailedPermanently
from pipeline.files import output_problem, real_directory, relative_output, remove_output
from pipeline.manifest import manifest_path, manifest_problem, write_manifest
from pipeline.proctree import (
    ATTEMPT_NAME,
    JOB_NAME,
    TOKEN_NAME,
    StageTree,
    end_job_survivors,
    end_tree,
    env_value,
    job_processes,
    live_processes,  # noqa: F401 - tests/reliability read /proc through it
)
from pipeline.reuse import attempt_order
from pipeline.stage_env import stage_environment
from pipeline.stage_keeper import FAILED, SIGNAL, STARTED, keeper_argv
from worker.core.errors import Stopped, TimeLimitExceeded, WorkerError
from worker.core.redact import redact_text
from worker.core.stop import StopSignal

log = structlog.get_logger(__name__)

Progress = Callable[[str, float], None]

DEFAULT_GRACE_S = 10.0
TAIL_LINES = 20
# How the runner's own lines in a step's log begin (``_log_line``): not the step's output.
RUNNER_MARK = "[runner "
# A failed step's message: its last line, cut to this, heads it; the whole fits the record's error
# message (worker/voice/records/rules.py's ERROR_MESSAGE_MAX_CHARS, 2,000) with room to spare.
LAST_LINE_MAX_CHARS = 300
FAILURE_MESSAGE_MAX_CHARS = 1900
_TAIL_MAX_BYTES = 64 * 1024
_LINE_MAX_BYTES = 64 * 1024
_READER_DRAIN_S = 1.0
_READ_POLL_S = 0.1
# The keeper is a short Python start-up; this bound only matters when it cannot start at all.
_KEEPER_START_S = 30.0
_PROGRESS_LINE = re.compile(rb"^\s*PROGRESS\s+(\d{1,3}(?:\.\d+)?)\s*$")
# ``NOTE <text>``: something a stage that succeeds wants on the job's record (clips it left out, say).
_NOTE_LINE = re.compile(rb"NOTE[ \t]+(\S.*?)\s*", re.DOTALL)
NOTE_MAX_CHARS = 500
# ``METRIC step=<n> <name>=<value> ...`` (docs/trainer.md, "Stage contract"): what a trainer measures
# at a step. Bounded, so that a stage's output can never make the worker keep more than this per line.
METRIC_MAX_PAIRS = 16
METRIC_LINE_MAX_BYTES = 2048
METRIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.]{0,47}")
_METRIC_LINE = re.compile(rb"\s*METRIC[ \t]+step=([0-9]{1,12})((?:[ \t]+[^ \t\r\n=]+=[^ \t\r\n]+){1,%d})\s*"
                          % METRIC_MAX_PAIRS)
# Decimal notation only: Python's float() would also take "1_0" or "infinity" in any case; nan and inf
# are accepted as words so that a trainer's diverged loss is not a malformed line, and then dropped.
_METRIC_VALUE = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,4})?|[-+]?(?:nan|inf)",
                           re.IGNORECASE)


@dataclass(frozen=True)
class StageContext:
    """Where a job's stages read and write, and the values their placeholders take."""

    dataset_dir: Path
    output_dir: Path
    checkpoints_root: Path
    log_dir: Path
    job_id: str
    language: str
    python: str = field(default_factory=lambda: sys.executable)
    trainer_python: str = ""
    # ``{base_model_dir}``: the host's verified copy of the config's [base_model] (pipeline/base_model_cache.py).
    base_model_dir: str = ""
    # The worker passes the one it built at start-up; a context made without one (tests, benchmarks)
    # still gets only the built-in allow-list, never this process's whole environment.
    env: Mapping[str, str] = field(default_factory=lambda: stage_environment(os.environ), repr=False)

    def job_mark(self) -> str:
        """What marks this job's processes on the host (``JOB_NAME``): the pipeline sets the job's work
        directory in ``env``; a context made without one (tests, benchmarks) uses the directory above
        its output, never a bare job id another work root may share."""
        return self.env.get(JOB_NAME) or str(self.output_dir.parent.resolve())

    def checkpoint_dir(self, stage: StageSpec) -> Path:
        return self.checkpoints_root / stage.name

    def placeholder_values(self, stage: StageSpec) -> dict[str, str]:
        return {
            "python": self.python,
            "trainer_python": self.trainer_python,
            "dataset_dir": str(self.dataset_dir),
            "output_dir": str(self.output_dir),
            "checkpoint_dir": str(self.checkpoint_dir(stage)),
            "log_dir": str(self.log_dir),
            "job_id": self.job_id,
            "language": self.language,
            "base_model_dir": self.base_model_dir,
            # Validated at load: a stage that uses {device} declares one.
            "device": stage.device or "",
        }


@dataclass(frozen=True)
class StageResult:
    name: str
    skipped: bool
    log_path: Path | None = None


def parse_note(line: bytes) -> str | None:
    """The text of a ``NOTE <text>`` line (printable, at most ``NOTE_MAX_CHARS``), or None for any other line."""
    match = _NOTE_LINE.fullmatch(line)
    if not match:
        return None
    text = "".join(ch if ch.isprintable() else " " for ch in match.group(1).decode("utf-8", "replace"))
    return text[:NOTE_MAX_CHARS]


class Note(str):
    """A stage's ``NOTE`` text on its way from the output reader to the job's progress object."""


@dataclass(frozen=True)
class Metric:
    """A stage's ``METRIC`` line: its step and the finite values it named (at least one)."""

    step: int
    values: Mapping[str, float]


def parse_metric(line: bytes) -> Metric | None:
    """A ``METRIC step=<n> <name>=<value> ...`` line's step and finite values, or None for any other
    line, a malformed one (a bad name or number, too long, more than ``METRIC_MAX_PAIRS`` pairs) or
    one whose every value is NaN or infinite. A name given twice keeps its last value."""
    if len(line) > METRIC_LINE_MAX_BYTES or b"METRIC" not in line[:64]:
        return None
    match = _METRIC_LINE.fullmatch(line)
    if not match:
        return None
    values: dict[str, float] = {}
    for pair in match.group(2).decode("ascii", "replace").split():
        name, _, text = pair.partition("=")
        if not METRIC_NAME.fullmatch(name) or not _METRIC_VALUE.fullmatch(text):
            return None
        value = float(text)  # 1e999 overflows to inf: dropped below with NaN
        if math.isfinite(value):
            values[name] = value
    return Metric(int(match.group(1)), values) if values else None


def parse_progress(line: bytes) -> float | None:
    """The percent of a ``PROGRESS n`` line (0..100), or None for any other line."""
    match = _PROGRESS_LINE.match(line)
    if not match:
        return None
    value = float(match.group(1))
    return value if 0.0 <= value <= 100.0 else None


def log_file_name(now: datetime, step: str) -> str:
    """``<UTC timestamp>-<step>.log``; microseconds keep two quick attempts from sharing a file."""
    return f"{now.astimezone(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}-{step}.log"


# A trainer's "the device is not there" (docs/trainer.md): at start, or lost mid-run. The host's fault.
EXIT_DEVICE_LOST = 70


def exit_error(stage: StageSpec, code: int, log_name: str, tail: str) -> WorkerError:
    """The typed error for a non-zero exit: permanent only for the codes the config declares.

    The tail is redacted here, since the message leaves the worker: record, DLQ, logs, Sentry.
    """
    message = failure_message(f"stage {stage.name} {how_it_ended(code)}", log_name, tail)
    if code in stage.permanent_exit_codes:
        return StageFailedPermanently(message)
    if code == EXIT_DEVICE_LOST:
        return HostCondition(message)
    return StageFailed(message)


def how_it_ended(code: int) -> str:
    """A process's end in words, from its return code (negative: the signal that killed it)."""
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def failure_message(what: str, log_name: str, tail: str) -> str:
    """``<what>: <the step's last line>``, then its last lines: the first line, which one-line views
    (``jobs``, ``dlq list``, events) show, is the failure's own, never the argv. Redacted here, since
    the message leaves the worker; the block keeps the newest lines that fit the record."""
    lines = redact_text(tail).splitlines()
    if not lines:
        return f"{what}, printing nothing; see {log_name}"
    head = f"{what}: {lines[-1][:LAST_LINE_MAX_CHARS]}\nlast lines of {log_name}:"
    kept: list[str] = []
    room = FAILURE_MESSAGE_MAX_CHARS - len(head)
    for line in reversed(lines):
        room -= len(line) + 1
        if room < 0:
            break
        kept.insert(0, line)
    return "\n".join([head, *kept])


def tail_lines(path: Path, count: int = TAIL_LINES) -> str:
    """The last ``count`` non-empty lines the step itself wrote to its log: the runner's own lines (the
    argv it started, how it ended) stay in the log, out of the failure's message."""
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - _TAIL_MAX_BYTES))
        data = handle.read()
    lines = [line for line in data.decode("utf-8", errors="replace").splitlines()
             if line.strip() and not line.startswith(RUNNER_MARK)]
    return "\n".join(lines[-count:])


def open_step_log(log_dir: Path, step: str, now: datetime | None = None) -> tuple[Path, IO[bytes]]:
    """A new timestamped log for one attempt of one step, opened for appending.

    A stage knows ``{log_dir}`` and could replace it with a link out of the job: the directory is made
    real first (the link unlinked, never followed) and the file opened without following a link.
    """
    log_dir = real_directory(Path(log_dir).parent, Path(log_dir).name)
    path = log_dir / log_file_name(now or datetime.now(UTC), step)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    return path, os.fdopen(fd, "ab")


def run_stage(
    stage: StageSpec,
    ctx: StageContext,
    stop: StopSignal,
    progress: Progress,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    poll_interval_s: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    manifests: ManifestWriter | None = None,
    while_running: Callable[[], AbstractContextManager[object]] | None = None,
) -> StageResult:
    """Run ``stage`` unless its manifest verifies; raises the project's typed errors on failure.

    With ``manifests`` the stage's manifest is written in the background (``ManifestWriter``).
    ``while_running`` is entered while the stage's processes run, only when they do (not for a skipped
    stage): the pipeline mirrors a resumable stage's checkpoints to S3 from there.
    """
    manifest = manifest_path(ctx.output_dir, stage.name)
    problem = manifest_problem(manifest, ctx.output_dir, stage.name, stage.fingerprint, stage.outputs)
    if problem is None:
        log.info("stage.skipped", stage=stage.name, why="manifest verifies")
        return StageResult(stage.name, skipped=True)
    stop.raise_if_set()
    log.info("stage.preparing", stage=stage.name, why=problem)
    prepare_rerun(stage, ctx)
    try:
        return _run_prepared(stage, ctx, manifest, stop, progress, grace_s, poll_interval_s, clock, manifests,
                             while_running)
    except BaseException:
        # Whatever the stage wrote in place may be a part (disk full, killed mid-write): no file under
        # a declared name without its manifest, and the space goes back for the retry.
        discard_outputs(stage, ctx)
        raise


def _run_prepared(stage: StageSpec, ctx: StageContext, manifest: Path, stop: StopSignal, progress: Progress,
                  grace_s: float, poll_interval_s: float, clock: Callable[[], float],
                  manifests: ManifestWriter | None = None,
                  while_running: Callable[[], AbstractContextManager[object]] | None = None) -> StageResult:
    argv = render_argv(stage.argv, ctx.placeholder_values(stage))
    started_s = time.monotonic()
    log_path, log_file = open_step_log(ctx.log_dir, stage.name)
    with log_file, (while_running() if while_running is not None else nullcontext()):
        _log_line(log_file, f"stage {stage.name} starting: argv={argv!r}")
        code = run_supervised(
            stage, argv, {**ctx.env, JOB_NAME: ctx.job_mark()}, log_file, stop, progress, grace_s,
            poll_interval_s, clock,
        )
        _log_line(log_file, f"stage {stage.name} exited with code {code}")
    if code != 0:
        raise exit_error(stage, code, log_path.name, tail_lines(log_path))
    problems = [f"{rel} ({problem})" for rel in stage.outputs
                if (problem := output_problem(ctx.output_dir, rel))]
    if problems:
        raise StageFailed(
            f"stage {stage.name} exited 0 but these outputs are not regular non-empty files inside "
            f"the output directory: {', '.join(problems)}; see {log_path.name}"
        )
    # The stage may have made output/.manifests a link: the manifest is written into a real directory.
    real_directory(ctx.output_dir.parent, relative_output(ctx.output_dir.parent, manifest.parent))
    if manifests is None:
        write_manifest(manifest, ctx.output_dir, stage.name, stage.fingerprint, stage.outputs)
    else:
        manifests.submit(stage, ctx, manifest)
    log.info("stage.completed", stage=stage.name, log=log_path.name,
             duration_s=round(time.monotonic() - started_s, 3))
    return StageResult(stage.name, skipped=False, log_path=log_path)


class ManifestWriter:
    """Writes stage manifests on a thread of its own, so that hashing one stage's outputs (seconds for
    a model of some GiB) overlaps the next stage instead of delaying it.

    A stage's manifest is what lets a later attempt skip it and what the uploads take each file's
    digest from, so ``wait`` must return before either is needed: the pipeline calls it after the last
    stage. A manifest that could not be written (a full disk) fails the job as it would have at the
    stage itself, with that stage's outputs removed; it is raised by the next ``check`` (before each
    stage starts) or by ``wait``. A later stage that changes an earlier stage's output while it is
    hashed is caught as before: the hash's identity check sees the change, so the file's identity is
    not recorded and the upload hashes it again and finds it differs from the manifest.

    concurrent.futures rather than a thread of our own: one worker, results and errors carried back.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-manifest")
        # Tasks that follow a manifest (mirroring the stage's outputs to S3): a thread of their own, so
        # an upload never holds up a manifest, nor a stop that waits for the manifests.
        self._after = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-after-manifest")
        self._pending: list[tuple[Future, StageSpec, StageContext]] = []

    def submit(self, stage: StageSpec, ctx: StageContext, manifest: Path) -> None:
        future = self._pool.submit(write_manifest, manifest, ctx.output_dir, stage.name, stage.fingerprint,
                                   stage.outputs)
        self._pending.append((future, stage, ctx))

    def then(self, task: Callable[[], None]) -> None:
        """Run ``task`` once the manifest submitted last is written (not if it failed); best effort:
        ``close`` does not wait for it. It must not raise."""
        last = self._pending[-1][0] if self._pending else None

        def after_manifest() -> None:
            if last is not None and last.exception() is not None:
                return
            task()

        self._after.submit(after_manifest)

    def check(self) -> None:
        """Raise the error of a manifest write that already failed; never waits."""
        self._settle(only_done=True)

    def wait(self) -> None:
        """Wait for every manifest; raise the first failure (its stage's outputs removed)."""
        self._settle(only_done=False)

    def close(self) -> None:
        """Let every manifest write finish (a bounded hash each: a finished stage keeps its manifest for
        the retry); cancel the tasks that follow them and do not wait for one under way. Errors are not
        raised here (``wait`` raises them)."""
        self._pool.shutdown(wait=True)
        self._after.shutdown(wait=False, cancel_futures=True)

    def _settle(self, *, only_done: bool) -> None:
        while self._pending:
            future, stage, ctx = self._pending[0]
            if only_done and not future.done():
                return
            self._pending.pop(0)
            try:
                future.result()
            except BaseException:
                discard_outputs(stage, ctx)
                raise


def prepare_rerun(stage: StageSpec, ctx: StageContext) -> None:
    """Remove what an earlier, unverified attempt left, keeping a resumable stage's checkpoints."""
    manifest = manifest_path(ctx.output_dir, stage.name)
    remove_output(ctx.output_dir, manifest.relative_to(ctx.output_dir).as_posix())
    for rel in stage.outputs:
        remove_output(ctx.output_dir, rel)  # a link on the way is removed, never followed
    # Walked from the attempt directory without following links: an earlier stage may have made
    # checkpoints/, checkpoints/<stage> or output/ a link out of the job, and a removal or a mkdir
    # through it would act on outside files. Such a link is removed itself, and the directory handed
    # to the stage is a real one.
    root = ctx.checkpoints_root
    real_directory(root.parent, f"{root.name}/{stage.name}", empty=not stage.resumable)
    real_directory(ctx.output_dir.parent, ctx.output_dir.name)


def discard_outputs(stage: StageSpec, ctx: StageContext) -> None:
    """Remove a failed run's declared outputs, as far as the file system lets us (it may be read-only
    or gone: the retry's ``prepare_rerun`` removes them then, and without a manifest none is trusted)."""
    for rel in stage.outputs:
        try:
            remove_output(ctx.output_dir, rel)  # a link on the way is removed, never followed
        except OSError as exc:
            log.warning("stage.output_not_removed", stage=stage.name, output=rel, error=exc.strerror or str(exc))


def run_supervised(
    stage: StageSpec,
    argv: list[str],
    env: Mapping[str, str],
    log_file: IO[bytes],
    stop: StopSignal,
    progress: Progress,
    grace_s: float = DEFAULT_GRACE_S,
    poll_interval_s: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run to completion and return the exit code, or end the stage's processes and raise on stop/timeout.

    ``env`` carrying ``VOICE_WORKER_JOB`` first ends that job's surviving processes on this host.
    The keeper is started by the calling thread; see ``pipeline.stage_keeper`` for why that matters
    (the worker calls this from its main thread).
    """
    return start_supervised(stage, argv, env, log_file, grace_s).supervise(stop, progress, poll_interval_s, clock)


def start_supervised(
    stage: StageSpec,
    argv: list[str],
    env: Mapping[str, str],
    log_file: IO[bytes],
    grace_s: float = DEFAULT_GRACE_S,
    *,
    held: bool = False,
) -> StartedStage:
    """Start the stage under its keeper and return at once; ``supervise`` then runs it to its end.

    As ``run_supervised``: the survivors of the job are ended first, and the calling thread should be
    the one that supervises (the worker's main thread). ``held``: the stage's stdin is a pipe on which
    ``supervise`` writes one line before it waits (the dataset child imports its libraries, then waits
    for that line); otherwise its stdin is /dev/null.
    """
    token = uuid.uuid4().hex
    if env.get(JOB_NAME):
        _end_survivors(stage, env, log_file, grace_s)
    # The worker's end of the lifeline is not inheritable: only the keeper's end leaves this process.
    # The same goes for the held stage's stdin: the worker keeps only the write end.
    lifeline, keeper_end = socket.socketpair()
    stdin_read, go = os.pipe() if held else (subprocess.DEVNULL, None)
    try:
        proc = subprocess.Popen(
            keeper_argv(sys.executable, os.getpid(), keeper_end.fileno(), grace_s, argv),
            stdin=stdin_read,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**env, TOKEN_NAME: token},
            pass_fds=(keeper_end.fileno(),),
        )
    except OSError as exc:
        lifeline.close()
        if go is not None:
            os.close(go)
        _log_line(log_file, f"stage {stage.name} could not start: {exc}")
        raise StageFailed(f"stage {stage.name} could not start: {exc.strerror or exc}") from exc
    finally:
        keeper_end.close()
        if go is not None:
            os.close(stdin_read)
    return StartedStage(stage, proc, token, log_file, lifeline, grace_s, go)


class StartedStage:
    """A stage running under its keeper that nobody waits on yet: ``supervise`` runs it to its end,
    ``end`` ends it unsupervised (a step started ahead of its turn whose turn does not come)."""

    def __init__(self, stage: StageSpec, proc: subprocess.Popen, token: str, log_file: IO[bytes],
                 lifeline: socket.socket, grace_s: float, go: int | None):
        assert proc.stdout is not None  # started with stdout=PIPE
        self._stage, self._proc, self._log_file, self._lifeline, self._grace_s = (
            stage, proc, log_file, lifeline, grace_s)
        self._go = go
        self._tree = StageTree(pgid=proc.pid, token=token, pipe_inode=os.fstat(proc.stdout.fileno()).st_ino)
        self._updates: queue.SimpleQueue[float] = queue.SimpleQueue()
        self._reader = OutputReader(proc.stdout, log_file, self._updates, name=f"stage-{stage.name}-output")
        self._over = False

    def supervise(self, stop: StopSignal, progress: Progress, poll_interval_s: float = 0.1,
                  clock: Callable[[], float] = time.monotonic) -> int:
        """The exit code once the stage ends; on stop or timeout its processes are ended and it raises."""
        if self._over:
            raise RuntimeError(f"stage {self._stage.name} was already supervised or ended")
        self._over = True
        try:
            self._close_stdin(b"go\n")
            return _supervise(self._stage, self._proc, self._tree, self._reader, self._log_file, stop, progress,
                              self._updates, self._lifeline, self._grace_s, poll_interval_s, clock)
        finally:
            self._lifeline.close()  # the keeper is gone by now; if not, this tells it to end the stage

    def end(self) -> None:
        """End the stage and every process it started, unless it was supervised already; idempotent."""
        if self._over:
            return
        self._over = True
        try:
            self._close_stdin()  # end-of-file alone: a held stage exits by itself
            if self._proc.poll() is None or self._tree.members():
                end_tree(self._proc, self._tree, self._grace_s)
            if not self._reader.finish(_READER_DRAIN_S):
                log.warning("stage.output_still_open", stage=self._stage.name)
        finally:
            self._lifeline.close()

    def _close_stdin(self, line: bytes = b"") -> None:
        """Write ``line`` to a held stage's stdin, then close it; nothing for a stage that is not held."""
        if self._go is None:
            return
        try:
            if line:
                os.write(self._go, line)
        except OSError:
            pass  # it has exited already: supervising it tells how
        finally:
            os.close(self._go)
            self._go = None


def end_survivors(job_mark: str, grace_s: float, step: str | None = None, attempt: str = "") -> set[int]:
    """End the job's processes still alive on this host; ``StageFailed`` when some will not end.

    A process of a newer attempt than ``attempt`` is never ended: its presence means this attempt is
    the stale one, and it stops here instead (``StageFailed``; its fenced writes are refused anyway).
    """
    def newer(pid: int) -> bool:
        return bool(attempt) and is_newer_attempt(env_value(Path("/proc"), pid, ATTEMPT_NAME), attempt)

    running = sorted(pid for pid in job_processes(job_mark) if newer(pid))
    if running:
        raise StageFailed(f"{step or 'the job'} not started: a newer attempt of this job runs on this "
                          f"host (processes {running}); this attempt is stale")
    try:
        # Spared here too: a newer attempt's process that appeared after the check above.
        ended = end_job_survivors(job_mark, grace_s, spare=newer)
    except OSError as exc:
        raise StageFailed(f"{step or 'the job'} not started: {exc}") from exc
    if ended:
        log.warning("stage.survivor_ended", stage=step, pids=sorted(ended),
                    note="processes of an earlier attempt of this job were still running on this host")
    return ended


def is_newer_attempt(theirs: str | None, ours: str) -> bool:
    """Whether a process's attempt name is a later attempt than ours (unknown: not newer)."""
    return bool(theirs and attempt_order(theirs) > attempt_order(ours))


def _end_survivors(stage: StageSpec, env: Mapping[str, str], log_file: IO[bytes], grace_s: float) -> None:
    try:
        ended = end_survivors(env[JOB_NAME], grace_s, f"stage {stage.name}", env.get(ATTEMPT_NAME, ""))
    except StageFailed as exc:
        _log_line(log_file, str(exc))
        raise
    if ended:
        _log_line(log_file, f"ended processes {sorted(ended)} left by an earlier attempt of this job")


def _await_keeper(proc: subprocess.Popen, lifeline: socket.socket) -> str | None:
    """None once the keeper says the stage started, else why it did not."""
    poller = select.poll()  # not select: the socket's descriptor may be above select's 1024
    poller.register(lifeline, select.POLLIN)
    ready = poller.poll(_KEEPER_START_S * 1000)
    reply = lifeline.recv(4096) if ready else b""
    if reply.startswith(STARTED):
        return None
    if reply.startswith(FAILED):
        return reply[len(FAILED):].decode(errors="replace").strip()
    if not ready:
        proc.kill()
        return f"its keeper did not start within {_KEEPER_START_S:g} s"
    return f"its keeper ended first ({how_it_ended(proc.wait())})"


def _supervise(
    stage: StageSpec,
    proc: subprocess.Popen,
    tree: StageTree,
    reader: OutputReader,
    log_file: IO[bytes],
    stop: StopSignal,
    progress: Progress,
    updates: queue.SimpleQueue,
    lifeline: socket.socket,
    grace_s: float,
    poll_interval_s: float,
    clock: Callable[[], float],
) -> int:
    problem = _await_keeper(proc, lifeline)
    if problem is not None:
        proc.wait()
        reader.finish(_READER_DRAIN_S)
        _log_line(log_file, f"stage {stage.name} could not start: {problem}")
        raise StageFailed(f"stage {stage.name} could not start: {problem}")
    last_reported: list[float | None] = [None]
    deadline = clock() + stage.timeout_s if stage.timeout_s is not None else None
    finished = False
    # A stage started once the shutdown was announced has done nothing worth a checkpoint yet, and
    # may not have its handler in place: it is not signalled (the grace's end stops it as any stage).
    checkpoint_asked = stage.checkpoint_signal is None or stop.forewarned()
    checkpoint_sent = False
    exited = _exit_fd(proc)
    try:
        while proc.poll() is None:
            _report(stage.name, updates, progress, last_reported)
            if not checkpoint_asked and stop.forewarned() and not stop.is_set():
                checkpoint_asked = True
                checkpoint_sent = _ask_checkpoint(stage, lifeline, log_file)
            if stop.is_set():
                _stop_stage(stage, proc, tree, grace_s, str(stop.reason))
                _log_line(log_file, f"stage {stage.name} stopped: {stop.reason}")
                stop.raise_if_set()
            remaining_s = None if deadline is None else deadline - clock()
            if remaining_s is not None and remaining_s <= 0:
                _stop_stage(stage, proc, tree, grace_s, "timeout")
                _log_line(log_file, f"stage {stage.name} ran past its timeout")
                raise TimeLimitExceeded(
                    f"stage {stage.name} ran past its timeout of {stage.timeout_s:g} s"
                )
            _wait_for_exit(exited, stop,
                           poll_interval_s if remaining_s is None else min(poll_interval_s, remaining_s))
        finished = True
        # Whatever the stage left running is a stray that holds the pipe, a GPU, or both.
        if tree.members():
            end_tree(proc, tree, grace_s)
    finally:
        if exited is not None:
            os.close(exited)
        # Also reached when the progress callback raised: the stage must not outlive the attempt.
        if not finished and (proc.poll() is None or tree.members()):
            end_tree(proc, tree, grace_s)
        if not reader.finish(_READER_DRAIN_S):
            log.warning("stage.output_still_open", stage=stage.name)
    _report(stage.name, updates, progress, last_reported, final=True)
    if checkpoint_sent and stage.checkpoint_signal is not None and proc.returncode == -stage.checkpoint_signal:
        # Killed by the signal meant to save its work (no handler yet, or a launcher that does not pass
        # it on): the shutdown ended this attempt, not a fault of the job, so no retry is spent.
        log.warning("stage.killed_by_checkpoint_signal", stage=stage.name, signal=stage.checkpoint_signal.name,
                    note="install the handler first thing in the trainer, and have launchers pass the signal on")
        _log_line(log_file, f"stage {stage.name} was killed by its checkpoint signal "
                            f"{stage.checkpoint_signal.name}: it does not handle it")
        raise Stopped(Stopped.SHUTDOWN, f"stage {stage.name} was killed by its checkpoint signal")
    return proc.returncode


def _stop_stage(stage: StageSpec, proc: subprocess.Popen, tree: StageTree, grace_s: float, why: str) -> None:
    """End the stage's processes, saying so: SIGTERM, then SIGKILL to what outlives the grace."""
    log.info("stage.stopping", stage=stage.name, why=why, grace_s=grace_s)
    # Killed by us, or by its keeper (which got our SIGTERM too and ends the stage on the same grace,
    # then exits as the stage did: by SIGKILL).
    if end_tree(proc, tree, grace_s) or proc.returncode == -signal.SIGKILL:
        log.warning("stage.killed", stage=stage.name, why=why,
                    note=f"processes outlived the {grace_s:g} s grace after SIGTERM: SIGKILL")


def _ask_checkpoint(stage: StageSpec, lifeline: socket.socket, log_file: IO[bytes]) -> bool:
    """Have the keeper send the stage's own process its checkpoint signal (a shutdown has begun);
    whether the request went out."""
    assert stage.checkpoint_signal is not None
    name = stage.checkpoint_signal.name
    try:
        lifeline.sendall(SIGNAL + str(int(stage.checkpoint_signal)).encode() + b"\n")
    except OSError:
        return False  # the keeper has exited: the stage has ended, and its exit is what counts
    _log_line(log_file, f"stage {stage.name} asked to checkpoint ({name}): a shutdown has begun")
    log.info("stage.checkpoint_requested", stage=stage.name, signal=name)
    return True


def _exit_fd(proc: subprocess.Popen) -> int | None:
    """A descriptor that becomes readable when the keeper exits, or None where the kernel has none.

    Opened before ``proc`` is reaped, so the pid is still the keeper's and cannot name another process.
    """
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # before Linux 5.3, or refused by a seccomp filter
        return None


def _wait_for_exit(exited: int | None, stop: StopSignal, timeout_s: float) -> None:
    """Block until the keeper exits or ``timeout_s`` passes; without a pidfd, until a stop or the timeout."""
    if exited is None:
        stop.wait(timeout_s)
    else:
        # poll, not select: a worker with many descriptors open may get a pidfd above select's 1024.
        poller = select.poll()
        poller.register(exited, select.POLLIN)
        poller.poll(max(0.0, timeout_s) * 1000)


def _report(stage_name: str, updates: queue.SimpleQueue, progress: Progress, last: list, *,
            final: bool = False) -> None:
    latest = None
    while True:
        try:
            update = updates.get_nowait()
        except queue.Empty:
            break
        if isinstance(update, Note):
            log.info("stage.note", stage=stage_name, note=str(update))
            # A progress callback that keeps notes (the job's: its record) takes them; a plain one does not.
            note = getattr(progress, "note", None)
            if note is not None:
                note(stage_name, str(update))
        elif isinstance(update, Metric):
            # Likewise metrics: the job's callback keeps a series of each on the record.
            metric = getattr(progress, "metric", None)
            if metric is not None:
                metric(stage_name, update.step, update.values)
        else:
            latest = update
    if latest is not None and latest != last[0]:
        last[0] = latest
        progress(stage_name, latest)
    # Called on every pass of the supervising loop, so a callback that writes or logs at an interval
    # (the job's) does so on time also while the stage prints nothing; once the stage has exited
    # (``final``), what such a callback still holds back is written: a failed stage's last metrics too.
    tick = getattr(progress, "flush" if final else "tick", None)
    if tick is not None:
        tick()


class OutputReader:
    """Copies a stage's output into its log line by line, noting ``PROGRESS``, ``NOTE`` and ``METRIC``
    lines on the way.

    It reads with a timeout rather than until end-of-file alone, so ``finish`` can end it even when
    some process we could not kill still holds the pipe's write end.
    """

    def __init__(self, pipe: IO[bytes], log_file: IO[bytes], updates: queue.SimpleQueue, *, name: str):
        self._pipe, self._log, self._updates = pipe, log_file, updates
        self._finish_by: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def finish(self, drain_s: float) -> bool:
        """Read what is already buffered (at most ``drain_s``), then stop and close the pipe.

        False when the thread did not end in time; the pipe is then left open, since closing a
        descriptor another thread still reads could hand its number to an unrelated file.
        """
        self._finish_by = time.monotonic() + drain_s
        self._thread.join(drain_s + 2 * _READ_POLL_S)
        if self._thread.is_alive():
            return False
        self._pipe.close()
        return True

    def _run(self) -> None:
        fd = self._pipe.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        pending = b""
        while True:
            ready = poller.poll(_READ_POLL_S * 1000)
            finish_by = self._finish_by
            if finish_by is not None and (not ready or time.monotonic() >= finish_by):
                break
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            pending = self._write_lines(pending + chunk)
        if pending:
            self._write_line(pending)

    def _write_lines(self, data: bytes) -> bytes:
        """Write every complete line (and over-long fragments); return the incomplete rest."""
        *lines, rest = data.split(b"\n")
        for line in lines:
            self._write_line(line + b"\n")
        while len(rest) >= _LINE_MAX_BYTES:
            self._write_line(rest[:_LINE_MAX_BYTES])
            rest = rest[_LINE_MAX_BYTES:]
        return rest

    def _write_line(self, line: bytes) -> None:
        # Flushing each line keeps the log complete up to the moment a stage or the worker dies.
        try:
            self._log.write(line)
            self._log.flush()
        except (OSError, ValueError):
            pass
        value = parse_progress(line)
        if value is not None:
            self._updates.put(value)
        elif (text := parse_note(line)) is not None:
            self._updates.put(Note(text))
        elif (metric := parse_metric(line)) is not None:
            self._updates.put(metric)


def _log_line(log_file: IO[bytes], text: str) -> None:
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    log_file.write(f"{RUNNER_MARK}{stamp}] {text}\n".encode())
    log_file.flush()
