"""Each attempt gets a work directory of its own, and the profile's modelPaths name published files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.files import FileIdentity
from pipeline.workdir import attempt_dir_name, published_path
from tests.voice.conftest import JOB_ID, PROFILE_ID, message_body
from worker.voice.commit import artifact_rels
from worker.voice.errors import StorageError
from worker.voice.publish import publish_all, publish_file
from worker.voice.records.errors import StoreError

WORK_DIR = Path("production", "user-123-voice-1", JOB_ID)
FAST_RETRY = {"SQS_VISIBILITY_TIMEOUT_SECONDS": 1, "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": 300,
              "SQS_RETRY_VISIBILITY_BASE_SECONDS": 0}


def test_attempt_dir_names_hold_the_number_and_the_token_prefix():
    """The attempt id is the zero-padded attempt number and the first 8 hex of the claim token."""
    assert attempt_dir_name(3, "0123456789abcdef") == "0003-01234567"


def test_two_attempts_work_in_different_dirs_and_a_stale_write_stays_in_its_own(
        queues, make_worker, handler, store, train, tmp_path):
    """A retry trains in a new attempt dir; what the first attempt writes late never appears there."""
    seen: list[Path] = []

    def note(job, work_dir, stop, progress):
        seen.append(work_dir)
        if len(seen) == 2:  # the first attempt, still running somewhere, writes after the retry began
            (seen[0] / "output" / "full").mkdir(parents=True, exist_ok=True)
            (seen[0] / "output" / "full" / "model.pth").write_bytes(b"stale bytes")

    train.during = note
    failures = iter([StoreError("store unavailable")])
    store.faults["write_paths"] = lambda: next(failures, None)
    worker, _ = make_worker(handler, **FAST_RETRY)
    queues.send(message_body())
    assert worker.run_once() == "retry"
    assert worker.run_once() == "ack"
    assert len(seen) == 2 and seen[0] != seen[1]
    assert seen[0].parent == seen[1].parent == tmp_path / "work" / WORK_DIR / "attempts"
    profile = store.get_profile(PROFILE_ID)
    assert Path(profile["modelPaths"]["fullModel"]).read_bytes() == f"fullModel of {JOB_ID}\n".encode() * 10


def test_model_paths_exist_after_the_commit(queues, make_worker, handler, raw_store, tmp_path):
    """Every modelPaths entry names an existing published file once the job is committed and cleaned up."""
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    paths = raw_store.get_profile(PROFILE_ID)["modelPaths"]
    assert all(Path(p).is_file() for p in paths.values())
    assert all((tmp_path / "work" / ".models" / WORK_DIR) in Path(p).parents for p in paths.values())


def publish_now(source: Path, rel: str, models: Path) -> Path:
    """Publish ``source`` under the digest its bytes have now (what the upload would have stored)."""
    from pipeline.files import sha256_and_size

    return publish_file(source.parent, source.name, rel, sha256_and_size(source)[0], models)


def test_publishing_the_same_bytes_twice_keeps_the_first_file(tmp_path):
    """A second publish of identical content returns the existing file untouched (same inode)."""
    source = tmp_path / "out" / "full" / "model.pth"
    source.parent.mkdir(parents=True)
    source.write_bytes(b"model")
    models = tmp_path / "models"
    first = publish_now(source, "full/model.pth", models)
    inode = os.stat(first).st_ino
    again = publish_now(source, "full/model.pth", models)
    assert again == first and os.stat(again).st_ino == inode and again.read_bytes() == b"model"
    assert [p.name for p in first.parent.iterdir()] == ["model.pth"]  # no temp file left


def test_publishing_never_replaces_an_existing_published_file(tmp_path):
    """A published name holding other bytes is refused with StorageError and left as it was."""
    source = tmp_path / "model.pth"
    source.write_bytes(b"new bytes")
    models = tmp_path / "models"
    from pipeline.files import sha256_and_size

    final = published_path(models, sha256_and_size(source)[0], "full/model.pth")
    final.parent.mkdir(parents=True)
    final.write_bytes(b"something else")
    with pytest.raises(StorageError, match="never replaced"):
        publish_all(tmp_path, {"fullModel": source.name}, {"fullModel": "full/model.pth"},
                    {"fullModel": sha256_and_size(source)[0]}, models)
    assert final.read_bytes() == b"something else"


def test_different_bytes_publish_to_different_paths(tmp_path):
    """Two trainings of one job publish side by side: content addressing keeps both."""
    models = tmp_path / "models"
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"attempt one")
    b.write_bytes(b"attempt two")
    first, second = publish_now(a, "full/model.pth", models), publish_now(b, "full/model.pth", models)
    assert first != second and first.read_bytes() == b"attempt one" and second.read_bytes() == b"attempt two"


def test_a_file_changed_since_its_upload_is_not_published(tmp_path):
    """The published copy must hold the bytes the S3 object was stored under; other bytes are refused."""
    from pipeline.files import sha256_and_size

    source = tmp_path / "model.pth"
    source.write_bytes(b"uploaded bytes")
    uploaded = sha256_and_size(source)[0]
    source.write_bytes(b"rewritten after the upload")
    models = tmp_path / "models"
    with pytest.raises(StorageError, match="changed since it was uploaded"):
        publish_file(tmp_path, "model.pth", "full/model.pth", uploaded, models)
    assert not published_path(models, uploaded, "full/model.pth").exists()
    assert [p for p in models.rglob("*") if p.is_file()] == []


def test_a_source_behind_a_linked_directory_is_not_published(tmp_path):
    """Publishing reads by the pipeline's one output rule: a link on the way is refused."""
    from pipeline.files import sha256_and_size

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.pth").write_bytes(b"not the job's")
    output = tmp_path / "output"
    output.mkdir()
    (output / "full").symlink_to(outside)
    with pytest.raises(StorageError, match="cannot be published"):
        publish_file(output, "full/model.pth", "full/model.pth",
                     sha256_and_size(outside / "model.pth")[0], tmp_path / "models")


def test_artifact_rels_work_for_attempt_outputs_and_published_files(tmp_path):
    """The S3 key's relative path is the same whether the artifact is in an attempt dir or published."""
    output, models = tmp_path / "attempts" / "0001-aaaaaaaa" / "output", tmp_path / "models"
    rels = artifact_rels({"a": output / "full" / "model.pth", "b": models / "ab12" / "light" / "model.onnx"},
                         output, models)
    assert rels == {"a": "full/model.pth", "b": "light/model.onnx"}


def another_attempt_publishes_right_after_the_check(monkeypatch) -> None:
    """The first check finds the published name free; right after it, another attempt writes other bytes there."""
    import worker.voice.publish as publish

    checks = iter([False])
    real_check = publish._same_file_there

    def racing_check(path, sha, size):
        if next(checks, None) is False:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"theirs")
            return False
        return real_check(path, sha, size)

    monkeypatch.setattr(publish, "_same_file_there", racing_check)


def test_a_file_published_by_someone_else_between_check_and_link_is_not_replaced(tmp_path, monkeypatch):
    """When another attempt wins the race to the final name with other bytes, ours never overwrites it."""

    source = tmp_path / "model.pth"
    source.write_bytes(b"ours")
    models = tmp_path / "models"
    from pipeline.files import sha256_and_size

    final = published_path(models, sha256_and_size(source)[0], "full/model.pth")
    another_attempt_publishes_right_after_the_check(monkeypatch)
    with pytest.raises(StorageError, match="never replaced"):
        publish_now(source, "full/model.pth", models)
    assert final.read_bytes() == b"theirs"
    assert [p.name for p in final.parent.iterdir()] == ["model.pth"]


def settled_source(tmp_path: Path, data: bytes = b"trained weights") -> tuple[Path, str, FileIdentity]:
    """A stage output as its manifest saw it: written long before it was hashed, with the identity recorded."""
    from pipeline.files import sha256_and_size

    source = tmp_path / "out" / "full" / "model.pth"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(data)
    os.utime(source, ns=(1_600_000_000 * 10**9,) * 2)
    return source, sha256_and_size(source)[0], FileIdentity.of(os.stat(source))


def test_a_file_still_showing_its_recorded_identity_is_linked_into_place_not_copied(tmp_path, monkeypatch):
    """The attempt's own file becomes the published one (same inode), its data synced, nothing hashed."""
    import worker.voice.publish as publish

    source, sha256_hex, identity = settled_source(tmp_path)
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(publish.os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real_fsync(fd)))
    monkeypatch.setattr(publish, "sha256_and_size_of", lambda *a, **k: pytest.fail("the file was copied"))
    final = publish_file(source.parent.parent, "full/model.pth", "full/model.pth", sha256_hex, tmp_path / "models",
                         identity)
    assert os.stat(final).st_ino == identity.inode and final.read_bytes() == b"trained weights"
    assert identity.inode in synced
    assert os.stat(final).st_mode & 0o222 == 0  # read-only through both names
    assert [p.name for p in final.parent.iterdir()] == ["model.pth"]


def test_a_file_whose_identity_changed_since_its_hashing_is_copied_and_checked(tmp_path):
    """A write after the manifest changes the identity: the copy path hashes it and refuses other bytes."""
    source, sha256_hex, identity = settled_source(tmp_path)
    source.write_bytes(b"trained WEIGHTS")
    models = tmp_path / "models"
    with pytest.raises(StorageError, match="changed since it was uploaded"):
        publish_file(source.parent.parent, "full/model.pth", "full/model.pth", sha256_hex, models, identity)
    assert [p for p in models.rglob("*") if p.is_file()] == []


def test_a_file_system_that_cannot_link_gets_a_checked_copy(tmp_path, monkeypatch):
    """MODELS_ROOT on another file system (EXDEV): the file is copied, hashed on the way, and published."""
    import errno

    import worker.voice.publish as publish

    source, sha256_hex, identity = settled_source(tmp_path)
    real_link = os.link

    def cross_device(src, dst, **kwargs):
        if str(src).startswith("/proc/self/fd/"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_link(src, dst, **kwargs)

    monkeypatch.setattr(publish.os, "link", cross_device)
    final = publish_file(source.parent.parent, "full/model.pth", "full/model.pth", sha256_hex, tmp_path / "models",
                         identity)
    assert os.stat(final).st_ino != identity.inode and final.read_bytes() == b"trained weights"
    assert os.stat(final).st_mode & 0o222 == 0
    assert [p.name for p in final.parent.iterdir()] == ["model.pth"]


def test_a_file_this_process_may_not_make_read_only_gets_a_checked_copy(tmp_path, monkeypatch):
    """A file another user owns cannot lose its write bits here: it is copied instead of linked."""
    import worker.voice.publish as publish

    source, sha256_hex, identity = settled_source(tmp_path)

    def not_ours(fd, mode):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(publish.os, "fchmod", not_ours)
    final = publish_file(source.parent.parent, "full/model.pth", "full/model.pth", sha256_hex, tmp_path / "models",
                         identity)
    assert os.stat(final).st_ino != identity.inode and final.read_bytes() == b"trained weights"


def test_a_write_just_before_the_link_is_caught_and_nothing_is_published(tmp_path, monkeypatch):
    """A write between the identity check and the link: the link is taken back, and the copy refuses the bytes."""
    import worker.voice.publish as publish

    source, sha256_hex, identity = settled_source(tmp_path)
    real_fsync = os.fsync

    def written_meanwhile(fd):
        if os.fstat(fd).st_ino == identity.inode and os.fstat(fd).st_mtime_ns == identity.mtime_ns:
            source.write_bytes(b"trained WEIGHTS")
        return real_fsync(fd)

    monkeypatch.setattr(publish.os, "fsync", written_meanwhile)
    models = tmp_path / "models"
    with pytest.raises(StorageError, match="changed since it was uploaded"):
        publish_file(source.parent.parent, "full/model.pth", "full/model.pth", sha256_hex, models, identity)
    assert [p for p in models.rglob("*") if p.is_file()] == []


def test_a_linked_publish_never_replaces_a_file_someone_else_published_first(tmp_path, monkeypatch):
    """When another attempt takes the final name with other bytes just before our link, theirs stays."""

    source, sha256_hex, identity = settled_source(tmp_path)
    final = published_path(tmp_path / "models", sha256_hex, "full/model.pth")
    another_attempt_publishes_right_after_the_check(monkeypatch)
    with pytest.raises(StorageError, match="never replaced"):
        publish_file(source.parent.parent, "full/model.pth", "full/model.pth", sha256_hex, tmp_path / "models",
                     identity)
    assert final.read_bytes() == b"theirs" and source.read_bytes() == b"trained weights"


def test_the_cleanup_never_removes_a_models_root_inside_the_work_dir(tmp_path):
    """Scratch removal skips an entry that is MODELS_ROOT (or holds it), whatever the settings chose."""
    from pipeline.workdir import remove_work_files

    work = tmp_path / "job"
    (work / "attempts" / "0001-aaaaaaaa" / "output").mkdir(parents=True)
    (work / "published" / "f").mkdir(parents=True)
    (work / "published" / "f" / "model.pth").write_bytes(b"m")
    assert remove_work_files(work, work / "published" / "f") == []
    assert (work / "published" / "f" / "model.pth").read_bytes() == b"m"
    assert not (work / "attempts").exists()


def test_a_failed_publish_writes_no_model_paths(queues, make_worker, handler, raw_store, monkeypatch):
    """Publishing comes before the profile's paths: when it fails, no modelPaths name missing files."""
    import worker.voice.commit as commit_module

    def full_disk(*_args, **_kwargs):
        raise StorageError("publishing the models failed at model.pth: No space left on device")

    monkeypatch.setattr(commit_module, "publish_all", full_disk)
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "retry"
    assert not raw_store.get_profile(PROFILE_ID).get("modelPaths")
    assert raw_store.get_job(JOB_ID)["error"]["type"] == "StorageError"
