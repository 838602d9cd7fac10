"""What a job cost: its attempts' trainer-stage time (GPU-seconds), and what was wasted by attempts
that did not commit; on the record, in metrics and in `status`."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime

import pytest

from pipeline.errors import StageFailed
from tests.voice.conftest import BUCKET, JOB_ID, PROFILE_ID, deliver
from worker.core.metrics import Metrics
from worker.ops.commands import render_status, status_document
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records import rules
from worker.voice.records.attempt import TrainerClock
from worker.voice.records.models import read_job

NOW = datetime(2026, 12, 1, tzinfo=UTC)


class Ticks:
    """A clock that moves only when told."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_only_trainer_stages_count_and_a_running_one_counts_so_far():
    """The worker's own steps cost no GPU time; a trainer stage counts from its first report to its 100 %."""
    ticks = Ticks()
    clock = TrainerClock(ticks)
    for at, step, percent, trainer in [(0, "download", 0, False), (5, "download", 100, False),
                                       (5, "train_full", 0, True), (9, "train_full", 40, True),
                                       (12, "train_full", 100, True), (20, "train_light", 0, True)]:
        ticks.now = at
        clock.observe(step, percent, trainer=trainer)
    ticks.now = 23
    assert clock.seconds() == 7 + 3


def history_entry(outcome: str, gpu_s: float | None) -> dict:
    entry = {"worker": "w", "token": outcome, "start": NOW, "end": NOW, "outcome": outcome}
    return entry if gpu_s is None else {**entry, "gpuSeconds": gpu_s}


def test_usage_sums_every_attempt_and_wastes_only_those_that_did_not_commit():
    """Released, failed and abandoned attempts are wasted; the committed and the running one are not."""
    job = {"attempts": 5, "history": [history_entry("released", 10), history_entry("retry", 20.5),
                                      history_entry("abandoned", None), history_entry("completed", 100),
                                      history_entry("running", 7)]}
    assert rules.usage(read_job(job)) == {"attempts": 5, "gpuSeconds": 137.5, "wastedGpuSeconds": 30.5}
    assert rules.usage(None) == {"attempts": 0, "gpuSeconds": 0.0, "wastedGpuSeconds": 0.0}
    odd = read_job({"history": [history_entry("retry", "ten")]})
    assert rules.usage(odd)["gpuSeconds"] == 0.0  # odd data reads as none


def test_totals_stay_exact_when_old_attempts_leave_the_history():
    """Entries dropped by the history limit keep their GPU-seconds in the job's totals."""
    job: dict = {"status": "pending"}
    for n in range(rules.HISTORY_LIMIT + 7):
        job = rules.claimed(job, owner="w", token=f"t{n}", lease_s=60, now=NOW)
        job = rules.with_gpu_seconds(job, f"t{n}", 2.0)
        job = rules.errored(job, token=f"t{n}", error_type="StageFailed", message="x", retryable=True, now=NOW)
    assert len(job["history"]) == rules.HISTORY_LIMIT
    assert rules.usage(read_job(job)) == {"attempts": rules.HISTORY_LIMIT + 7,
                                          "gpuSeconds": 2.0 * (rules.HISTORY_LIMIT + 7),
                                          "wastedGpuSeconds": 2.0 * (rules.HISTORY_LIMIT + 7)}


def test_an_attempt_writes_only_its_own_history_entry():
    """A stale token's trainer time never lands on the newer attempt's entry."""
    job = rules.claimed({"status": "pending"}, owner="w", token="new", lease_s=60, now=NOW)
    assert rules.with_gpu_seconds(job, "old", 99.0) == job
    assert rules.with_gpu_seconds(job, "new", 3.0)["history"][-1]["gpuSeconds"] == 3.0


def emf(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


@pytest.fixture
def ticking(monkeypatch) -> Ticks:
    """Every attempt's trainer clock runs on one test clock."""
    ticks = Ticks()
    monkeypatch.setattr(TrainerClock, "default_clock", staticmethod(ticks))
    return ticks


def test_a_failed_attempt_is_wasted_and_the_commit_reports_the_whole_cost(store, s3, train, tmp_path, ticking):
    """The failed attempt's trainer time is its WastedGpuSeconds and reaches the record; the commit emits
    the job's GPU-seconds over both attempts, the wasted part and the attempts; status shows them."""
    out = io.StringIO()
    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w", lease_s=60),
                              store=store, uploader=ArtifactUploader(s3, BUCKET), train=train,
                              metrics=Metrics(stream=out))

    def fails_after_30_s(job, work_dir, stop, progress):
        progress("download", 0)
        ticking.now += 100  # downloads: the worker's own time
        progress("download", 100)
        progress("train_full", 0)
        ticking.now += 30
        progress("train_full", 50)
        raise StageFailed("stage train_full exited with code 1")

    train.during = fails_after_30_s
    with pytest.raises(StageFailed):
        deliver(handler, 1)
    [wasted] = [d for d in emf(out) if "WastedGpuSeconds" in d]
    assert wasted["WastedGpuSeconds"] == 30 and wasted["jobId"] == JOB_ID
    assert store.get_job(JOB_ID)["history"][-1]["gpuSeconds"] == 30

    def succeeds_in_45_s(job, work_dir, stop, progress):
        progress("train_full", 0)
        ticking.now += 45

    train.during = succeeds_in_45_s
    assert deliver(handler, 2, message_id="m-2") == "completed"
    [cost] = [d for d in emf(out) if "JobGpuSeconds" in d]
    assert (cost["JobGpuSeconds"], cost["JobWastedGpuSeconds"], cost["JobAttempts"]) == (75, 30, 2)
    doc = status_document(store, JOB_ID)
    assert doc.as_json()["cost"] == {"attempts": 2, "gpuSeconds": 75.0, "wastedGpuSeconds": 30.0, "failedAttempts": 1}
    assert "75 CPU-s, of which 30 wasted" in render_status(doc)  # no stage declared cuda
    assert PROFILE_ID in render_status(doc)
