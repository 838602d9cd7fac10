"""The artifacts: deterministic keys, local checks, idempotent checksummed uploads to (moto) S3."""

from __future__ import annotations

import base64
import hashlib
import os
from collections import Counter
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from worker.voice.artifacts import (
    ArtifactUploader,
    artifact_key,
    object_matches,
    verify_local,
)
from worker.core.errors import StageFailed, StorageError
from worker.voice.store import ASSET_KEYS as ASSET_NAMES

BUCKET = "voice-artifacts"
MIB = 1024 * 1024
COUNTED = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
           "HeadObject")


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


def small_parts_uploader(s3) -> ArtifactUploader:
    # 5 MiB is S3's smallest allowed part, so an 11 MiB file becomes three parts.
    return ArtifactUploader(
        s3, BUCKET, multipart_threshold_bytes=5 * MIB, multipart_chunk_bytes=5 * MIB
    )


def five_files(root: Path) -> dict[str, Path]:
    return {name: write(root / f"{name}.bin", f"{name} bytes".encode()) for name in ASSET_NAMES}


# ---------------------------------------------------------------- keys


def test_key_with_prefix():
    """The key is prefix/environment/profile/job/relative path."""
    key = artifact_key("models", "production", "p1", "j1", "full/model.pth")
    assert key == "models/production/p1/j1/full/model.pth"


def test_key_without_prefix_has_no_leading_slash():
    """An empty prefix adds nothing, not a leading '/'."""
    key = artifact_key("", "staging", "p1", "j1", "light/model.onnx")
    assert key == "staging/p1/j1/light/model.onnx"


def test_key_never_has_double_slashes():
    """Slashes around the prefix and inside the path collapse to single separators."""
    key = artifact_key("/a//b/", "development", "p1", "j1", "./full//config.json")
    assert key == "a/b/development/p1/j1/full/config.json"


@pytest.mark.parametrize(
    "relative", ["/etc/passwd", "../other/model.pth", "full/../../x", "", ".", "a\\b"]
)
def test_key_rejects_paths_outside_the_output_dir(relative):
    """Absolute, climbing or empty relative paths are refused with ValueError."""
    with pytest.raises(ValueError):
        artifact_key("models", "production", "p1", "j1", relative)


@pytest.mark.parametrize(
    ("env", "profile", "job"),
    [("prod/x", "p", "j"), ("production", "..", "j"), ("production", "p", "a/b"), ("", "p", "j")],
)
def test_key_rejects_unsafe_parts(env, profile, job):
    """Environment, profile and job ids that are not safe names are refused."""
    with pytest.raises(ValueError):
        artifact_key("", env, profile, job, "full/model.pth")


# ---------------------------------------------------------------- local verification


def test_verify_local_accepts_five_non_empty_files(tmp_path):
    """Five non-empty regular files pass."""
    verify_local(five_files(tmp_path))


def test_verify_local_names_a_missing_asset(tmp_path):
    """A missing file fails with the asset's name and 'missing'."""
    files = five_files(tmp_path)
    files["speakerEmbeddings"].unlink()
    with pytest.raises(StageFailed, match=r"speakerEmbeddings \(.*\): missing"):
        verify_local(files)


def test_verify_local_names_an_empty_asset(tmp_path):
    """An empty file fails with the asset's name and 'empty'."""
    files = five_files(tmp_path)
    files["lightConfig"].write_bytes(b"")
    with pytest.raises(StageFailed, match=r"lightConfig \(.*\): empty"):
        verify_local(files)


def test_verify_local_rejects_a_directory(tmp_path):
    """A directory where a model file should be is not a regular file."""
    files = five_files(tmp_path)
    files["fullModel"].unlink()
    files["fullModel"].mkdir()
    with pytest.raises(StageFailed, match=r"fullModel \(.*\): not a regular file"):
        verify_local(files)


def test_verify_local_rejects_a_symlink(tmp_path):
    """A symlink (which could point anywhere on the host) is not accepted as a trained output."""
    files = five_files(tmp_path)
    files["fullConfig"].unlink()
    files["fullConfig"].symlink_to(files["fullModel"])
    with pytest.raises(StageFailed, match=r"fullConfig \(.*\): not a regular file"):
        verify_local(files)


def test_verify_local_reports_every_bad_asset(tmp_path):
    """Two bad files give one error naming both."""
    files = five_files(tmp_path)
    files["fullModel"].unlink()
    files["lightModel"].write_bytes(b"")
    with pytest.raises(StageFailed) as info:
        verify_local(files)
    assert "fullModel" in str(info.value) and "lightModel" in str(info.value)


# ---------------------------------------------------------------- uploads


def test_upload_stores_bytes_with_sha256(s3, tmp_path):
    """An upload returns the s3:// URI and stores the bytes with their sha256 and an S3 checksum."""
    data = os.urandom(4096)
    path = write(tmp_path / "model.pth", data)
    uri = ArtifactUploader(s3, BUCKET).upload(path, "p/j/full/model.pth")
    assert uri == f"s3://{BUCKET}/p/j/full/model.pth"
    head = s3.head_object(Bucket=BUCKET, Key="p/j/full/model.pth", ChecksumMode="ENABLED")
    assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert head["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(data).digest()).decode()
    assert s3.get_object(Bucket=BUCKET, Key="p/j/full/model.pth")["Body"].read() == data


def test_reupload_of_same_file_sends_nothing(s3, calls, tmp_path):
    """A second upload of unchanged bytes only checks the object: no PutObject, no parts."""
    path = write(tmp_path / "config.json", b'{"sample_rate": 22050}')
    uploader = ArtifactUploader(s3, BUCKET)
    uploader.upload(path, "k/config.json")
    assert calls["PutObject"] == 1
    calls.clear()
    assert uploader.upload(path, "k/config.json") == f"s3://{BUCKET}/k/config.json"
    assert calls == Counter({"HeadObject": 1})


def test_changed_file_is_reuploaded(s3, calls, tmp_path):
    """Same size, different bytes: the sha256 differs, so the object is replaced."""
    path = write(tmp_path / "model.pth", b"A" * 1000)
    uploader = ArtifactUploader(s3, BUCKET)
    uploader.upload(path, "k/model.pth")
    path.write_bytes(b"B" * 1000)
    uploader.upload(path, "k/model.pth")
    assert calls["PutObject"] == 2
    assert s3.get_object(Bucket=BUCKET, Key="k/model.pth")["Body"].read() == b"B" * 1000


def test_foreign_object_without_sha256_is_replaced(s3, calls, tmp_path):
    """An object with the same bytes but no recorded sha256 is not trusted: it is uploaded again."""
    path = write(tmp_path / "model.pth", b"same bytes")
    s3.put_object(Bucket=BUCKET, Key="k/model.pth", Body=b"same bytes")
    calls.clear()
    ArtifactUploader(s3, BUCKET).upload(path, "k/model.pth")
    assert calls["PutObject"] == 1


def test_large_file_goes_multipart_then_is_reused(s3, calls, tmp_path):
    """A file above the threshold goes in SHA-256-checked parts, with whole-file sha256, then is reused."""
    data = os.urandom(11 * MIB)
    path = write(tmp_path / "big.pth", data)
    algorithms = []
    s3.meta.events.register(
        "before-call.s3.UploadPart",
        lambda params, **_: algorithms.append(params["headers"]["x-amz-sdk-checksum-algorithm"]),
    )
    uploader = small_parts_uploader(s3)
    uploader.upload(path, "k/big.pth")
    assert algorithms == ["SHA256"] * 3
    assert calls["CreateMultipartUpload"] == 1
    assert calls["UploadPart"] == 3
    assert calls["PutObject"] == 0
    head = s3.head_object(Bucket=BUCKET, Key="k/big.pth")
    assert head["ContentLength"] == len(data)
    assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
    calls.clear()
    uploader.upload(path, "k/big.pth")
    assert calls == Counter({"HeadObject": 1})


def test_missing_bucket_raises_storage_error(s3, tmp_path):
    """Uploading to a bucket that does not exist is a StorageError with the cause chained."""
    path = write(tmp_path / "model.pth", b"x")
    with pytest.raises(StorageError, match="no-such-bucket") as info:
        ArtifactUploader(s3, "no-such-bucket").upload(path, "k/model.pth")
    assert info.value.__cause__ is not None
    assert info.value.retryable


def test_failed_part_raises_storage_error_and_leaves_no_object(s3, tmp_path):
    """A network failure mid-multipart is a StorageError; no object and no open upload remain."""
    path = write(tmp_path / "big.pth", os.urandom(11 * MIB))

    def fail_second_part(params, **_kwargs):
        # before-call sees the serialized request: the part number is in its query string.
        if params["query_string"].get("partNumber") == 2:
            url = "https://s3.example/k?partNumber=2&uploadId=SECRET"
            raise EndpointConnectionError(endpoint_url=url)

    s3.meta.events.register("before-call.s3.UploadPart", fail_second_part)
    uploader = small_parts_uploader(s3)
    with pytest.raises(StorageError) as info:
        uploader.upload(path, "k/big.pth")
    assert "SECRET" not in str(info.value)
    assert "k/big.pth" in str(info.value)
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET)
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_refused_put_raises_storage_error(s3, tmp_path):
    """A PutObject S3 refuses (boto3 wraps it as S3UploadFailedError) becomes a StorageError."""
    path = write(tmp_path / "model.pth", b"x")

    def refuse(**_kwargs):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "PutObject")

    s3.meta.events.register("before-call.s3.PutObject", refuse)
    with pytest.raises(StorageError, match="AccessDenied"):
        ArtifactUploader(s3, BUCKET).upload(path, "k/model.pth")


def test_head_failure_other_than_404_raises_storage_error(s3, tmp_path):
    """A refused HeadObject (403) is an error, not a reason to assume the object is absent."""
    path = write(tmp_path / "model.pth", b"x")

    def forbid(**_kwargs):
        raise ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadObject")

    s3.meta.events.register("before-call.s3.HeadObject", forbid)
    with pytest.raises(StorageError, match="403"):
        ArtifactUploader(s3, BUCKET).upload(path, "k/model.pth")


def test_unreadable_local_file_is_stage_failed(s3, tmp_path):
    """A local artifact that vanished before upload is reported as a failed output, not a crash."""
    with pytest.raises(StageFailed, match="cannot read artifact"):
        ArtifactUploader(s3, BUCKET).upload(tmp_path / "gone.pth", "k/gone.pth")


def test_upload_all_returns_uris_in_fixed_order(s3, tmp_path):
    """upload_all uploads every asset and returns asset -> URI in the five assets' fixed order."""
    files = five_files(tmp_path)
    reversed_files = dict(reversed(list(files.items())))
    keys = {name: artifact_key("m", "production", "p1", "j1", f"{name}.bin") for name in files}
    uris = ArtifactUploader(s3, BUCKET).upload_all(reversed_files, keys)
    assert list(uris) == list(ASSET_NAMES)
    assert uris["fullModel"] == f"s3://{BUCKET}/m/production/p1/j1/fullModel.bin"
    for name, uri in uris.items():
        key = uri.removeprefix(f"s3://{BUCKET}/")
        assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == f"{name} bytes".encode()


def test_upload_all_rejects_mismatched_names(s3, tmp_path):
    """Files and keys naming different assets is a programming error, caught before any upload."""
    files = five_files(tmp_path)
    with pytest.raises(ValueError):
        ArtifactUploader(s3, BUCKET).upload_all(files, {"fullModel": "k"})


def test_object_matches_needs_both_sha_and_size():
    """Reuse requires the recorded sha256 and the size to both match."""
    head = {"Metadata": {"sha256": "ab"}, "ContentLength": 3}
    assert object_matches(head, "ab", 3)
    assert not object_matches(head, "ab", 4)
    assert not object_matches(head, "cd", 3)
    assert not object_matches({"ContentLength": 3}, "ab", 3)
    assert not object_matches(None, "ab", 3)
