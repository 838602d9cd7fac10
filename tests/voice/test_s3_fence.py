"""S3 under the claim's fence: a stale attempt cannot change the committed job's objects, stops writing
once it learns it lost, and what no committed path names is cleaned up."""

from __future__ import annotations

import boto3

from tests.support import ARTIFACT_KEYS, client_error
from tests.voice.conftest import ARTIFACTS, BUCKET, JOB_ID, PROFILE_ID, message_body, take_over
from worker.voice.artifacts import ArtifactUploader, artifact_key, job_key_prefix

PREFIX = job_key_prefix("models", "production", PROFILE_ID, JOB_ID)


def keys_in_bucket(s3) -> set[str]:
    return {item["Key"] for item in s3.list_objects_v2(Bucket=BUCKET).get("Contents") or []}


def body(s3, uri: str) -> bytes:
    return s3.get_object(Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"))["Body"].read()


def commit_as_b(raw_store, clock, tmp_path, same_as_ours: set[str]) -> dict[str, str]:
    """Worker B takes the job over, uploads its own training (the assets in ``same_as_ours`` with our
    bytes, the rest with its own) through another client, and commits it; returns B's s3Paths."""
    attempt = take_over(raw_store, clock)
    output = tmp_path / "worker-b" / "output"
    files = {}
    for name, rel in ARTIFACTS.items():
        path = output / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        ours = f"{name} of {JOB_ID}\n".encode() * 10
        path.write_bytes(ours if name in same_as_ours else f"{name} trained by B\n".encode())
        files[name] = path
    uploader = ArtifactUploader(boto3.client("s3", region_name="us-east-1"), BUCKET)
    s3_paths = uploader.upload_all(output, files, lambda sha, rel: artifact_key(
        "models", "production", PROFILE_ID, JOB_ID, sha, rel))
    attempt.write_paths({name: str(path) for name, path in files.items()}, s3_paths)
    attempt.complete_profile()
    attempt.complete()
    return s3_paths


def test_a_claim_lost_between_two_uploads_writes_no_further_object(queues, make_worker, handler, raw_store,
                                                                   clock, s3, recorder):
    """Taken over while its second object goes up, the worker proves its claim before the third and stops."""
    def takeover_on_second_put(**_kwargs):
        if recorder.calls.count("s3.PutObject") == 2:
            take_over(raw_store, clock)

    s3.meta.events.register("before-call.s3.PutObject", takeover_on_second_put)
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "abandon"
    assert recorder.calls.count("s3.PutObject") == 2
    assert "store.write_paths" not in recorder.calls
    # The job is not committed yet: what we wrote stays for the holder's cleanup after its commit.
    assert len(keys_in_bucket(s3)) == 2
    assert raw_store.get_job(JOB_ID)["lease"]["token"] == "token-b"
    assert "delete_message" not in client.ops()


def test_a_stale_attempt_cannot_change_the_committed_objects(queues, make_worker, handler, store, raw_store,
                                                             clock, s3, tmp_path):
    """B commits while we are between our uploads and our paths: B's objects keep B's bytes, ours that B
    does not name are deleted, and the one with the same bytes (B's own key) is kept."""
    hits = []

    def b_commits_first():
        if not hits:
            hits.append(commit_as_b(raw_store, clock, tmp_path, same_as_ours={"fullModel"}))

    store.faults["write_paths"] = b_commits_first  # runs before our (now refused) write
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() != "ack"
    b_paths = hits[0]
    profile = raw_store.get_profile(PROFILE_ID)
    assert profile["s3Paths"] == b_paths and raw_store.get_job(JOB_ID)["status"] == "completed"
    for name in ARTIFACT_KEYS:
        expected = f"{name} of {JOB_ID}\n".encode() * 10 if name == "fullModel" else f"{name} trained by B\n".encode()
        assert body(s3, b_paths[name]) == expected, name
    assert keys_in_bucket(s3) == {uri.removeprefix(f"s3://{BUCKET}/") for uri in b_paths.values()}
    assert "delete_message" not in client.ops()


def test_after_the_commit_objects_no_committed_path_names_are_removed(queues, make_worker, handler, raw_store, s3):
    """An object a stale attempt left under the job's prefix is deleted after the commit; other jobs' stay."""
    orphan = f"{PREFIX}{'0' * 64}/full/model.pth"
    other_job = f"models/production/{PROFILE_ID}/665f1c2e9b1e8a0012ab0000/{'1' * 64}/full/model.pth"
    for key in (orphan, other_job):
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"a stale attempt's bytes")
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    committed = {uri.removeprefix(f"s3://{BUCKET}/") for uri in raw_store.get_profile(PROFILE_ID)["s3Paths"].values()}
    assert len(committed) == 5 and all(key.startswith(PREFIX) for key in committed)
    assert keys_in_bucket(s3) == committed | {other_job}


def test_a_failed_cleanup_never_fails_the_committed_job(queues, make_worker, handler, raw_store, s3):
    """A listing refused after the commit is only logged: the job is completed and the message deleted."""
    def refuse(**_kwargs):
        # Only the cleanup's: the uploads list the job's prefix too, before the commit.
        if raw_store.get_job(JOB_ID)["status"] == "completed":
            raise client_error("AccessDenied")

    s3.meta.events.register("before-call.s3.ListObjectsV2", refuse)
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    assert raw_store.get_job(JOB_ID)["status"] == "completed"
    assert client.ops()[-1] == "delete_message"


def test_a_lease_lost_during_a_multipart_upload_sends_no_further_part(queues, make_worker, fake_clock, store, s3,
                                                                     train, recorder, tmp_path):
    """The heartbeat losing the lease while a part is in flight: the next part is never sent, the upload is
    aborted, and nothing is written to the store."""
    import os

    from worker.voice.job import HandlerConfig, VoiceJobHandler

    def big_full_model(job, work_dir, stop, progress, ledger=None):
        paths = train(job, work_dir, stop, progress, ledger)
        paths["fullModel"].write_bytes(os.urandom(11 * 1024 * 1024))
        return paths

    uploader = ArtifactUploader(s3, BUCKET, multipart_threshold_bytes=5 * 1024 * 1024,
                                multipart_chunk_bytes=5 * 1024 * 1024, max_concurrency=1)
    inner = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="test-worker",
                                          lease_s=30),
                            store=store, uploader=uploader, train=big_full_model)
    leases = []

    def handler(message, lease):
        leases.append(lease)
        return inner(message, lease)

    def lose_the_lease_during_the_first_part(**_kwargs):
        if recorder.calls.count("s3.UploadPart") == 1:
            client.faults["change_message_visibility"] = lambda kw: client_error("ReceiptHandleIsInvalid")
            assert fake_clock.advance(1, until=lambda: leases[0].lost)  # the next tick's renewal is refused

    s3.meta.events.register("before-call.s3.UploadPart", lose_the_lease_during_the_first_part)
    worker, client = make_worker(handler, clock=fake_clock)
    queues.send(message_body())
    assert worker.run_once() == "abandon"
    assert recorder.calls.count("s3.UploadPart") == 1
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    assert not keys_in_bucket(s3)
    assert "store.write_paths" not in recorder.calls


def test_a_store_outage_during_the_uploads_is_left_to_the_local_lease_deadline(queues, make_worker, store, s3,
                                                                              train, raw_store, tmp_path):
    """A renewal before an upload that cannot reach the store does not fail the job while the record lease
    is still far from lapsing: the uploads go on and the job commits."""
    from worker.voice.job import HandlerConfig, VoiceJobHandler
    from worker.voice.records.errors import StoreError

    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="test-worker",
                                            lease_s=30),
                              store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)
    renewals = []

    def unreachable_after_the_committing_renewal():
        # The renewal right after the committing stage must land (it reads a cancel that came before);
        # the outage starts with the proofs before the uploads.
        renewals.append(1)
        return StoreError("store unreachable") if len(renewals) > 1 else None

    store.faults["renew_lease"] = unreachable_after_the_committing_renewal
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    assert raw_store.get_job(JOB_ID)["status"] == "completed"


def test_a_stale_attempt_deletes_nothing_once_another_job_of_the_profile_claimed_it(
        queues, make_worker, handler, store, raw_store, clock, s3, tmp_path):
    """B commits, then another job of the profile claims it: the profile's paths no longer say what B
    committed, so the stale attempt keeps every object it wrote."""
    hits = []

    def b_commits_then_a_retrain_claims():
        if not hits:
            hits.append(commit_as_b(raw_store, clock, tmp_path, same_as_ours=set()))
            other = "665f1c2e9b1e8a0012ab0001"
            raw_store.submit({"_id": other, "profileId": PROFILE_ID, "environment": "production"},
                             {"_id": PROFILE_ID})
            assert raw_store.claim(other, owner="worker-c", token="token-c", lease_s=3600).outcome == "claimed"

    store.faults["write_paths"] = b_commits_then_a_retrain_claims
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() != "ack"
    b_keys = {uri.removeprefix(f"s3://{BUCKET}/") for uri in hits[0].values()}
    ours = keys_in_bucket(s3) - b_keys
    assert len(ours) == 5, "the stale attempt's objects were deleted though nothing proves them unreferenced"
