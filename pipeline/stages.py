"""The stage runner: one configured command, run as an argv array in its own process group.

Why it is shaped this way:
- The command never sees a shell, and each placeholder is substituted inside one argv element, so
  job data cannot become syntax.
- ``start_new_session`` puts the stage and everything it spawns in one process group, so a stop or
  a timeout can end all of it: SIGTERM to the group, SIGKILL to whatever is left after the grace.
- Output goes through a pipe that a reader thread copies line by line into a timestamped log (kept
  across retries) while it picks out ``PROGRESS n`` lines. The progress callback runs on the
  caller's thread, so an error it raises (``StaleWrite``) reaches the caller after the stage is
  stopped, never silently in a thread.
- The caller's thread blocks on the stop signal in short slices (``poll_interval_s``) between
  checks of the process and the timeout: a stop is seen at once, nothing spins.
- A failed stage is reported only after its output is in the log, with the log's tail.
- A stage whose manifest verifies is not run again; otherwise its declared outputs (and, unless it
  is resumable, its checkpoint directory) are removed first, so nothing half-written survives.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import structlog

from pipeline.config import StageSpec, render_argv
from pipeline.manifest import manifest_path, manifest_problem, write_manifest
from worker.errors import StageFailed, StageFailedPermanently, TimeLimitExceeded, WorkerError
from worker.stop import StopSignal

log = structlog.get_logger(__name__)

Progress = Callable[[str, float], None]

DEFAULT_GRACE_S = 10.0
TAIL_LINES = 20
_TAIL_MAX_BYTES = 64 * 1024
_LINE_MAX_BYTES = 64 * 1024
_READER_JOIN_S = 5.0
_PROGRESS_LINE = re.compile(rb"^\s*PROGRESS\s+(\d{1,3}(?:\.\d+)?)\s*$")


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

    def checkpoint_dir(self, stage: StageSpec) -> Path:
        return self.checkpoints_root / stage.name

    def placeholder_values(self, stage: StageSpec) -> dict[str, str]:
        return {
            "python": self.python,
            "dataset_dir": str(self.dataset_dir),
            "output_dir": str(self.output_dir),
            "checkpoint_dir": str(self.checkpoint_dir(stage)),
            "log_dir": str(self.log_dir),
            "job_id": self.job_id,
            "language": self.language,
        }


@dataclass(frozen=True)
class StageResult:
    name: str
    skipped: bool
    log_path: Path | None = None


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


def exit_error(stage: StageSpec, code: int, log_name: str, tail: str) -> WorkerError:
    """The typed error for a non-zero exit: permanent only for the codes the config declares."""
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    message = f"stage {stage.name} {how}; last lines of {log_name}:\n{tail}"
    if code in stage.permanent_exit_codes:
        return StageFailedPermanently(message)
    return StageFailed(message)


def tail_lines(path: Path, count: int = TAIL_LINES) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - _TAIL_MAX_BYTES))
        data = handle.read()
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-count:])


def open_step_log(log_dir: Path, step: str, now: datetime | None = None) -> tuple[Path, IO[bytes]]:
    """A new timestamped log for one attempt of one step, opened for appending."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / log_file_name(now or datetime.now(UTC), step)
    return path, open(path, "ab")


def run_stage(
    stage: StageSpec,
    ctx: StageContext,
    stop: StopSignal,
    progress: Progress,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    poll_interval_s: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
) -> StageResult:
    """Run ``stage`` unless its manifest verifies; raises the project's typed errors on failure."""
    manifest = manifest_path(ctx.output_dir, stage.name)
    problem = manifest_problem(manifest, ctx.output_dir, stage.name, stage.fingerprint, stage.outputs)
    if problem is None:
        log.info("stage.skipped", stage=stage.name, why="manifest verifies")
        return StageResult(stage.name, skipped=True)
    stop.raise_if_set()
    log.info("stage.preparing", stage=stage.name, why=problem)
    prepare_rerun(stage, ctx)

    argv = render_argv(stage.argv, ctx.placeholder_values(stage))
    log_path, log_file = open_step_log(ctx.log_dir, stage.name)
    with log_file:
        _log_line(log_file, f"stage {stage.name} starting: argv={argv!r}")
        code = _run_supervised(stage, argv, log_file, stop, progress, grace_s, poll_interval_s, clock)
        _log_line(log_file, f"stage {stage.name} exited with code {code}")
    if code != 0:
        raise exit_error(stage, code, log_path.name, tail_lines(log_path))
    missing = [rel for rel in stage.outputs if not _non_empty_file(ctx.output_dir / rel)]
    if missing:
        raise StageFailed(
            f"stage {stage.name} exited 0 but these outputs are missing or empty: "
            f"{', '.join(missing)}; see {log_path.name}"
        )
    write_manifest(manifest, ctx.output_dir, stage.name, stage.fingerprint, stage.outputs)
    log.info("stage.completed", stage=stage.name, log=log_path.name)
    return StageResult(stage.name, skipped=False, log_path=log_path)


def prepare_rerun(stage: StageSpec, ctx: StageContext) -> None:
    """Remove what an earlier, unverified attempt left, keeping a resumable stage's checkpoints."""
    manifest_path(ctx.output_dir, stage.name).unlink(missing_ok=True)
    for rel in stage.outputs:
        _remove(ctx.output_dir / rel)
    checkpoints = ctx.checkpoint_dir(stage)
    if not stage.resumable:
        _remove(checkpoints)
    checkpoints.mkdir(parents=True, exist_ok=True)
    ctx.output_dir.mkdir(parents=True, exist_ok=True)


def _run_supervised(
    stage: StageSpec,
    argv: list[str],
    log_file: IO[bytes],
    stop: StopSignal,
    progress: Progress,
    grace_s: float,
    poll_interval_s: float,
    clock: Callable[[], float],
) -> int:
    """Run to completion and return the exit code, or end the group and raise on stop/timeout."""
    updates: queue.SimpleQueue[float] = queue.SimpleQueue()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        _log_line(log_file, f"stage {stage.name} could not start: {exc}")
        raise StageFailed(f"stage {stage.name} could not start: {exc.strerror or exc}") from exc
    reader = threading.Thread(
        target=_copy_output, args=(proc.stdout, log_file, updates), daemon=True,
        name=f"stage-{stage.name}-output",
    )
    reader.start()
    last_reported: list[float | None] = [None]
    deadline = clock() + stage.timeout_s if stage.timeout_s is not None else None
    finished = False
    try:
        while proc.poll() is None:
            _report(stage.name, updates, progress, last_reported)
            if stop.is_set():
                _end_group(proc, grace_s)
                _log_line(log_file, f"stage {stage.name} stopped: {stop.reason}")
                stop.raise_if_set()
            remaining_s = None if deadline is None else deadline - clock()
            if remaining_s is not None and remaining_s <= 0:
                _end_group(proc, grace_s)
                _log_line(log_file, f"stage {stage.name} ran past its timeout")
                raise TimeLimitExceeded(
                    f"stage {stage.name} ran past its timeout of {stage.timeout_s:g} s"
                )
            stop.wait(poll_interval_s if remaining_s is None else min(poll_interval_s, remaining_s))
        finished = True
        # Anything the stage left running in its group is a stray that would hold the pipe open.
        if group_has_live_members(proc.pid):
            _end_group(proc, grace_s)
    finally:
        # Also reached when the progress callback raised: the stage must not outlive the attempt.
        if not finished and (proc.poll() is None or group_has_live_members(proc.pid)):
            _end_group(proc, grace_s)
        reader.join(_READER_JOIN_S)
        if reader.is_alive():
            log.warning("stage.output_still_open", stage=stage.name)
        else:
            proc.stdout.close()
    _report(stage.name, updates, progress, last_reported)
    return proc.returncode


def _report(stage_name: str, updates: queue.SimpleQueue, progress: Progress, last: list) -> None:
    latest = None
    while True:
        try:
            latest = updates.get_nowait()
        except queue.Empty:
            break
    if latest is not None and latest != last[0]:
        last[0] = latest
        progress(stage_name, latest)


def _copy_output(pipe: IO[bytes], log_file: IO[bytes], updates: queue.SimpleQueue) -> None:
    # Flushing each line keeps the log complete up to the moment a stage or the worker dies.
    for line in iter(lambda: pipe.readline(_LINE_MAX_BYTES), b""):
        try:
            log_file.write(line)
            log_file.flush()
        except (OSError, ValueError):
            pass
        value = parse_progress(line)
        if value is not None:
            updates.put(value)


def _end_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the stage's process group, then SIGKILL whatever is still alive after the grace."""
    pgid = proc.pid
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        proc.wait(timeout=max(0.0, grace_s))
    except subprocess.TimeoutExpired:
        pass
    # The leader is gone; members may still be finishing. The group id stays ours while any live.
    while time.monotonic() < deadline and group_has_live_members(pgid):
        time.sleep(0.02)
    if proc.poll() is None or group_has_live_members(pgid):
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def group_has_live_members(pgid: int) -> bool:
    """Whether any non-zombie process is in the group (zombies wait for a reaper; they hold nothing)."""
    proc_root = Path("/proc")
    if not proc_root.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return any(len(fields) >= 3 and int(fields[2]) == pgid for _pid, fields in live_processes(proc_root))


def live_processes(proc_root: Path = Path("/proc")) -> Iterator[tuple[int, list[str]]]:
    """(pid, the /proc stat fields after the command name) of every process that is not a zombie."""
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # The command name in parentheses may hold spaces; the fixed fields follow the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields and fields[0] not in ("Z", "X"):
            yield int(entry.name), fields


def _log_line(log_file: IO[bytes], text: str) -> None:
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    log_file.write(f"[runner {stamp}] {text}\n".encode())
    log_file.flush()


def _non_empty_file(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
