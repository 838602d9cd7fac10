"""The job hands the stage manifests' digests and identities to the uploader and the publisher: each file
is hashed once, by its manifest, and bytes that do not match their recorded digest are never stored."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import pipeline.files
import worker.voice.artifacts
from pipeline.errors import StageFailed
from pipeline.manifest import manifest_path, write_manifest
from tests.support import CountingHashlib
from tests.voice.conftest import BUCKET, PROFILE_ID, deliver
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler

MIB = 1024 * 1024


def objects(s3) -> list[str]:
    return [item["Key"] for item in s3.list_objects_v2(Bucket=BUCKET).get("Contents") or []]


def with_manifest(train, forge: str | None = None):
    """The fake pipeline with an 11 MiB full model and a stage manifest for its five files; ``forge``
    names a file whose recorded digest lies."""
    def run(job, work_dir, stop, progress, ledger=None):
        paths = train(job, work_dir, stop, progress, ledger)
        paths["fullModel"].write_bytes(os.urandom(11 * MIB))
        out = work_dir / "output"
        manifest = manifest_path(out, "train_full")
        write_manifest(manifest, out, "train_full", "fp", [p.relative_to(out).as_posix() for p in paths.values()])
        if forge is not None:
            real = hashlib.sha256(paths[forge].read_bytes()).hexdigest()
            manifest.write_text(manifest.read_text().replace(real, hashlib.sha256(b"forged").hexdigest()))
        return paths
    return run


@pytest.fixture
def small_parts_handler(store, s3, tmp_path):
    """A handler whose uploader sends files of 5 MiB and more in 5 MiB parts."""
    def make(train):
        uploader = ArtifactUploader(s3, BUCKET, multipart_threshold_bytes=5 * MIB, multipart_chunk_bytes=5 * MIB)
        return VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="test-worker",
                                             lease_s=30),
                               store=store, uploader=uploader, train=train)
    return make


@pytest.fixture
def uploader_hashing(monkeypatch) -> CountingHashlib:
    """Bytes the uploader hashes (not the manifests, nor the published copies): one running total."""
    counting = CountingHashlib()
    real_whole = worker.voice.artifacts.sha256_and_size_of

    def whole(handle):
        sha256_hex, size = real_whole(handle)
        counting.hashed_bytes += size
        return sha256_hex, size

    monkeypatch.setattr(worker.voice.artifacts, "hashlib", counting)
    monkeypatch.setattr(worker.voice.artifacts, "sha256_and_size_of", whole)
    return counting


@pytest.fixture
def no_racy_margin(monkeypatch):
    """Files count as settled as soon as they are hashed (the fake pipeline writes them just before)."""
    monkeypatch.setattr(pipeline.files, "RACY_MARGIN_NS", 0)
    monkeypatch.setattr(pipeline.files, "RACY_MARGIN_WHOLE_SECONDS_NS", 0)


@pytest.fixture
def all_hashing(monkeypatch) -> CountingHashlib:
    """Bytes hashed anywhere on the way (manifests, uploader, publisher): one running total."""
    counting = CountingHashlib()
    monkeypatch.setattr(worker.voice.artifacts, "hashlib", counting)
    monkeypatch.setattr(pipeline.files, "hashlib", counting)
    return counting


def test_the_job_uploads_each_file_hashing_it_once(small_parts_handler, train, raw_store, s3, uploader_hashing,
                                                  monkeypatch):
    """Without identities (every file racy at its manifest), the job's upload hashes each byte once as it is sent."""
    monkeypatch.setattr(pipeline.files, "RACY_MARGIN_NS", 10**18)
    handler = small_parts_handler(with_manifest(train))
    assert deliver(handler, 1) == "completed"
    s3_paths = raw_store.get_profile(PROFILE_ID)["s3Paths"]
    sizes = [s3.head_object(Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"))["ContentLength"]
             for uri in s3_paths.values()]
    assert uploader_hashing.hashed_bytes == sum(sizes)
    assert sorted(uri.removeprefix(f"s3://{BUCKET}/") for uri in s3_paths.values()) == sorted(objects(s3))


def test_settled_files_are_hashed_once_by_their_manifest_and_never_again(
        small_parts_handler, train, raw_store, s3, no_racy_margin, all_hashing):
    """With the manifests' identities, the whole commit hashes each byte once; the models are linked, not copied."""
    sizes: dict[str, int] = {}
    start = [0]

    def counted_from_the_start(job, work_dir, stop, progress, ledger=None):
        start[0] = all_hashing.hashed_bytes
        paths = with_manifest(train)(job, work_dir, stop, progress, ledger)
        sizes.update({name: path.stat().st_size for name, path in paths.items()})
        return paths

    handler = small_parts_handler(counted_from_the_start)
    assert deliver(handler, 1) == "completed"
    assert all_hashing.hashed_bytes - start[0] == sum(sizes.values())
    profile = raw_store.get_profile(PROFILE_ID)
    for name, uri in profile["s3Paths"].items():
        stored = s3.get_object(Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"))["Body"].read()
        assert stored == Path(profile["modelPaths"][name]).read_bytes()


@pytest.mark.parametrize("settled", [False, True], ids=["racy", "settled"])
@pytest.mark.parametrize("forged", ["fullModel", "fullConfig"], ids=["multipart", "single PUT"])
def test_a_recorded_digest_the_bytes_do_not_match_is_never_stored_under(small_parts_handler, train, s3, forged,
                                                                        settled, monkeypatch):
    """A manifest digest the file's bytes do not hash to fails the attempt; no key names it (an edited
    manifest loses its seal, so its identities vouch for nothing)."""
    monkeypatch.setattr(pipeline.files, "RACY_MARGIN_NS", 0 if settled else 10**18)
    handler = small_parts_handler(with_manifest(train, forge=forged))
    with pytest.raises(StageFailed, match="changed while it was uploaded"):
        deliver(handler, 1)
    assert not [key for key in objects(s3) if hashlib.sha256(b"forged").hexdigest() in key]
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
