"""The artifacts: content-addressed keys, local checks, conditional checksummed uploads to (moto) S3 that
never replace an object, guarded by the caller's proof of its claim."""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import zlib
from collections import Counter
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from pipeline.errors import StageFailed
from pipeline.files import FileIdentity
from pipeline.manifest import Recorded
from tests.support import ARTIFACT_KEYS as ASSET_NAMES
from tests.support import CountingHashlib
from worker.core.errors import LeaseLost
from worker.voice.artifacts import (
    ArtifactUploader,
    artifact_key,
    job_key_prefix,
    object_matches,
    stale_leftovers,
    unreferenced,
    verify_local,
)
from worker.voice.errors import StorageError
from worker.voice.records.models import read_job

BUCKET = "voice-artifacts"
MIB = 1024 * 1024
COUNTED = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
           "HeadObject", "AbortMultipartUpload", "ListObjectsV2")
SHA = "ab" * 32
LONG_AGO_NS = 1_600_000_000 * 10**9


@pytest.fixture
def s3(aws):
    """A moto-backed S3 client with the bucket (shadows the handler tests' recording one)."""
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def calls(s3) -> Counter:
    """Counts the S3 operations the client makes, by name."""
    counter: Counter = Counter()

    def count(model, **_kwargs):
        counter[model.name] += 1

    for op in COUNTED:
        s3.meta.events.register(f"before-call.s3.{op}", count)
    return counter


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def small_parts_uploader(s3, **options) -> ArtifactUploader:
    # 5 MiB is S3's smallest allowed part, so an 11 MiB file becomes three parts.
    return ArtifactUploader(
        s3, BUCKET, multipart_threshold_bytes=5 * MIB, multipart_chunk_bytes=5 * MIB, **options
    )


def five_files(root: Path) -> dict[str, Path]:
    return {name: write(root / f"{name}.bin", f"{name} bytes".encode()) for name in ASSET_NAMES}


def key_under(prefix: str):
    """A key_for callable: ``<prefix>/<sha256>/<relative path>``."""
    return lambda sha256_hex, rel: f"{prefix}/{sha256_hex}/{rel}"


def upload(uploader: ArtifactUploader, root: Path, rel: str, prefix: str = "k", **guards):
    return uploader.upload(root, rel, lambda sha256_hex: f"{prefix}/{sha256_hex}/{rel}", **guards)


def body(s3, key: str) -> bytes:
    return s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def headers_of(s3, operation: str) -> list[dict]:
    """The HTTP headers of each ``operation`` request the client sends, as a list filled in later."""
    seen: list[dict] = []
    s3.meta.events.register(f"before-call.s3.{operation}", lambda params, **_: seen.append(dict(params["headers"])))
    return seen


def other_client():
    """A second client on the same (moto) S3 that the test's hooks do not see: another worker."""
    return boto3.client("s3", region_name="us-east-1")


def fail_on_call(number: int, exc: Exception):
    """A guard that passes ``number - 1`` times, then raises ``exc`` every time; counts its calls."""
    calls = []

    def guard():
        calls.append(1)
        if len(calls) >= number:
            raise exc

    guard.calls = calls
    return guard


# ---------------------------------------------------------------- keys


def test_key_with_prefix():
    """The key is prefix/environment/profile/job/sha256/relative path."""
    key = artifact_key("models", "production", "p1", "j1", SHA, "full/model.pth")
    assert key == f"models/production/p1/j1/{SHA}/full/model.pth"


def test_key_without_prefix_has_no_leading_slash():
    """An empty prefix adds nothing, not a leading '/'."""
    key = artifact_key("", "staging", "p1", "j1", SHA, "light/model.onnx")
    assert key == f"staging/p1/j1/{SHA}/light/model.onnx"


def test_key_never_has_double_slashes():
    """Slashes around the prefix and inside the path collapse to single separators."""
    key = artifact_key("/a//b/", "development", "p1", "j1", SHA, "./full//config.json")
    assert key == f"a/b/development/p1/j1/{SHA}/full/config.json"


def test_every_key_of_a_job_is_under_its_job_prefix():
    """The job's key prefix ends with its id and a slash, and every artifact key of the job starts with it."""
    prefix = job_key_prefix("models", "production", "p1", "j1")
    assert prefix == "models/production/p1/j1/"
    assert artifact_key("models", "production", "p1", "j1", SHA, "full/model.pth").startswith(prefix)


@pytest.mark.parametrize("sha", ["", "AB" * 32, "ab" * 31, "../" + "a" * 61, "g" * 64])
def test_key_rejects_a_digest_that_is_not_sha256_hex(sha):
    """The content part of the key is exactly 64 lower-case hex digits."""
    with pytest.raises(ValueError):
        artifact_key("models", "production", "p1", "j1", sha, "full/model.pth")


@pytest.mark.parametrize(
    "relative", ["/etc/passwd", "../other/model.pth", "full/../../x", "", ".", "a\\b"]
)
def test_key_rejects_paths_outside_the_output_dir(relative):
    """Absolute, climbing or empty relative paths are refused with ValueError."""
    with pytest.raises(ValueError):
        artifact_key("models", "production", "p1", "j1", SHA, relative)


@pytest.mark.parametrize(
    ("env", "profile", "job"),
    [("prod/x", "p", "j"), ("production", "..", "j"), ("production", "p", "a/b"), ("", "p", "j")],
)
def test_key_rejects_unsafe_parts(env, profile, job):
    """Environment, profile and job ids that are not safe names are refused."""
    with pytest.raises(ValueError):
        artifact_key("", env, profile, job, SHA, "full/model.pth")


# ---------------------------------------------------------------- local verification


def test_verify_local_accepts_five_non_empty_files(tmp_path):
    """Five non-empty regular files pass."""
    verify_local(tmp_path, five_files(tmp_path))


def test_verify_local_names_a_missing_asset(tmp_path):
    """A missing file fails with the asset's name and 'missing'."""
    files = five_files(tmp_path)
    files["speakerEmbeddings"].unlink()
    with pytest.raises(StageFailed, match=r"speakerEmbeddings \(.*\): missing"):
        verify_local(tmp_path, files)


def test_verify_local_names_an_empty_asset(tmp_path):
    """An empty file fails with the asset's name and 'empty'."""
    files = five_files(tmp_path)
    files["lightConfig"].write_bytes(b"")
    with pytest.raises(StageFailed, match=r"lightConfig \(.*\): empty"):
        verify_local(tmp_path, files)


def test_verify_local_rejects_a_directory(tmp_path):
    """A directory where a model file should be is not a regular file."""
    files = five_files(tmp_path)
    files["fullModel"].unlink()
    files["fullModel"].mkdir()
    with pytest.raises(StageFailed, match=r"fullModel \(.*\): not a regular file"):
        verify_local(tmp_path, files)


def test_verify_local_rejects_a_symlink(tmp_path):
    """A symlink (which could point anywhere on the host) is not accepted as a trained output."""
    files = five_files(tmp_path)
    files["fullConfig"].unlink()
    files["fullConfig"].symlink_to(files["fullModel"])
    with pytest.raises(StageFailed, match=r"fullConfig \(.*\): not a regular file"):
        verify_local(tmp_path, files)


def test_verify_local_rejects_a_file_reached_through_a_symlinked_directory(tmp_path):
    """output/full linked to a directory outside the job makes the real files inside it not outputs."""
    outside = tmp_path / "outside"
    write(outside / "model.pth", b"someone else's file")
    output = tmp_path / "output"
    output.mkdir()
    (output / "full").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StageFailed, match=r"fullModel \(.*\): reached through a symbolic link \(full\)"):
        verify_local(output, {"fullModel": output / "full" / "model.pth"})


def test_verify_local_rejects_a_file_outside_the_output_dir(tmp_path):
    """A path that is not under the output directory is refused, whatever it holds."""
    stray = write(tmp_path / "elsewhere" / "model.pth", b"x")
    with pytest.raises(StageFailed, match="outside the output directory"):
        verify_local(tmp_path / "output", {"fullModel": stray})


def test_verify_local_reports_every_bad_asset(tmp_path):
    """Two bad files give one error naming both."""
    files = five_files(tmp_path)
    files["fullModel"].unlink()
    files["lightModel"].write_bytes(b"")
    with pytest.raises(StageFailed) as info:
        verify_local(tmp_path, files)
    assert "fullModel" in str(info.value) and "lightModel" in str(info.value)


# ---------------------------------------------------------------- uploads


def test_upload_stores_bytes_with_sha256_under_their_digest(s3, tmp_path):
    """An upload keys the object by its SHA-256, and stores the bytes with their sha256 and a CRC32 transfer checksum."""
    data = os.urandom(4096)
    write(tmp_path / "full/model.pth", data)
    digest = hashlib.sha256(data).hexdigest()
    stored = upload(ArtifactUploader(s3, BUCKET), tmp_path, "full/model.pth", prefix="p/j")
    assert stored.key == f"p/j/{digest}/full/model.pth" and stored.written
    assert stored.uri == f"s3://{BUCKET}/p/j/{digest}/full/model.pth"
    head = s3.head_object(Bucket=BUCKET, Key=stored.key, ChecksumMode="ENABLED")
    assert head["Metadata"]["sha256"] == digest
    assert head["ChecksumCRC32"] == base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    assert body(s3, stored.key) == data


def test_every_write_is_conditional_on_no_object_at_the_key(s3, tmp_path):
    """PutObject and CompleteMultipartUpload both carry If-None-Match: *, so no write replaces an object."""
    write(tmp_path / "small.json", b"{}")
    write(tmp_path / "big.pth", os.urandom(11 * MIB))
    puts, completes = headers_of(s3, "PutObject"), headers_of(s3, "CompleteMultipartUpload")
    uploader = small_parts_uploader(s3)
    upload(uploader, tmp_path, "small.json")
    upload(uploader, tmp_path, "big.pth")
    assert [h.get("If-None-Match") for h in puts] == ["*"]
    assert [h.get("If-None-Match") for h in completes] == ["*"]


def test_reupload_of_same_file_sends_nothing(s3, calls, tmp_path):
    """A second upload of unchanged bytes only lists and checks the object: no PutObject, no parts."""
    write(tmp_path / "config.json", b'{"sample_rate": 22050}')
    uploader = ArtifactUploader(s3, BUCKET)
    first = upload(uploader, tmp_path, "config.json")
    assert calls["PutObject"] == 1
    calls.clear()
    again = upload(uploader, tmp_path, "config.json")
    assert again.uri == first.uri and not again.written
    assert calls == Counter({"ListObjectsV2": 1, "HeadObject": 1})


def test_changed_bytes_go_to_a_new_key_and_leave_the_old_object(s3, calls, tmp_path):
    """Same size, different bytes: a new key is written and the first object keeps its bytes."""
    path = write(tmp_path / "model.pth", b"A" * 1000)
    uploader = ArtifactUploader(s3, BUCKET)
    first = upload(uploader, tmp_path, "model.pth")
    path.write_bytes(b"B" * 1000)
    second = upload(uploader, tmp_path, "model.pth")
    assert calls["PutObject"] == 2 and first.key != second.key
    assert body(s3, first.key) == b"A" * 1000 and body(s3, second.key) == b"B" * 1000


def test_an_object_already_at_the_key_with_other_bytes_is_never_replaced(s3, calls, tmp_path):
    """An object at the key without our recorded sha256 is not trusted and not overwritten: StorageError."""
    data = b"same bytes"
    write(tmp_path / "model.pth", data)
    key = f"k/{hashlib.sha256(data).hexdigest()}/model.pth"
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"foreign")
    calls.clear()
    with pytest.raises(StorageError, match="already holds other bytes"):
        upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth")
    assert body(s3, key) == b"foreign"


def test_a_put_that_loses_the_race_to_the_same_bytes_reuses_the_winner(s3, tmp_path):
    """Another writer storing the same bytes between our check and our put: the 412 is read as a reuse."""
    data = b"model bytes"
    write(tmp_path / "model.pth", data)
    digest = hashlib.sha256(data).hexdigest()
    rival = other_client()

    def rival_first(**_kwargs):
        rival.put_object(Bucket=BUCKET, Key=f"k/{digest}/model.pth", Body=data, Metadata={"sha256": digest})

    s3.meta.events.register_first("before-call.s3.PutObject", rival_first)
    stored = upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth")
    assert not stored.written and body(s3, stored.key) == data


def test_a_put_that_loses_the_race_to_other_bytes_fails_and_keeps_them(s3, tmp_path):
    """A late conditional put to a key another writer filled with other bytes fails; theirs stay."""
    write(tmp_path / "model.pth", b"our bytes")
    digest = hashlib.sha256(b"our bytes").hexdigest()
    rival = other_client()

    def rival_first(**_kwargs):
        rival.put_object(Bucket=BUCKET, Key=f"k/{digest}/model.pth", Body=b"their bytes")

    s3.meta.events.register_first("before-call.s3.PutObject", rival_first)
    with pytest.raises(StorageError, match="already holds other bytes"):
        upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth")
    assert body(s3, f"k/{digest}/model.pth") == b"their bytes"


def test_large_file_goes_multipart_then_is_reused(s3, calls, tmp_path):
    """A file above the threshold goes in CRC32-checked parts, with whole-file sha256, then is reused."""
    data = os.urandom(11 * MIB)
    write(tmp_path / "big.pth", data)
    algorithms = []
    s3.meta.events.register(
        "before-call.s3.UploadPart",
        lambda params, **_: algorithms.append(params["headers"]["x-amz-sdk-checksum-algorithm"]),
    )
    uploader = small_parts_uploader(s3)
    stored = upload(uploader, tmp_path, "big.pth")
    assert algorithms == ["CRC32"] * 3
    assert calls["CreateMultipartUpload"] == 1
    assert calls["UploadPart"] == 3
    assert calls["PutObject"] == 0
    head = s3.head_object(Bucket=BUCKET, Key=stored.key)
    assert head["ContentLength"] == len(data)
    assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert body(s3, stored.key) == data
    calls.clear()
    upload(uploader, tmp_path, "big.pth")
    assert calls == Counter({"ListObjectsV2": 1, "HeadObject": 1})


def test_a_completion_that_finds_other_bytes_at_the_key_fails_and_aborts(s3, tmp_path):
    """An object appearing at the key while the parts went up: the conditional completion fails, the upload is
    aborted and the other object is left as it is."""
    data = os.urandom(11 * MIB)
    write(tmp_path / "big.pth", data)
    key = f"k/{hashlib.sha256(data).hexdigest()}/big.pth"
    rival = other_client()

    def rival_first(**_kwargs):
        rival.put_object(Bucket=BUCKET, Key=key, Body=b"their bytes")

    s3.meta.events.register_first("before-call.s3.CompleteMultipartUpload", rival_first)
    with pytest.raises(StorageError, match="already holds other bytes"):
        upload(small_parts_uploader(s3), tmp_path, "big.pth")
    assert body(s3, key) == b"their bytes"
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_the_proof_runs_before_each_object_and_a_failed_one_writes_nothing(s3, calls, tmp_path):
    """upload_all proves the claim before each object; once the proof fails nothing more is written."""
    files = five_files(tmp_path)
    written: list[str] = []
    proof = fail_on_call(3, LeaseLost("claim taken over"))
    with pytest.raises(LeaseLost):
        ArtifactUploader(s3, BUCKET).upload_all(tmp_path, files, key_under("k"), proof=proof, written=written)
    assert calls["PutObject"] == 2 and len(proof.calls) == 3
    assert len(written) == 2 and sorted(written) == sorted(
        o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"])


def test_the_part_proof_runs_before_each_part_and_a_failed_one_aborts(s3, calls, tmp_path):
    """A part guard failing on the second part stops the multipart upload: no more parts, no object, aborted."""
    write(tmp_path / "big.pth", os.urandom(11 * MIB))
    guard = fail_on_call(2, LeaseLost("record lease past its deadline"))
    with pytest.raises(LeaseLost):
        upload(small_parts_uploader(s3, max_concurrency=1), tmp_path, "big.pth", part_proof=guard)
    assert calls["UploadPart"] == 1 and calls["CompleteMultipartUpload"] == 0
    assert calls["AbortMultipartUpload"] == 1
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET)
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_the_part_proof_runs_before_a_single_put_too(s3, calls, tmp_path):
    """A PUT queued behind other requests checks the lease again when it is sent: a failed check writes nothing."""
    write(tmp_path / "model.pth", b"x")
    with pytest.raises(LeaseLost):
        upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth", part_proof=fail_on_call(1, LeaseLost("lost")))
    assert calls["PutObject"] == 0
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET)


def test_a_file_rewritten_during_a_multipart_upload_is_not_completed(s3, calls, tmp_path):
    """Bytes that no longer hash to the key's digest are never completed under it: StageFailed, aborted."""
    path = write(tmp_path / "big.pth", os.urandom(11 * MIB))

    def rewrite_tail(**_kwargs):
        # After the key is named, before a part is read (parts are read ahead of their sending).
        with open(path, "r+b") as handle:
            handle.seek(-1024, os.SEEK_END)
            handle.write(b"\0" * 1024)

    s3.meta.events.register("before-call.s3.CreateMultipartUpload", rewrite_tail)
    with pytest.raises(StageFailed, match="changed while it was uploaded"):
        upload(small_parts_uploader(s3, max_concurrency=1), tmp_path, "big.pth")
    assert calls["CompleteMultipartUpload"] == 0
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_missing_bucket_raises_storage_error(s3, tmp_path):
    """Uploading to a bucket that does not exist is a StorageError with the cause chained."""
    write(tmp_path / "model.pth", b"x")
    with pytest.raises(StorageError, match="no-such-bucket") as info:
        upload(ArtifactUploader(s3, "no-such-bucket"), tmp_path, "model.pth")
    assert info.value.__cause__ is not None
    assert info.value.retryable


def test_failed_part_raises_storage_error_and_leaves_no_object(s3, tmp_path):
    """A network failure mid-multipart is a StorageError; no object and no open upload remain."""
    write(tmp_path / "big.pth", os.urandom(11 * MIB))

    def fail_second_part(params, **_kwargs):
        # before-call sees the serialized request: the part number is in its query string.
        if params["query_string"].get("partNumber") == 2:
            url = "https://s3.example/k?partNumber=2&uploadId=SECRET"
            raise EndpointConnectionError(endpoint_url=url)

    s3.meta.events.register("before-call.s3.UploadPart", fail_second_part)
    uploader = small_parts_uploader(s3)
    with pytest.raises(StorageError) as info:
        upload(uploader, tmp_path, "big.pth")
    assert "SECRET" not in str(info.value)
    assert "big.pth" in str(info.value)
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET)
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_refused_put_raises_storage_error(s3, tmp_path):
    """A PutObject S3 refuses becomes a StorageError."""
    write(tmp_path / "model.pth", b"x")

    def refuse(**_kwargs):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "PutObject")

    s3.meta.events.register("before-call.s3.PutObject", refuse)
    with pytest.raises(StorageError, match="AccessDenied"):
        upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth")


def test_head_failure_other_than_404_raises_storage_error(s3, tmp_path):
    """A refused HeadObject (403) of a listed key is an error, not a reason to write the object again."""
    write(tmp_path / "model.pth", b"x")
    upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth")

    def forbid(**_kwargs):
        raise ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadObject")

    s3.meta.events.register("before-call.s3.HeadObject", forbid)
    with pytest.raises(StorageError, match="403"):
        upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth")


def test_a_refused_listing_raises_storage_error_and_writes_nothing(s3, calls, tmp_path):
    """A refused ListObjectsV2 is an error, not a reason to assume no object is stored."""
    write(tmp_path / "model.pth", b"x")

    def forbid(**_kwargs):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "ListObjectsV2")

    s3.meta.events.register("before-call.s3.ListObjectsV2", forbid)
    with pytest.raises(StorageError, match="listing .*AccessDenied"):
        upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth")
    assert calls["PutObject"] == 0


def test_missing_local_file_is_stage_failed(s3, tmp_path):
    """A local artifact that vanished before upload is reported as a failed output, not a crash."""
    with pytest.raises(StageFailed, match="cannot be uploaded: missing"):
        upload(ArtifactUploader(s3, BUCKET), tmp_path, "gone.pth")


def test_a_file_behind_a_symlinked_directory_is_never_uploaded(s3, calls, tmp_path):
    """The uploader reads through the same no-follow rule: output/full -> outside sends nothing."""
    outside = tmp_path / "outside"
    write(outside / "model.pth", b"host secrets")
    output = tmp_path / "output"
    output.mkdir()
    (output / "full").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StageFailed, match="symbolic link"):
        upload(ArtifactUploader(s3, BUCKET), output, "full/model.pth")
    assert calls == Counter()


def test_upload_all_returns_uris_in_fixed_order(s3, tmp_path):
    """upload_all uploads every asset and returns asset -> URI in the five assets' fixed order."""
    files = five_files(tmp_path)
    reversed_files = dict(reversed(list(files.items())))
    uris = ArtifactUploader(s3, BUCKET).upload_all(tmp_path, reversed_files, key_under("m"))
    assert list(uris) == list(ASSET_NAMES)
    digest = hashlib.sha256(b"fullModel bytes").hexdigest()
    assert uris["fullModel"] == f"s3://{BUCKET}/m/{digest}/fullModel.bin"
    for name, uri in uris.items():
        assert body(s3, uri.removeprefix(f"s3://{BUCKET}/")) == f"{name} bytes".encode()


def test_upload_all_refuses_a_file_outside_the_output_dir_before_any_upload(s3, calls, tmp_path):
    """An asset path that is not under the output directory is a failed output, caught before S3 is asked."""
    stray = write(tmp_path / "elsewhere" / "fullModel.bin", b"x")
    with pytest.raises(StageFailed, match="outside the output directory"):
        ArtifactUploader(s3, BUCKET).upload_all(tmp_path / "output", {"fullModel": stray}, key_under("m"))
    assert calls == Counter()


def test_key_of_reads_only_this_buckets_uris(s3):
    """key_of gives the key of an s3:// URI in the uploader's bucket, None for another bucket or scheme."""
    uploader = ArtifactUploader(s3, BUCKET)
    assert uploader.key_of(f"s3://{BUCKET}/a/b.pth") == "a/b.pth"
    assert uploader.key_of("s3://other/a/b.pth") is None
    assert uploader.key_of(f"https://{BUCKET}/a/b.pth") is None
    assert uploader.key_of(f"s3://{BUCKET}/") is None


def test_object_matches_needs_both_sha_and_size():
    """Reuse requires the recorded sha256 and the size to both match."""
    head = {"Metadata": {"sha256": "ab"}, "ContentLength": 3}
    assert object_matches(head, "ab", 3)
    assert not object_matches(head, "ab", 4)
    assert not object_matches(head, "cd", 3)
    assert not object_matches({"ContentLength": 3}, "ab", 3)
    assert not object_matches(None, "ab", 3)


def test_cleanup_keeps_every_referenced_key():
    """unreferenced lists, in order, the keys no committed path names."""
    assert unreferenced(["a", "b", "c"], ["b"]) == ["a", "c"]
    assert unreferenced(["a"], ["a"]) == []


@pytest.mark.parametrize("status", ["processing", "error", "cancelled", None])
def test_a_stale_attempt_deletes_nothing_before_the_job_is_committed(status):
    """Until the job record says completed, a stale attempt keeps what it wrote (the holder cleans up)."""
    assert stale_leftovers(["a"], read_job({"status": status}) if status else None, []) == []


def test_a_stale_attempt_never_deletes_a_key_the_committed_profile_names():
    """Once committed, a stale attempt deletes only its keys the committed paths do not name."""
    assert stale_leftovers(["same-bytes", "own"], read_job({"status": "completed"}), ["same-bytes", "x"]) == ["own"]


# ---------------------------------------------------------------- the five together, hashed once


@pytest.fixture
def hashing(monkeypatch) -> CountingHashlib:
    import pipeline.files
    import worker.voice.artifacts

    counting = CountingHashlib()
    monkeypatch.setattr(worker.voice.artifacts, "hashlib", counting)
    monkeypatch.setattr(pipeline.files, "hashlib", counting)
    return counting


def mixed_files(root: Path) -> dict[str, Path]:
    """Two files above the small-parts threshold (three and two parts), three below it."""
    sizes = {"fullModel": 11 * MIB, "lightModel": 6 * MIB, "fullConfig": 300, "speakerEmbeddings": 4 * MIB,
             "lightConfig": 100}
    return {name: write(root / f"{name}.bin", os.urandom(size)) for name, size in sizes.items()}


def recorded_for(root: Path, files: dict[str, Path], *, settled: bool = False) -> dict[str, Recorded]:
    """What the stage manifests would record for the files by path under ``root``: (sha256, size), and with
    ``settled`` each file's identity, its modification time first set far back (as a file written long
    before its hashing), so that any later write shows in the identity."""
    recorded = {}
    for path in files.values():
        if settled:
            os.utime(path, ns=(LONG_AGO_NS, LONG_AGO_NS))
        identity = FileIdentity.of(os.stat(path)) if settled else None
        recorded[path.relative_to(root).as_posix()] = Recorded(
            hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size, identity)
    return recorded


def test_the_five_files_go_up_at_once(s3, tmp_path):
    """Each file's second part is held until all five files have sent their first: they all get there."""
    files = {name: write(tmp_path / f"{name}.bin", os.urandom(6 * MIB)) for name in ASSET_NAMES}
    begun: set[str] = set()
    all_begun = threading.Event()
    held_until_all_begun: list[bool] = []
    lock = threading.Lock()

    def gate(params, **_kwargs):
        query = params["query_string"]
        if query.get("partNumber") == 1:
            with lock:
                begun.add(query["uploadId"])
                if len(begun) == len(ASSET_NAMES):
                    all_begun.set()
        else:
            held_until_all_begun.append(all_begun.wait(timeout=5))

    s3.meta.events.register("before-call.s3.UploadPart", gate)
    uris = small_parts_uploader(s3).upload_all(tmp_path, files, key_under("k"))
    assert held_until_all_begun == [True] * len(ASSET_NAMES)
    for name, uri in uris.items():
        assert body(s3, uri.removeprefix(f"s3://{BUCKET}/")) == files[name].read_bytes()


def test_one_pool_bounds_the_requests_of_every_file_and_call(s3, tmp_path):
    """Over all files and two calls, at most max_concurrency writes are in flight, on as many threads."""
    files = mixed_files(tmp_path / "a")
    more = mixed_files(tmp_path / "b")
    threads, in_flight, most = set(), [0], [0]
    lock = threading.Lock()

    def began(**_kwargs):
        with lock:
            threads.add(threading.current_thread())
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])

    def ended(**_kwargs):
        with lock:
            in_flight[0] -= 1

    for op in ("PutObject", "UploadPart", "CompleteMultipartUpload"):
        s3.meta.events.register(f"before-call.s3.{op}", began)
        s3.meta.events.register(f"after-call.s3.{op}", ended)
    uploader = small_parts_uploader(s3, max_concurrency=3)
    uploader.upload_all(tmp_path / "a", files, key_under("a"))
    uploader.upload_all(tmp_path / "b", more, key_under("b"))
    assert 1 < most[0] <= 3
    assert len(threads) <= 3


def test_one_listing_finds_what_is_stored_and_only_listed_keys_are_checked(s3, calls, tmp_path):
    """A first upload lists once and checks no key; a retry lists once and checks only the keys it found."""
    files = five_files(tmp_path)
    uploader = ArtifactUploader(s3, BUCKET)
    uris = uploader.upload_all(tmp_path, files, key_under("k"))
    assert calls == Counter({"ListObjectsV2": 1, "PutObject": 5})
    s3.delete_object(Bucket=BUCKET, Key=uris["lightModel"].removeprefix(f"s3://{BUCKET}/"))
    calls.clear()
    written: list[str] = []
    assert uploader.upload_all(tmp_path, files, key_under("k"), written=written) == uris
    assert calls == Counter({"ListObjectsV2": 1, "HeadObject": 4, "PutObject": 1})
    assert written == [uris["lightModel"].removeprefix(f"s3://{BUCKET}/")]


def test_a_listed_key_of_another_size_fails_before_anything_is_sent(s3, calls, tmp_path):
    """An object of another size at the key cannot hold the bytes: StorageError, no part sent, object kept."""
    data = os.urandom(11 * MIB)
    write(tmp_path / "big.pth", data)
    key = f"k/{hashlib.sha256(data).hexdigest()}/big.pth"
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"foreign")
    calls.clear()
    with pytest.raises(StorageError, match="already holds other bytes"):
        upload(small_parts_uploader(s3), tmp_path, "big.pth")
    assert calls == Counter({"ListObjectsV2": 1})
    assert body(s3, key) == b"foreign"


def test_a_listed_key_of_the_right_size_is_reused_only_if_its_sha256_matches(s3, calls, tmp_path):
    """The listing's size is not enough: an object of the same size without our sha256 fails unsent."""
    data = b"same bytes"
    write(tmp_path / "model.pth", data)
    key = f"k/{hashlib.sha256(data).hexdigest()}/model.pth"
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"SAME BYTES", Metadata={"sha256": SHA})
    calls.clear()
    with pytest.raises(StorageError, match="already holds other bytes"):
        upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth")
    assert calls == Counter({"ListObjectsV2": 1, "HeadObject": 1})
    assert body(s3, key) == b"SAME BYTES"


def test_each_file_is_hashed_once_when_its_digest_is_recorded(s3, hashing, tmp_path):
    """With the manifests' digests but no identities, the upload hashes every byte once (as it is sent), and a retry none."""
    files = mixed_files(tmp_path)
    recorded = recorded_for(tmp_path, files)
    uploader = small_parts_uploader(s3)
    uris = uploader.upload_all(tmp_path, files, key_under("k"), recorded=recorded)
    assert hashing.hashed_bytes == sum(entry.size for entry in recorded.values())
    hashing.hashed_bytes = 0
    assert uploader.upload_all(tmp_path, files, key_under("k"), recorded=recorded) == uris
    assert hashing.hashed_bytes == 0
    for name, uri in uris.items():
        assert uri.endswith(f"/{recorded[f'{name}.bin'].sha256}/{name}.bin")
        assert body(s3, uri.removeprefix(f"s3://{BUCKET}/")) == files[name].read_bytes()


@pytest.mark.parametrize("size", [1000, 11 * MIB], ids=["single PUT", "multipart"])
def test_bytes_that_do_not_hash_to_the_recorded_digest_are_never_stored(s3, calls, tmp_path, size):
    """A file whose bytes are not the ones its manifest recorded is refused: StageFailed, no object, aborted."""
    write(tmp_path / "model.pth", os.urandom(size))
    recorded = Recorded(hashlib.sha256(b"other bytes").hexdigest(), size)
    with pytest.raises(StageFailed, match="changed while it was uploaded"):
        upload(small_parts_uploader(s3), tmp_path, "model.pth", recorded=recorded)
    assert calls["PutObject"] == calls["CompleteMultipartUpload"] == 0
    assert calls["AbortMultipartUpload"] == calls["CreateMultipartUpload"]
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET)
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_a_file_rewritten_after_its_digest_was_recorded_is_not_completed(s3, calls, tmp_path):
    """Bytes changed while the parts go up (after the recorded digest named the key) are never completed."""
    path = write(tmp_path / "big.pth", os.urandom(16 * MIB))
    recorded = recorded_for(tmp_path, {"fullModel": path})["big.pth"]

    def rewrite_tail(**_kwargs):
        with open(path, "r+b") as handle:
            handle.seek(-1024, os.SEEK_END)
            handle.write(b"\0" * 1024)

    s3.meta.events.register("before-call.s3.CreateMultipartUpload", rewrite_tail)
    with pytest.raises(StageFailed, match="changed while it was uploaded"):
        upload(small_parts_uploader(s3), tmp_path, "big.pth", recorded=recorded)
    assert calls["CompleteMultipartUpload"] == 0 and calls["AbortMultipartUpload"] == 1
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_a_file_still_showing_its_recorded_identity_is_sent_without_being_read_twice(s3, hashing, tmp_path):
    """With each file's identity recorded and unchanged, the upload hashes nothing and stores the bytes."""
    files = mixed_files(tmp_path)
    recorded = recorded_for(tmp_path, files, settled=True)
    uris = small_parts_uploader(s3).upload_all(tmp_path, files, key_under("k"), recorded=recorded)
    assert hashing.hashed_bytes == 0
    for name, uri in uris.items():
        assert uri.endswith(f"/{recorded[f'{name}.bin'].sha256}/{name}.bin")
        assert body(s3, uri.removeprefix(f"s3://{BUCKET}/")) == files[name].read_bytes()


@pytest.mark.parametrize("size", [1000, 11 * MIB], ids=["single PUT", "multipart"])
def test_a_file_written_after_its_identity_was_recorded_is_hashed_and_refused(s3, calls, tmp_path, size):
    """Another identity than the recorded one sends the file down the hashing path: other bytes are refused."""
    path = write(tmp_path / "model.pth", os.urandom(size))
    recorded = recorded_for(tmp_path, {"fullModel": path}, settled=True)["model.pth"]
    path.write_bytes(os.urandom(size))
    with pytest.raises(StageFailed, match="changed while it was uploaded"):
        upload(small_parts_uploader(s3), tmp_path, "model.pth", recorded=recorded)
    assert calls["PutObject"] == calls["CompleteMultipartUpload"] == 0
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET)
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


@pytest.mark.parametrize("when", ["CreateMultipartUpload", "UploadPart"])
def test_a_file_written_while_its_unread_parts_go_up_is_never_completed(s3, calls, tmp_path, when):
    """A write during the upload of a file trusted by its identity changes the identity: never completed."""
    path = write(tmp_path / "big.pth", os.urandom(16 * MIB))
    recorded = recorded_for(tmp_path, {"fullModel": path}, settled=True)["big.pth"]

    def rewrite_tail(**_kwargs):
        with open(path, "r+b") as handle:
            handle.seek(-1024, os.SEEK_END)
            handle.write(b"\0" * 1024)

    s3.meta.events.register(f"before-call.s3.{when}", rewrite_tail)
    with pytest.raises(StageFailed, match="changed while it was uploaded"):
        upload(small_parts_uploader(s3), tmp_path, "big.pth", recorded=recorded)
    assert calls["CompleteMultipartUpload"] == 0 and calls["AbortMultipartUpload"] == 1
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_a_recorded_size_that_is_not_the_files_fails_before_s3_is_asked(s3, calls, tmp_path):
    """A file whose size is not the recorded one has changed since its stage: StageFailed, no request."""
    write(tmp_path / "model.pth", b"12345")
    with pytest.raises(StageFailed, match="changed since its stage recorded it"):
        upload(ArtifactUploader(s3, BUCKET), tmp_path, "model.pth", recorded=Recorded(SHA, 4))
    assert calls == Counter()


def test_a_failed_file_aborts_the_others_and_written_names_what_landed(s3, tmp_path):
    """One file's failed part stops them all: every open multipart upload is aborted, written is exact."""
    files = mixed_files(tmp_path)

    def fail_light_model(params, **_kwargs):
        if "lightModel" in params["url_path"] and params["query_string"].get("partNumber") == 2:
            raise EndpointConnectionError(endpoint_url="https://s3.example/k")

    s3.meta.events.register("before-call.s3.UploadPart", fail_light_model)
    written: list[str] = []
    with pytest.raises(StorageError, match="lightModel.bin"):
        small_parts_uploader(s3).upload_all(tmp_path, files, key_under("k"), written=written)
    stored = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents") or []}
    assert sorted(written) == sorted(stored)
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_an_object_that_lands_after_a_failed_proof_is_still_named_in_written(s3, tmp_path):
    """A completion in flight when a later proof fails still lands, and written names it for the cleanup."""
    files = {"fullModel": write(tmp_path / "model.pth", os.urandom(6 * MIB)),
             "fullConfig": write(tmp_path / "config.json", b"{}"),
             "speakerEmbeddings": write(tmp_path / "speakers.pth", b"s")}
    completing, proof_failed = threading.Event(), threading.Event()

    def hold_the_completion(**_kwargs):
        completing.set()
        assert proof_failed.wait(timeout=5)

    proofs = []

    def proof():
        proofs.append(1)
        if len(proofs) == 3:  # the third object's: fails while the first one's completion is in flight
            assert completing.wait(timeout=5)
            proof_failed.set()
            raise LeaseLost("claim taken over")

    def after_the_completion_began(**_kwargs):
        assert completing.wait(timeout=5)  # so the third proof comes once the completion is in flight

    s3.meta.events.register("before-call.s3.CompleteMultipartUpload", hold_the_completion)
    s3.meta.events.register("before-call.s3.PutObject", after_the_completion_began)
    written: list[str] = []
    with pytest.raises(LeaseLost):
        small_parts_uploader(s3).upload_all(tmp_path, files, key_under("k"), proof=proof, written=written)
    stored = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"])
    assert len(stored) == 2 and sorted(written) == stored


def test_the_next_object_begins_only_once_the_first_write_of_the_one_before_returned(s3, tmp_path):
    """No object's proof runs while the object before it is still sending its first write."""
    files = five_files(tmp_path)
    proofs, second_proof = [], threading.Event()
    proved_during_first_put: list[bool] = []

    def proof():
        proofs.append(1)
        if len(proofs) == 2:
            second_proof.set()

    def first_put(**_kwargs):
        if not proved_during_first_put:
            # Waits briefly for a proof that must not come: the next object waits for this PUT.
            proved_during_first_put.append(second_proof.wait(timeout=0.5))

    s3.meta.events.register("before-call.s3.PutObject", first_put)
    ArtifactUploader(s3, BUCKET).upload_all(tmp_path, files, key_under("k"), proof=proof)
    assert proved_during_first_put == [False] and len(proofs) == len(ASSET_NAMES)


def test_between_beginnings_the_largest_file_is_read_first(s3, tmp_path, monkeypatch):
    """One request at a time: each file begins in order, then the largest goes, then the rest in order."""
    import worker.voice.artifacts

    monkeypatch.setattr(worker.voice.artifacts, "READ_AHEAD_PARTS", 0)
    files = {"fullModel": write(tmp_path / "a.pth", os.urandom(11 * MIB)),
             "speakerEmbeddings": write(tmp_path / "b.pth", os.urandom(11 * MIB)),
             "lightModel": write(tmp_path / "c.onnx", os.urandom(31 * MIB))}
    sent: list[str] = []
    s3.meta.events.register("before-call.s3.UploadPart", lambda params, **_: sent.append(
        params["url_path"].rsplit("/", 1)[-1][0] + str(params["query_string"]["partNumber"])))
    small_parts_uploader(s3, max_concurrency=1).upload_all(tmp_path, files, key_under("k"))
    assert sent == ["a1", "b1", "c1", "c2", "c3", "c4", "c5", "c6", "c7", "a2", "a3", "b2", "b3"]
