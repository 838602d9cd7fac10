"""The artifact set is the pipeline config's, and a job is judged against the set it committed."""

from __future__ import annotations

import pytest

from tests.support import ARTIFACT_KEYS
from tests.voice.conftest import BUCKET, JOB_ID, PROFILE_ID, deliver, message_body
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.models import read_profile
from worker.voice.records.rules import is_complete

SIXTH = "vocoder"
GROWN = (*ARTIFACT_KEYS, SIXTH)
NEW_JOB, NEW_PROFILE = "665f1c2e9b1e8a0012ab34d0", "665f1c2e9b1e8a0012ab34d1"


def handler_for(keys, store, s3, train, tmp_path) -> VoiceJobHandler:
    """A handler whose pipeline config declares ``keys`` (the shipped set, or one that grew)."""
    config = HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="test-worker", lease_s=2,
                           artifacts=tuple(keys))
    return VoiceJobHandler(config, store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)


def grow(train) -> None:
    train.artifacts = {**train.artifacts, SIXTH: "full/vocoder.pth"}


def test_a_profile_completed_under_five_keys_stays_complete_when_the_set_grows(store, raw_store, s3, train,
                                                                                tmp_path):
    """A job committed under the shipped set records it; after the config grows to six keys its
    redelivery is still complete (no training), while a new job under six keys commits all six."""
    assert deliver(handler_for(ARTIFACT_KEYS, store, s3, train, tmp_path), 1) == "completed"
    assert raw_store.get_job(JOB_ID)["artifacts"] == list(ARTIFACT_KEYS)

    grow(train)
    grown = handler_for(GROWN, store, s3, train, tmp_path)
    assert is_complete(raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID))
    assert deliver(grown, 2) == "already_complete" and train.runs == 1

    raw_store.submit({"_id": NEW_JOB, "profileId": NEW_PROFILE, "environment": "production"}, {"_id": NEW_PROFILE})
    assert deliver(grown, 1, message_id="m-2", body=message_body(NEW_JOB, NEW_PROFILE)) == "completed"
    job, profile = raw_store.get_job(NEW_JOB), raw_store.get_profile(NEW_PROFILE)
    assert job["artifacts"] == list(GROWN)
    assert set(profile["modelPaths"]) == set(profile["s3Paths"]) == set(GROWN)
    assert is_complete(job, profile)
    without_sixth = read_profile({**profile, "s3Paths": {k: v for k, v in profile["s3Paths"].items() if k != SIXTH}})
    assert not is_complete(job, without_sixth)  # a job committed under six keys needs all six


def test_a_trainer_that_leaves_out_a_configured_artifact_commits_nothing(store, raw_store, s3, train, tmp_path):
    """The commit writes the configured set: an attempt missing one of its keys fails before any upload."""
    grown = handler_for(GROWN, store, s3, train, tmp_path)  # the trainer still writes only the shipped set
    with pytest.raises(Exception, match=f"the trainer produced no {SIXTH}"):
        deliver(grown, 1)
    assert s3.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == 0
    assert not is_complete(raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID))


def test_a_retry_finishes_a_commit_of_the_whole_configured_set(store, raw_store, s3, train, tmp_path):
    """An attempt that died after writing the paths of all six is finished by its retry from the published
    files of the configured set, without training again, and the commit records all six."""
    from worker.voice.records.errors import StoreError

    grow(train)
    grown = handler_for(GROWN, store, s3, train, tmp_path)
    store.faults["mark_job_completed"] = lambda: StoreError("the worker died here")
    with pytest.raises(StoreError):
        deliver(grown, 1)
    del store.faults["mark_job_completed"]
    assert deliver(grown, 2) == "completed" and train.runs == 1
    job = raw_store.get_job(JOB_ID)
    assert job["artifacts"] == list(GROWN) and is_complete(job, raw_store.get_profile(PROFILE_ID))
