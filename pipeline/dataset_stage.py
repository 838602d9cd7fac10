"""The dataset step as a child process: ``python -m pipeline.dataset_stage [--held] REQUEST RESULT``.

Decoding and resampling need numpy, libsndfile and soxr. Run in the worker they would stay in its memory
for good (some 18 MiB an idle worker never uses again), and a decoder crash would take the worker
with it. So the worker runs the step like a training stage: its own session, the stages' secret-free
environment, the stage runner's stop, grace and log (``pipeline.stages.run_supervised``); the worker
never imports ``pipeline.audio``.

The two sides talk through two small JSON files in the job's work directory:

    REQUEST  {"recordings": [[audio path, text], ...], "dataset_dir": ..., "limits": {...}}
             (the limits are ``JobLimits``: the job's audio caps and DATASET_WORKERS)
    RESULT   {"notes": [...]}                     the dataset is complete (exit 0)
             {"bad_recording": "why"}             a recording is unusable: permanent (exit 3)
             (none)                               the disk is full (exit 4): a retryable
                                                  StageFailed that says so, since neither this
                                                  file nor the log can be written then

Any other exit (a crash, a kill) is a retryable ``StageFailed`` with the log's tail, like a stage.
A dataset that is already complete is recognised without starting the child.

The worker starts the child ``--held`` (``start_dataset_child``): it imports numpy, soundfile and soxr,
then waits for a line on its stdin before it reads REQUEST. The job starts it before its downloads,
so that its start-up (some 0.1 s) overlaps them, and ends it if they fail or the job is stopped; it is
a stage under its keeper from the start (its own session, the job's marks, the keeper's death signal
and lifeline). End-of-file without that line: it exits 0 having done nothing.
"""

from __future__ import annotations

import errno
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING

from pipeline.dataset import DatasetResult, build_dataset, dataset_is_complete
from pipeline.errors import BadRecording, HostCondition, StageFailed
from pipeline.limits import JobLimits
from pipeline.manifest import atomic_write_bytes
from worker.core.stop import StopSignal

if TYPE_CHECKING:
    from pipeline.stages import StartedStage

STEP = "dataset"
EXIT_BAD_RECORDING = 3
EXIT_DISK_FULL = 4
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
REQUEST_NAME = "dataset-request.json"
RESULT_NAME = "dataset-result.json"
HELD = "--held"
HELD_LINE = "libraries loaded; waiting for the downloads"


class DatasetChild:
    """The dataset child, started and held until its step comes (``run_dataset_stage``)."""

    def __init__(self, log_path: Path, log_file: IO[bytes], started: StartedStage):
        self.log_path, self._log_file, self._started = log_path, log_file, started

    def run(self, stop: StopSignal, progress: Callable[[str, float], None]) -> int:
        """Release it and supervise it to its end: its exit code (stop: ended, and ``Stopped`` raised)."""
        try:
            return self._started.supervise(stop, progress)
        finally:
            self._log_file.close()

    def end(self) -> None:
        """End it and whatever it started, unless it ran already; idempotent."""
        try:
            self._started.end()
        finally:
            self._log_file.close()


def start_dataset_child(dataset_dir: Path, log_dir: Path, *, env: Mapping[str, str], grace_s: float,
                        python: str = sys.executable) -> DatasetChild:
    """Start the dataset child, held: it imports its libraries and waits; typed errors as a stage's.

    The calling thread should be the one that later runs it (the keeper's death signal follows the
    thread that started it; see ``pipeline.stage_keeper``).
    """
    # Imported here, by the worker: the child never runs a stage, and the stage runner's imports
    # (structlog, tomllib, asyncio) took a third of its start-up.
    from pipeline.config import StageSpec
    from pipeline.stages import open_step_log, start_supervised

    request, result = dataset_dir.parent / REQUEST_NAME, dataset_dir.parent / RESULT_NAME
    result.unlink(missing_ok=True)
    argv = [python, "-m", "pipeline.dataset_stage", HELD, str(request), str(result)]
    spec = StageSpec(name=STEP, argv=tuple(argv), outputs=())
    log_path, log_file = open_step_log(log_dir, STEP)
    try:
        started = start_supervised(spec, argv, env, log_file, grace_s, held=True)
    except BaseException:
        log_file.close()
        raise
    return DatasetChild(log_path, log_file, started)


def prestart_dataset(texts: Sequence[str], dataset_dir: Path, log_dir: Path, *, env: Mapping[str, str],
                     grace_s: float, python: str = sys.executable) -> DatasetChild | None:
    """The held dataset child, or None when the dataset is complete already (no child is needed)."""
    if dataset_is_complete(dataset_dir, list(texts)):
        return None
    return start_dataset_child(dataset_dir, log_dir, env=env, grace_s=grace_s, python=python)


def run_dataset_stage(
    recordings: Sequence[tuple[Path, str]],
    dataset_dir: Path,
    log_dir: Path,
    stop: StopSignal,
    progress: Callable[[str, float], None],
    *,
    limits: JobLimits,
    env: Mapping[str, str],
    grace_s: float,
    python: str = sys.executable,
    child: DatasetChild | None = None,
) -> DatasetResult:
    """Build the dataset in a child process, or recognise it as complete; typed errors as a stage's.

    ``child``: one started ahead for this ``dataset_dir`` (``prestart_dataset``), run or ended here;
    without one, a child is started now.
    """
    from pipeline.stages import failure_message, how_it_ended, tail_lines

    metadata = dataset_dir / "metadata.csv"
    if dataset_is_complete(dataset_dir, [text for _, text in recordings]):
        if child is not None:
            child.end()
        return DatasetResult(metadata, rebuilt=False, notes=("dataset already complete",))
    if child is None:
        child = start_dataset_child(dataset_dir, log_dir, env=env, grace_s=grace_s, python=python)
    request, result = dataset_dir.parent / REQUEST_NAME, dataset_dir.parent / RESULT_NAME
    try:
        atomic_write_bytes(request, json.dumps({
            "recordings": [[str(path), text] for path, text in recordings],
            "dataset_dir": str(dataset_dir),
            "limits": asdict(limits),
        }).encode())
    except BaseException:
        child.end()
        raise
    code = child.run(stop, progress)
    log_path = child.log_path
    outcome = _read_result(result)
    if code == EXIT_BAD_RECORDING and "bad_recording" in outcome:
        raise BadRecording(str(outcome["bad_recording"]))
    if code == EXIT_DISK_FULL:
        raise HostCondition(f"the dataset step ran out of disk space (No space left on device) writing "
                          f"{dataset_dir.name}/; see {log_path.name}")
    if code != 0 or "notes" not in outcome:
        raise StageFailed(failure_message(f"the dataset step {how_it_ended(code)}", log_path.name,
                                          tail_lines(log_path)))
    return DatasetResult(metadata, rebuilt=True, notes=tuple(outcome["notes"]))


def _read_result(path: Path) -> dict:
    try:
        outcome = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return outcome if isinstance(outcome, dict) else {}


def main(argv: list[str]) -> int:
    """The child: build the dataset the request describes, write the result, exit 0 or 3."""
    request_path, result_path = Path(argv[0]), Path(argv[1])
    request = json.loads(request_path.read_text(encoding="utf-8"))
    recordings = [(Path(path), text) for path, text in request["recordings"]]
    total = max(len(recordings), 1)

    def converted(index: int) -> None:
        print(f"PROGRESS {100.0 * (index + 1) / total:.1f}", flush=True)

    limits = JobLimits(**request["limits"])
    print(f"{len(recordings)} recordings, up to {limits.dataset_workers} at once (DATASET_WORKERS)", flush=True)
    try:
        built = build_dataset(recordings, Path(request["dataset_dir"]), limits=limits, on_converted=converted)
    except BadRecording as exc:
        print(f"BadRecording: {exc}", flush=True)
        atomic_write_bytes(result_path, json.dumps({"bad_recording": str(exc)}).encode())
        return EXIT_BAD_RECORDING
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS:
            raise
        # The result file and the log are on the full disk too: the exit code is what gets through.
        print(f"disk full: {exc}", flush=True)
        return EXIT_DISK_FULL
    for note in built.notes:
        print(note, flush=True)
    atomic_write_bytes(result_path, json.dumps({"notes": list(built.notes)}).encode())
    return 0


def held_main(argv: list[str]) -> int:
    """``--held``: the libraries imported first, then ``main`` once a line arrives on stdin."""
    import pipeline.audio  # noqa: F401 - what a held child is started ahead for

    print(HELD_LINE, flush=True)
    if not sys.stdin.buffer.readline():
        return 0  # ended before its turn: nothing was asked of it
    return main(argv)


if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(held_main(args[1:]) if args[:1] == [HELD] else main(args))
