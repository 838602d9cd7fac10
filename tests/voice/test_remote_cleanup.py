"""The job's mirror in S3 (pipeline.remote_work) goes with its work files once the job is committed."""

from __future__ import annotations

from tests.voice.conftest import BUCKET, deliver
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler


def test_the_mirror_is_forgotten_after_the_commit_and_only_then(store, s3, train, tmp_path):
    """A committed job's work directory is handed to the mirror's clean-up; a failed one keeps its mirror."""
    forgotten = []
    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w", lease_s=60),
                              store=store, uploader=ArtifactUploader(s3, BUCKET), train=train,
                              forget_remote_work=forgotten.append)

    def fails(*_args):
        raise OSError("disk gone")

    train.during = fails
    try:
        deliver(handler, 1)
    except Exception:  # noqa: BLE001 - the failure itself is another test's subject
        pass
    assert forgotten == []
    train.during = None
    assert deliver(handler, 2, message_id="m-2") == "completed"
    [job_dir] = forgotten
    assert job_dir.name == "665f1c2e9b1e8a0012ab34cd" and job_dir.is_relative_to(tmp_path / "work")


def test_a_failing_clean_up_does_not_fail_the_committed_job(store, s3, train, tmp_path):
    """The mirror's clean-up is best effort: the job stays completed when it raises."""
    def broken(_job_dir):
        raise RuntimeError("S3 gone")

    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w", lease_s=60),
                              store=store, uploader=ArtifactUploader(s3, BUCKET), train=train,
                              forget_remote_work=broken)
    assert deliver(handler, 1) == "completed"

