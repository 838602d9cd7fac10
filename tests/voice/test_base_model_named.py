"""The pinned base model is named on the job at its claim and on the profile its models are committed to,
so a product team knows what every voice was derived from."""

from __future__ import annotations

import pytest

from tests.voice.conftest import BUCKET, JOB_ID, PROFILE_ID, deliver
from worker.core.errors import UnexpectedError
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.rules import BASE_MODEL

BASE = {"name": "espeak-en-us-base", "digest": "sha256:" + "c" * 64, "licence": "Apache-2.0"}


def handler_with(store, s3, train, tmp_path, base_model=None) -> VoiceJobHandler:
    return VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="test-worker",
                                         lease_s=2, base_model=base_model),
                           store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)


def test_the_job_and_the_profile_name_the_base_the_models_were_derived_from(store, raw_store, s3, train, tmp_path,
                                                                           recorder):
    """A committed job names the base on its record (before training) and on the profile (before it completes)."""
    assert deliver(handler_with(store, s3, train, tmp_path, BASE), 1) == "completed"
    assert raw_store.get_job(JOB_ID)[BASE_MODEL] == BASE
    assert raw_store.get_profile(PROFILE_ID)[BASE_MODEL] == BASE
    calls = recorder.calls
    assert calls.index("store.record_base_model") < calls.index("store.write_paths")
    assert calls.index("store.write_profile_base_model") < calls.index("store.mark_profile_completed")


def test_a_failed_attempt_still_names_its_base_on_the_job(store, raw_store, s3, train, tmp_path):
    """The job names its base from the claim on, so a refused or failed job says what it started from."""
    def fail(job, work_dir, stop, progress):
        raise RuntimeError("the trainer broke")

    train.during = fail
    with pytest.raises(UnexpectedError):  # retried: recorded on the job, the message left for the backoff
        deliver(handler_with(store, s3, train, tmp_path, BASE), 1)
    assert raw_store.get_job(JOB_ID)[BASE_MODEL] == BASE
    assert BASE_MODEL not in raw_store.get_profile(PROFILE_ID)


def test_without_a_pinned_base_nothing_is_named(store, raw_store, s3, train, tmp_path):
    """A pipeline that trains from scratch names no base on the job or the profile."""
    assert deliver(handler_with(store, s3, train, tmp_path), 1) == "completed"
    assert BASE_MODEL not in raw_store.get_job(JOB_ID) and BASE_MODEL not in raw_store.get_profile(PROFILE_ID)


def test_status_shows_the_base_with_its_digest_and_licence(store, raw_store, s3, train, tmp_path, capsys):
    """`status` names the job's base model: its name and licence, then its digest."""
    from worker.ops.commands import cmd_status

    deliver(handler_with(store, s3, train, tmp_path, BASE), 1)
    assert cmd_status(raw_store, JOB_ID, as_json=False) == 0
    lines = capsys.readouterr().out.splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("  base ")]
    assert "espeak-en-us-base" in lines[at] and "licence Apache-2.0" in lines[at]
    assert BASE["digest"] in lines[at] + lines[at + 1]
