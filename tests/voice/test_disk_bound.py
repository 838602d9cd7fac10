"""A host's disk stays bounded: jobs that end leave only their logs, retries move their downloads
instead of fetching or copying them again, and what ended jobs left is pruned by age and size."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from pipeline.config import load_pipeline_config
from pipeline.errors import StageFailed
from pipeline.recording_url import parse_recording_url
from pipeline.run import run_pipeline
from pipeline.workdir import (
    ATTEMPTS_DIR,
    LOGS_DIR,
    JobDirUsage,
    job_dir_usage,
    job_dirs,
    prune_decisions,
    prune_work_root,
    work_root_usage,
)
from tests.pipeline.test_dataset import write_inputs
from tests.pipeline.test_run import FakeFetch
from tests.voice.conftest import BUCKET
from worker.core.testing import MemoryQueue
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
# What an ended job may leave under WORK_ROOT: its step logs (a few kB each; five steps per attempt).
ENDED_JOB_BOUND_BYTES = 64 * 1024
NO_BACKOFF = {"SQS_RETRY_VISIBILITY_BASE_SECONDS": 0}


def quick_config(tmp_path: Path):
    """The shipped stand-in pipeline with two training steps per stage: the same files, quickly."""
    text = (REPO / "config" / "pipeline.toml").read_text()
    needle = '"--checkpoints", "{checkpoint_dir}", "--language", "{language}"'
    assert needle in text
    path = tmp_path / "pipeline.toml"
    path.write_text(text.replace(needle, needle + ', "--steps", "2"'))
    return load_pipeline_config(path)


def job_body(job_id: str) -> str:
    return json.dumps({
        "_doc": {"_id": job_id}, "jobId": job_id, "profileId": job_id[:-1] + "f", "environment": "development",
        "metadata": {"directoryName": "voice-1", "language": "en"},
        "input": [{"recordingUrl": f"https://media.example.com/rec/{i}.wav", "originalText": f"Hello {i}."}
                  for i in range(3)],
    })


@pytest.fixture
def fetch(tmp_path):
    sources = write_inputs(tmp_path / "media")
    return FakeFetch({parse_recording_url(f"https://media.example.com/rec/{i}.wav"): path
                      for i, (path, _t, _s) in enumerate(sources)})


def test_many_jobs_with_failures_leave_only_logs_and_fetch_each_recording_once(
        tmp_path, fetch, fake_clock, make_memory_worker, aws):
    """Ten jobs: completed, retried after failures, dead-lettered, cancelled. Every job ends with only
    its logs/ on disk (under ENDED_JOB_BOUND_BYTES each), and no recording is fetched twice."""
    import boto3

    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    config = quick_config(tmp_path)
    store = SqliteStore(str(tmp_path / "records.db"))
    work_root = tmp_path / "work"
    # job index -> the attempts that fail after training (a retryable StageFailed); 9: always.
    failing = {2: {1}, 3: {1, 2}, 4: {1}, 5: {1, 2, 3, 4, 5}, 7: {1}, 8: {1, 2, 3, 4, 5}}
    job_ids = [f"665f1c2e9b1e8a0012ab3{index:03d}" for index in range(10)]
    attempts: dict[str, int] = {}
    fetched: dict[str, int] = {}

    def train(job, work_dir, stop, progress, ledger):
        attempts[job.job_id] = attempts.get(job.job_id, 0) + 1
        before = len(fetch.calls)
        paths = run_pipeline(job, work_dir, stop, config=config, fetch=fetch, progress=progress)
        fetched[job.job_id] = fetched.get(job.job_id, 0) + len(fetch.calls) - before
        if attempts[job.job_id] in failing.get(job_ids.index(job.job_id), ()):
            raise StageFailed("injected: the upload host went away")
        return paths

    handler = VoiceJobHandler(HandlerConfig(work_root=work_root, s3_prefix="models", worker_id="w", lease_s=60,
                                            max_failed_attempts=3),
                              store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)
    queue = MemoryQueue(fake_clock, url="memory://jobs", max_receive_count=50,
                        dead_letter_queue=MemoryQueue(fake_clock, url="memory://jobs-dlq"))
    worker = make_memory_worker(handler, queue=queue, **NO_BACKOFF)
    for job_id in job_ids:
        store.submit({"_id": job_id, "profileId": job_id[:-1] + "f", "environment": "development"},
                     {"_id": job_id[:-1] + "f"})
    store.request_cancel(job_ids[9])
    for job_id in job_ids:
        queue.send(job_body(job_id))
    peak_bytes = 0
    for _ in range(60):
        if worker.run_once() is None and queue.counts() == (0, 0):
            break
        peak_bytes = max(peak_bytes, work_root_usage(work_root).bytes)
    statuses = {job_id: store.get_job(job_id)["status"] for job_id in job_ids}
    assert sorted(statuses.values()) == ["cancelled"] + ["completed"] * 7 + ["error"] * 2, statuses
    assert all(count == 3 for count in fetched.values()), fetched  # each recording fetched once per job
    usage = [job_dir_usage(job) for job in job_dirs(work_root)]
    assert all(job.ended for job in usage)
    assert all({p.name for p in job.path.iterdir()} <= {LOGS_DIR} for job in usage)
    assert max(job.bytes for job in usage) <= ENDED_JOB_BOUND_BYTES
    assert not list(work_root.rglob(ATTEMPTS_DIR))
    print(f"\n{len(job_ids)} jobs, {sum(attempts.values())} attempts: peak {peak_bytes} bytes under the work "
          f"root, after: {sum(job.bytes for job in usage)} bytes in {len(usage)} job directories "
          f"({max(job.bytes for job in usage)} bytes at most per job)")
    store.close()


def test_a_retry_holds_one_copy_of_the_downloads_and_no_earlier_dataset(tmp_path, fetch):
    """A retry moves the earlier attempt's downloads, drops its dataset at once, and the earlier
    attempt itself once its last stage has adopted what it could."""
    from tests.pipeline.test_run import FakeJob, Rec

    config = quick_config(tmp_path)
    recordings = tuple(Rec(url, f"Hello {i}.") for i, url in enumerate(fetch.sources))
    job = FakeJob("665f1c2e9b1e8a0012ab34cd", "en", recordings)
    job_dir = tmp_path / "job"
    first = job_dir / ATTEMPTS_DIR / "0001-aaaaaaaa"
    from worker.core.stop import StopSignal

    run_pipeline(job, first, StopSignal(), config=config, fetch=fetch, progress=lambda s, p: None)
    first_inodes = sorted(p.stat().st_ino for p in (first / "downloads").iterdir())
    seen = {}

    def progress(step, percent):
        if step == "train_full" and "during" not in seen:  # between the downloads and the last stage
            seen["during"] = sorted(p.name for p in first.iterdir()) if first.exists() else None
            seen["downloads"] = len(list((job_dir / ATTEMPTS_DIR).rglob("*.audio")))

    run_pipeline(job, job_dir / ATTEMPTS_DIR / "0002-bbbbbbbb", StopSignal(), config=config, fetch=fetch,
                 progress=progress)
    assert len(fetch.calls) == len(recordings)
    assert seen == {"during": ["checkpoints", "output"], "downloads": len(recordings)}
    assert [p.name for p in (job_dir / ATTEMPTS_DIR).iterdir()] == ["0002-bbbbbbbb"]
    # Moved, not copied: the very files the first attempt downloaded.
    second = job_dir / ATTEMPTS_DIR / "0002-bbbbbbbb" / "downloads"
    assert sorted(p.stat().st_ino for p in second.iterdir()) == first_inodes


def usage(name: str, age_s: float, size: int, ended: bool = True, now_s: float = 1e9) -> JobDirUsage:
    return JobDirUsage(Path(name), size, now_s - age_s, ended)


DAY_S = 86_400.0


def test_pruning_removes_old_job_dirs_then_the_oldest_ended_ones_beyond_the_total():
    """Past the age any job dir goes; then ended ones, oldest first, until the total fits; never a
    recent one, and an unended one only by age."""
    jobs = [usage("old", 20 * DAY_S, 10), usage("old-running", 20 * DAY_S, 10, ended=False),
            usage("a", 3 * DAY_S, 400), usage("b", 2 * DAY_S, 400), usage("c", 1 * DAY_S, 400),
            usage("running", 5 * DAY_S, 10_000, ended=False), usage("fresh", 60, 10_000)]
    doomed = prune_decisions(jobs, 1e9, max_age_s=14 * DAY_S, max_bytes=10_500)
    assert [p.name for p in doomed] == ["old", "old-running", "a", "b"]  # c and fresh: 10 400 bytes
    assert [p.name for p in prune_decisions(jobs, 1e9, max_age_s=0, max_bytes=0)] == []
    assert [p.name for p in prune_decisions(jobs, 1e9, max_age_s=0, max_bytes=11_000)] == ["old", "a"]
    # However old the bound says, a job dir changed within the last hour stays.
    assert [p.name for p in prune_decisions(jobs, 1e9, max_age_s=30, max_bytes=1)] == [
        "old", "old-running", "a", "b", "c", "running"]


def test_pruning_the_work_root_spares_models_running_jobs_and_dot_names(tmp_path):
    """``prune_work_root`` removes an old ended job dir whole (and its emptied parents), and never
    the models tree, the base model cache or a job with attempts under the size bound."""
    root = tmp_path / "work"
    old_logs = root / "production" / "voice-1" / "job-old" / "logs"
    running = root / "production" / "voice-2" / "job-running" / ATTEMPTS_DIR / "0001-aaaaaaaa"
    models = root / ".models" / "production" / "voice-1" / "job-old"
    for directory in (old_logs, running, models, root / ".base-models" / "x"):
        directory.mkdir(parents=True)
    (old_logs / "a.log").write_bytes(b"x" * 5000)
    (running / "big").write_bytes(b"x" * 5000)
    (models / "model.pth").write_bytes(b"m")
    old_s = time.time() - 30 * DAY_S
    for path in (old_logs / "a.log", old_logs, old_logs.parent):
        os.utime(path, (old_s, old_s))
    removed, failures = prune_work_root(root, time.time(), max_age_s=14 * DAY_S, max_bytes=1,
                                        models_root=root / ".models")
    assert [p.name for p in removed] == ["job-old"] and failures == []
    assert not (root / "production" / "voice-1").exists()
    assert running.exists() and (models / "model.pth").exists() and (root / ".base-models" / "x").exists()
    use = work_root_usage(root)
    assert (use.jobs, use.ended_jobs, use.bytes) == (1, 0, 5000) and use.free_bytes > 0
