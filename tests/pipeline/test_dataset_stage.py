"""The dataset step runs in a child process: the worker never loads the decoders, and the child is
supervised like a stage (typed errors, stop, crash)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.dataset_stage import run_dataset_stage
from pipeline.limits import JobLimits
from pipeline.stage_env import stage_environment
from tests.pipeline.test_dataset import write_inputs
from worker.core.errors import BadRecording, StageFailed, Stopped
from worker.core.stop import StopSignal

REPO = Path(__file__).resolve().parents[2]


def inputs(tmp_path: Path) -> list[tuple[Path, str]]:
    return [(path, text) for path, text, _seconds in write_inputs(tmp_path / "in")]


def run(tmp_path: Path, recordings, *, stop: StopSignal | None = None, python: str = sys.executable,
        limits: JobLimits | None = None):
    seen: list[tuple[str, float]] = []
    result = run_dataset_stage(recordings, tmp_path / "dataset", tmp_path / "logs", stop or StopSignal(),
                               lambda step, pct: seen.append((step, pct)), limits=limits or JobLimits(),
                               env=stage_environment({"PATH": "/usr/bin:/bin"}), grace_s=1.0, python=python)
    return result, seen


def test_the_worker_wiring_never_imports_numpy_soundfile_or_soxr():
    """Importing the daemon's wiring and the pipeline leaves numpy, soundfile, soxr and the decoders unloaded."""
    probe = ("import sys, worker.app, worker.ops.cli, pipeline.run; "
             "print(sorted(m for m in ('numpy', 'soundfile', 'soxr', 'pipeline.audio') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_dataset_child_starts_without_the_stage_runner():
    """What the child imports leaves out the worker's stage runner and its logging (structlog, asyncio)."""
    probe = ("import sys, pipeline.dataset_stage, pipeline.audio; "
             "print(sorted(m for m in ('pipeline.stages', 'structlog', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_child_builds_the_dataset_reports_progress_and_logs_its_notes(tmp_path):
    """A good set of recordings becomes the LJSpeech folder, with PROGRESS per recording and the notes in the step log."""
    recordings = inputs(tmp_path)
    result, seen = run(tmp_path, recordings)
    assert result.rebuilt and len(result.notes) == len(recordings)
    assert (tmp_path / "dataset" / "metadata.csv").is_file()
    assert [pct for step, pct in seen if step == "dataset"][-1] == 100.0
    [log] = (tmp_path / "logs").glob("*-dataset.log")
    assert "utt00000: input 0" in log.read_text()
    again, seen = run(tmp_path, recordings)
    assert not again.rebuilt and seen == []  # complete: recognised without a child


def test_the_child_converts_as_many_at_once_as_the_limits_say(tmp_path):
    """DATASET_WORKERS reaches the child with the job's limits, and its log says how many it converts at once."""
    result, _seen = run(tmp_path, inputs(tmp_path), limits=JobLimits(dataset_workers=3))
    assert result.rebuilt
    [log] = (tmp_path / "logs").glob("*-dataset.log")
    assert "3 recordings, up to 3 at once (DATASET_WORKERS)" in log.read_text()


def test_an_unusable_recording_is_a_permanent_bad_recording_from_the_child(tmp_path):
    """The child's BadRecording reaches the worker as BadRecording with the child's reason."""
    bad = tmp_path / "bad.audio"
    bad.write_bytes(b"this is not audio at all" * 100)
    with pytest.raises(BadRecording, match="recording 0"):
        run(tmp_path, [(bad, "Hello.")])


def test_a_crashing_child_is_a_retryable_stage_failure(tmp_path):
    """A child that dies without a result is StageFailed (retryable), never a silent success."""
    with pytest.raises(StageFailed, match="dataset step exited with code 1") as caught:
        run(tmp_path, inputs(tmp_path), python="/bin/false")
    assert caught.value.retryable


def test_a_stop_ends_the_child_at_once(tmp_path):
    """A stop during the dataset step ends the child and raises Stopped with the stop's reason."""
    sleeper = tmp_path / "sleepy-python"
    sleeper.write_text("#!/bin/sh\nexec sleep 60\n")
    sleeper.chmod(0o755)
    stop = StopSignal()
    threading.Timer(0.3, stop.set, args=("shutdown",)).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        run(tmp_path, inputs(tmp_path), stop=stop, python=str(sleeper))
    assert time.monotonic() - started < 10
