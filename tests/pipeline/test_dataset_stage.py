"""The dataset step runs in a child process: the worker never loads the decoders, and the child is
supervised like a stage (typed errors, stop, crash)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.config import PipelineConfig
from pipeline.dataset_stage import HELD_LINE, prestart_dataset, run_dataset_stage, start_dataset_child
from pipeline.errors import BadRecording, DownloadError, StageFailed
from pipeline.limits import JobLimits
from pipeline.proctree import JOB_NAME, job_processes
from pipeline.recording_url import RecordingUrl, parse_recording_url
from pipeline.run import run_pipeline
from pipeline.stage_env import stage_environment
from tests.pipeline.test_dataset import write_inputs
from tests.support import ARTIFACT_KEYS
from worker.core.errors import Stopped
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


def held_env(mark: str) -> dict[str, str]:
    return {**stage_environment({"PATH": "/usr/bin:/bin"}), JOB_NAME: mark}


def dataset_processes(mark: str) -> set[int]:
    """The job's processes running the dataset child, its keeper included."""
    found = set()
    for pid in job_processes(mark):
        try:
            if b"pipeline.dataset_stage" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except OSError:  # it ended meanwhile
            pass
    return found


def test_a_held_child_reads_its_request_only_when_its_turn_comes(tmp_path):
    """A child started before its inputs exist waits, then builds the dataset from the inputs made since."""
    child = start_dataset_child(tmp_path / "dataset", tmp_path / "logs", env=held_env(str(tmp_path)), grace_s=1.0)
    for _ in range(600):  # until it says it waits (a minute at most)
        if HELD_LINE in child.log_path.read_text():
            break
        time.sleep(0.1)
    recordings = inputs(tmp_path)  # as the downloads write them, while the child waits
    result = run_dataset_stage(recordings, tmp_path / "dataset", tmp_path / "logs", StopSignal(),
                               lambda step, pct: None, limits=JobLimits(), env={}, grace_s=1.0, child=child)
    assert result.rebuilt and len(result.notes) == len(recordings)
    assert len(list((tmp_path / "logs").glob("*-dataset.log"))) == 1


def test_a_held_child_whose_turn_never_comes_is_ended_with_its_keeper(tmp_path):
    """Ending a held child leaves no process of it, nor of its keeper, carrying the job's mark."""
    child = start_dataset_child(tmp_path / "dataset", tmp_path / "logs", env=held_env(str(tmp_path)), grace_s=1.0)
    assert job_processes(str(tmp_path))
    child.end()
    assert job_processes(str(tmp_path)) == set()


def test_a_complete_dataset_gets_no_child_started_ahead(tmp_path):
    """Once the dataset is complete, starting ahead finds nothing to do and starts no process."""
    recordings = inputs(tmp_path)
    run(tmp_path, recordings)
    ahead = prestart_dataset([text for _, text in recordings], tmp_path / "dataset", tmp_path / "logs",
                             env=held_env(str(tmp_path)), grace_s=1.0)
    assert ahead is None and job_processes(str(tmp_path)) == set()


@dataclass(frozen=True)
class Rec:
    url: RecordingUrl
    text: str


@dataclass(frozen=True)
class Job:
    job_id: str
    language: str
    recordings: tuple[Rec, ...]


class WatchingFetch:
    """Copies each recording into place, noting the job's held dataset child seen while it does; then,
    if told, fails the last download or stops the job."""

    def __init__(self, tmp_path: Path, mark: str, then: str = "", stop: StopSignal | None = None):
        self.sources = {parse_recording_url(f"https://media.example.com/{i}.audio"): (path, text)
                        for i, (path, text) in enumerate(inputs(tmp_path))}
        self.mark, self.then, self.stop = mark, then, stop
        self.children_seen: list[set[int]] = []

    def job(self) -> Job:
        return Job("job-1", "en", tuple(Rec(url, text) for url, (_, text) in self.sources.items()))

    def __call__(self, url: RecordingUrl, destination: Path) -> None:
        self.children_seen.append(dataset_processes(self.mark))
        if url == list(self.sources)[-1] and self.then == "fail":
            raise DownloadError("the server went away")
        if url == list(self.sources)[-1] and self.then == "stop" and self.stop is not None:
            self.stop.set("cancelled", "user asked")
        shutil.copyfile(self.sources[url][0], destination)


# No stages: the run ends at its artifact check, right after the dataset step.
DATASET_ONLY = PipelineConfig(artifacts={key: f"{key}.bin" for key in ARTIFACT_KEYS}, stages=())


def test_the_job_runs_the_dataset_child_it_started_before_its_downloads(tmp_path):
    """During the downloads the job's held dataset child is alive, and the dataset step runs that one."""
    work = tmp_path / "work"
    fetch = WatchingFetch(tmp_path, str(work.resolve()))
    with pytest.raises(StageFailed, match="without these artifacts"):
        run_pipeline(fetch.job(), work, StopSignal(), config=DATASET_ONLY, fetch=fetch,
                     progress=lambda s, p: None)
    assert all(fetch.children_seen)
    assert (work / "dataset" / "metadata.csv").is_file()
    assert len(list((work / "logs").glob("*-dataset.log"))) == 1  # no second child was started


@pytest.mark.parametrize("then", ["fail", "stop"])
def test_a_download_failure_or_a_stop_ends_the_held_dataset_child(tmp_path, then):
    """When the downloads fail or the job is stopped, the child started ahead is ended with its keeper."""
    work, stop = tmp_path / "work", StopSignal()
    fetch = WatchingFetch(tmp_path, str(work.resolve()), then, stop)
    with pytest.raises(DownloadError if then == "fail" else Stopped):
        run_pipeline(fetch.job(), work, stop, config=DATASET_ONLY, fetch=fetch,
                     progress=lambda s, p: None)
    assert fetch.children_seen[-1] and job_processes(str(work.resolve())) == set()
    assert not (work / "dataset" / "metadata.csv").exists()
