"""The quality gate with the real trainers: a bar the ci profile's six-step models cannot reach.

The same pipeline as test_e2e.py (config/pipeline.real.toml in the ci profile on the CPU), with a
``[quality.gate]`` whose speaker-similarity bar is far above what six steps of VITS give (about 0.5; the
recordings themselves score above 0.9): the evaluate stage scores both models, the worker reads the
report and ends the job ``refused``: nothing uploaded, nothing on the profile, the message acknowledged,
nothing in the DLQ, and `status` shows the bar each model failed.
"""

from __future__ import annotations

import json

import pytest

from tests.real.harness import (
    make_real_stack,
    real_worker,
    submit_speech_job,
    unwrapped,
    wait_for_commit,
    worker_status,
)
from tests.real.speech import speech_clips
from worker.voice.stage_logs import LOGS_KEY_DIR

JOB_TIMEOUT_S = 1500
# Above any six-step model's similarity, below nothing a real voice needs: the gate must refuse both models.
SIMILARITY_BAR = 0.9


@pytest.fixture(scope="module")
def refused(moto_server, tmp_path_factory):
    """One job run by one worker under the gate, until it has ended refused and its message is deleted."""
    root = tmp_path_factory.mktemp("gated")
    stack = make_real_stack(moto_server, root, gate={"min_speaker_similarity": SIMILARITY_BAR})
    job = submit_speech_job(stack, speech_clips(root / "clips"))
    worker = real_worker(stack, root, "gated")
    try:
        worker.start()
        wait_for_commit(job, worker, JOB_TIMEOUT_S, status="refused")
        assert worker.stop() == 0
    finally:
        worker.ensure_dead()
    return job, worker


def test_a_model_below_the_bar_ends_the_job_refused_with_the_bars_it_failed(refused):
    """The record says refused, QualityBelowBar, not retryable; its quality names a failed bar for every model
    whose measured similarity is under the bar, and only those."""
    job, worker = refused
    record = job.record()
    assert record["status"] == "refused", record
    assert record["error"]["type"] == "QualityBelowBar" and record["error"]["retryable"] is False, record["error"]
    quality = record["quality"]
    below = [name for name, figures in quality["models"].items()
             if figures["speakerSimilarity"] < SIMILARITY_BAR]
    assert below, f"no model below {SIMILARITY_BAR}: the test refuses nothing ({quality['models']})"
    failed = quality["gate"]["failed"]
    assert quality["gate"]["applied"] is True and quality["gate"]["passed"] is False
    assert quality["gate"]["bars"]["minSpeakerSimilarity"] == SIMILARITY_BAR
    assert sorted(bar.split(" ")[0] for bar in failed) == sorted(f"{name}.speaker_similarity" for name in below)
    assert all(f"< {SIMILARITY_BAR:.2f}" in bar for bar in failed), failed
    [refusal] = [e for e in worker.events() if e.get("event") == "job.refused"]
    assert refusal["failed"] == failed


def test_a_refused_job_uploads_nothing_names_no_files_and_leaves_no_message(refused):
    """No model object in the bucket (no version, no delete marker: only the shipped stage logs), no paths and
    no completion on the profile, the queue and the DLQ empty: the message was acknowledged, not dead-lettered."""
    job, worker = refused
    listed = job.stack.s3.list_object_versions(Bucket=job.stack.bucket)
    models = [v["Key"] for v in listed.get("Versions", []) + listed.get("DeleteMarkers", [])
              if f"/{LOGS_KEY_DIR}/" not in v["Key"]]
    assert models == [], listed
    assert any(f"/{LOGS_KEY_DIR}/{job.job_id}/" in v["Key"] for v in listed.get("Versions", [])), listed
    profile = job.profile()
    assert not profile.get("s3Paths") and not profile.get("modelPaths"), profile
    assert profile.get("status") != "completed", profile
    assert job.stack.queue_counts() == ((0, 0), (0, 0))
    assert "message.deleted" in worker.event_names()
    assert not {"artifacts.uploaded", "artifacts.published"} & set(worker.event_names()), worker.event_names()


def test_status_shows_the_refusal_and_the_failed_bars(refused):
    """`status` prints refused and `gate: below the bar:` with each failed bar; --json carries the record's quality."""
    job, _ = refused
    failed = job.record()["quality"]["gate"]["failed"]
    text = unwrapped(worker_status(job.stack, job.job_id))
    assert "refused" in text, text
    assert "gate: below the bar: " + "; ".join(failed) in text, text
    shown = json.loads(worker_status(job.stack, job.job_id, as_json=True))
    assert shown["job"]["status"] == "refused" and shown["job"]["quality"]["gate"]["failed"] == failed
