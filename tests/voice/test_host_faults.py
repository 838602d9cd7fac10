"""A host fault mid-job (GPU gone, work disk full, read-only or gone) releases the job to another host
without spending its retry budget, and takes this worker out of service; a job that keeps meeting
them is, after HOST_FAULT_MAX_RELEASES releases, failed as any other."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from pipeline.config import load_pipeline_config
from pipeline.errors import DownloadError, HostCondition, StageFailed
from pipeline.recording_url import parse_recording_url
from pipeline.run import run_pipeline
from tests.pipeline.test_dataset import write_inputs
from tests.pipeline.test_run import FakeFetch
from tests.voice.conftest import BUCKET, JOB_ID, message_body
from worker.core.daemon import EXIT_HOST_UNFIT, run_worker
from worker.core.health import Liveness
from worker.core.healthcheck import problem
from worker.core.testing import MemoryQueue
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.rules import failed_attempts, is_complete

REPO = Path(__file__).resolve().parents[2]
NO_BACKOFF = {"SQS_RETRY_VISIBILITY_BASE_SECONDS": 0}


@pytest.fixture
def queue(fake_clock):
    return MemoryQueue(fake_clock, url="memory://jobs", max_receive_count=20,
                       dead_letter_queue=MemoryQueue(fake_clock, url="memory://jobs-dlq"))


def make_handler(store, s3, train, root: Path, **config) -> VoiceJobHandler:
    return VoiceJobHandler(HandlerConfig(work_root=root, s3_prefix="models", worker_id=root.name, lease_s=60,
                                         **config),
                           store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)


def raising(error: Exception, times: int = 1_000):
    def during(job, work_dir, stop, progress):
        if during.runs < times:
            during.runs += 1
            raise error
    during.runs = 0
    return during


def disk_full() -> DownloadError:
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as exc:
        try:
            raise DownloadError("recording 0 could not be written") from exc
        except DownloadError as outer:
            return outer


def test_a_lost_gpu_releases_the_job_spends_no_retry_and_stops_the_worker(
        queue, make_memory_worker, store, raw_store, s3, train, tmp_path):
    """A stage's exit 70 releases the message at once, records a host_fault attempt and no failure,
    and the worker takes no other message."""
    train.during = raising(HostCondition("stage train_full exited with code 70; last lines: CUDA error"))
    worker = make_memory_worker(make_handler(store, s3, train, tmp_path / "host-a"), queue=queue)
    queue.send(message_body())
    queue.send(message_body(job_id="665f1c2e9b1e8a0012ab34ff"))  # a second job this host must not take
    assert worker.run_once() == "release"
    assert worker.unfit is not None and "exited with code 70" in worker.unfit
    assert worker.run_once() == "release"  # the next message is handed back unworked
    assert train.runs == 1 and queue.counts() == (2, 0)  # both visible again
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == "processing" and job["lease"] is None and job.get("error") is None
    assert failed_attempts(job) == 0 and job["hostFaults"] == 1
    assert job["history"][-1]["outcome"] == "host_fault"
    assert "exited with code 70" in job["history"][-1]["hostFault"]


def test_a_disk_full_deep_in_an_error_chain_is_the_hosts_fault(
        queue, make_memory_worker, store, raw_store, s3, train, tmp_path):
    """An ENOSPC under a DownloadError releases the job instead of recording a retryable failure."""
    train.during = raising(disk_full())
    worker = make_memory_worker(make_handler(store, s3, train, tmp_path / "host-a"), queue=queue)
    queue.send(message_body())
    assert worker.run_once() == "release"
    job = raw_store.get_job(JOB_ID)
    assert failed_attempts(job) == 0 and job["hostFaults"] == 1
    assert "full" in job["history"][-1]["hostFault"]


def test_a_stage_failing_on_a_disk_below_its_free_bar_is_the_hosts_fault(
        queue, make_memory_worker, store, raw_store, s3, train, tmp_path):
    """A stage exit that says nothing of the disk is a host fault when the work file system is below
    WORK_MIN_FREE_BYTES afterwards, and the job's own failure when it is not."""
    train.during = raising(StageFailed("stage train_full exited with code 1"))
    tight = make_memory_worker(make_handler(store, s3, train, tmp_path / "host-a", work_min_free_bytes=2**62),
                               queue=queue, **NO_BACKOFF)
    queue.send(message_body())
    assert tight.run_once() == "release" and tight.unfit is not None
    roomy = make_memory_worker(make_handler(store, s3, train, tmp_path / "host-b", work_min_free_bytes=1),
                               queue=queue, **NO_BACKOFF)
    assert roomy.run_once() == "retry" and roomy.unfit is None
    job = raw_store.get_job(JOB_ID)
    assert failed_attempts(job) == 1 and job["hostFaults"] == 1


def test_a_job_that_keeps_meeting_host_faults_fails_as_its_own_after_the_limit(
        queue, make_memory_worker, store, raw_store, s3, train, tmp_path):
    """Two releases (HOST_FAULT_MAX_RELEASES=2) on two hosts, then the third fault is the job's own
    recorded retryable failure, and that host stays in service."""
    train.during = raising(disk_full())
    queue.send(message_body())
    actions, unfit = [], []
    for host in ("a", "b", "c"):
        worker = make_memory_worker(make_handler(store, s3, train, tmp_path / f"host-{host}",
                                                 max_host_fault_releases=2), queue=queue, **NO_BACKOFF)
        actions.append(worker.run_once())
        unfit.append(worker.unfit is not None)
    assert actions == ["release", "release", "retry"] and unfit == [True, True, False]
    job = raw_store.get_job(JOB_ID)
    assert job["hostFaults"] == 2 and failed_attempts(job) == 1
    assert job["error"]["retryable"] is True and job["error"]["type"] == "DownloadError"
    assert [entry["outcome"] for entry in job["history"]] == ["host_fault", "host_fault", "retry"]


def test_the_daemon_exits_7_and_the_health_check_fails_after_a_host_fault(
        queue, make_memory_worker, store, s3, train, tmp_path):
    """``run_worker`` returns EXIT_HOST_UNFIT and the liveness file then fails the health check."""
    train.during = raising(HostCondition("stage train_full exited with code 70"))
    handler = make_handler(store, s3, train, tmp_path / "host-a")

    def once(message, lease):
        worker.drain()  # one message at most, whatever the outcome: the exit code must say why it ended
        return handler(message, lease)

    worker = make_memory_worker(once, queue=queue)
    queue.send(message_body())
    liveness = tmp_path / "alive"
    code = run_worker(worker, pulse=Liveness(str(liveness), max_age_s=600))
    assert code == EXIT_HOST_UNFIT
    assert (problem(str(liveness), None) or "").startswith("host unfit: host fault:")


def test_a_real_stage_losing_its_device_once_is_released_and_completes_on_another_host(
        queue, make_memory_worker, store, raw_store, s3, tmp_path):
    """The stand-in trainer exits 70 mid-run on host A: released, no retry spent, A stops; host B
    trains the job to its commit."""
    marker = tmp_path / "device-lost-once"
    text = (REPO / "config" / "pipeline.toml").read_text()
    needle = '"--full-model", "{output_dir}/full/model.pth"]'
    assert text.count(needle) == 1
    config_path = tmp_path / "pipeline.toml"
    config_path.write_text(text.replace(needle, needle[:-1] + f', "--lose-device-once", "{marker}"]'))
    config = load_pipeline_config(config_path)
    [(source, _text, _s), *_] = write_inputs(tmp_path / "media")
    fetch = FakeFetch({parse_recording_url("https://media.example.com/rec/1.wav"): source})

    def train(job, work_dir, stop, progress, ledger):
        return run_pipeline(job, work_dir, stop, config=config, fetch=fetch, progress=progress)

    queue.send(message_body())
    host_a = make_memory_worker(make_handler(store, s3, train, tmp_path / "host-a"), queue=queue)
    assert host_a.run_once() == "release"
    assert marker.exists() and host_a.unfit is not None and "train_light" in host_a.unfit
    # Host A leaves service: its copy of the job's work goes (its logs stay, pruned later).
    assert not list((tmp_path / "host-a").rglob("attempts/*")) and list((tmp_path / "host-a").rglob("logs/*"))
    host_b = make_memory_worker(make_handler(store, s3, train, tmp_path / "host-b"), queue=queue)
    assert host_b.run_once() == "ack"
    job = raw_store.get_job(JOB_ID)
    assert is_complete(job, raw_store.get_profile(job["profileId"]))
    assert failed_attempts(job) == 0 and job["hostFaults"] == 1
    assert [entry["outcome"] for entry in job["history"]] == ["host_fault", "completed"]
