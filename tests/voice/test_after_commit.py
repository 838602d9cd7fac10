"""After the commit: the work directory is emptied except logs/ (or kept whole), the published models
stay, and a removal that fails never fails the committed job."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from pipeline.workdir import job_dir_of
from tests.voice.conftest import BUCKET, JOB_ID, PROFILE_ID, message_body
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.rules import is_complete

# message_body's environment, directoryName and jobId, under the handler fixture's WORK_ROOT.
WORK_DIR = Path("production", "user-123-voice-1", JOB_ID)


def write_work_files(job, work_dir: Path, stop, progress) -> None:
    """What a pipeline run leaves besides the five artifacts: downloads, a dataset, checkpoints, logs."""
    for rel in ("downloads/0.wav", "dataset/wavs/0.wav", "checkpoints/train_full/ckpt-1.npz"):
        path = work_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{rel}\n")
    for rel in ("logs/01-train_full.log", "logs/download.log"):
        path = job_dir_of(work_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{rel}\n")
    (work_dir / "notes.txt").write_text("a loose file\n")


def attempt_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "work" / WORK_DIR / "attempts").iterdir())


def assert_only_logs_left_and_complete(tmp_path: Path, raw_store) -> None:
    """The job's work dir holds logs/ (as write_work_files left them) and nothing else; both records complete."""
    work_dir = tmp_path / "work" / WORK_DIR
    assert sorted(p.relative_to(work_dir).as_posix() for p in work_dir.rglob("*")) == [
        "logs", "logs/01-train_full.log", "logs/download.log"]
    assert is_complete(raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID))


@pytest.fixture
def keeping_handler(store, s3, train, tmp_path):
    return VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="test-worker",
                                         lease_s=2, keep_work_files=True),
                           store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)


def test_committed_job_keeps_only_its_logs(queues, make_worker, handler, train, raw_store, tmp_path):
    """Once the job is committed its work dir holds logs/ and nothing else; the records stay complete."""
    train.during = write_work_files
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    assert_only_logs_left_and_complete(tmp_path, raw_store)


def test_model_paths_name_published_files_that_outlive_the_cleanup(queues, make_worker, handler, train,
                                                                 raw_store, tmp_path):
    """After the commit and the scratch cleanup every modelPaths entry is an existing file under MODELS_ROOT."""
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    models_dir = tmp_path / "work" / ".models" / WORK_DIR
    model_paths = raw_store.get_profile(PROFILE_ID)["modelPaths"]
    for name, path in model_paths.items():
        assert Path(path).is_file() and models_dir in Path(path).parents, name
        assert Path(path).read_bytes() == f"{name} of {JOB_ID}\n".encode() * 10
    assert not (tmp_path / "work" / WORK_DIR / "attempts").exists()


def test_keep_work_files_keeps_every_file(queues, make_worker, keeping_handler, train, raw_store, tmp_path):
    """With KEEP_WORK_FILES the artifacts, downloads and checkpoints all stay after the commit."""
    train.during = write_work_files
    worker, _ = make_worker(keeping_handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    [attempt_dir] = attempt_dirs(tmp_path)
    for rel in ("downloads/0.wav", "checkpoints/train_full/ckpt-1.npz", "notes.txt", "output/full/model.pth"):
        assert (attempt_dir / rel).is_file(), rel
    assert (tmp_path / "work" / WORK_DIR / "logs" / "download.log").is_file()
    for path in raw_store.get_profile(PROFILE_ID)["modelPaths"].values():
        assert Path(path).is_file()


def test_files_of_an_uncommitted_attempt_are_kept_for_its_retry(queues, make_worker, handler, store, train,
                                                                tmp_path):
    """An attempt that fails before the commit leaves its files, so the retry can resume from them."""
    from worker.voice.records.errors import StoreError

    train.during = write_work_files
    store.faults["mark_job_completed"] = lambda: StoreError("store unavailable")
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "retry"
    [attempt_dir] = attempt_dirs(tmp_path)
    assert (attempt_dir / "downloads" / "0.wav").is_file() and (attempt_dir / "output").is_dir()


def test_a_failed_removal_is_logged_and_the_job_still_acknowledged(queues, make_worker, handler, train, raw_store,
                                                                   monkeypatch, tmp_path):
    """A removal that raises is a warning: the committed job is still acknowledged and stays complete."""
    import pipeline.workdir as workdir_module

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    train.during = write_work_files
    monkeypatch.setattr(workdir_module.shutil, "rmtree", refuse)
    worker, client = make_worker(handler)
    queues.send(message_body())
    with capture_logs() as logs:
        assert worker.run_once() == "ack"
    [warning] = [entry for entry in logs if entry["event"] == "job.work_files_not_removed"]
    assert warning["log_level"] == "warning" and "Permission denied" in warning["failures"][0]
    # One failure does not stop the rest: every directory was tried, and the loose file is gone.
    assert warning["count"] == len(["checkpoints", "dataset", "downloads", "output"])
    [attempt_dir] = attempt_dirs(tmp_path)
    assert not (attempt_dir / "notes.txt").exists()
    assert client.ops()[-1] == "delete_message"
    assert is_complete(raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID))


def test_an_unexpected_error_while_removing_never_fails_the_job(queues, make_worker, handler, monkeypatch):
    """Even a non-OSError from the removal (a bug) is logged, not raised: the commit already happened."""
    import worker.voice.commit as commit_module

    def broken(_work_dir, _models_root=None):
        raise RuntimeError("bug in cleanup")

    monkeypatch.setattr(commit_module, "remove_work_files", broken)
    worker, _ = make_worker(handler)
    queues.send(message_body())
    with capture_logs() as logs:
        assert worker.run_once() == "ack"
    assert any(e["event"] == "job.work_files_not_removed" for e in logs)


def test_a_symlink_in_the_work_dir_is_removed_not_followed(queues, make_worker, handler, train, tmp_path):
    """A link to a directory outside WORK_ROOT is unlinked; what it pointed to is untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me\n")

    def link_out(job, work_dir, stop, progress):
        work_dir.mkdir(parents=True, exist_ok=True)
        (work_dir / "linked").symlink_to(outside, target_is_directory=True)

    train.during = link_out
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    assert not any(p.name == "linked" for p in (tmp_path / "work" / WORK_DIR).rglob("*"))
    assert (outside / "precious.txt").read_text() == "keep me\n"


def test_published_copies_no_committed_path_names_are_removed(queues, make_worker, handler, raw_store, tmp_path):
    """A stale attempt's published digest under the job's models directory goes after the commit; the
    committed files stay."""
    models_dir = tmp_path / "work" / ".models" / WORK_DIR
    stale = models_dir / ("0" * 64) / "full" / "model.pth"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"a stale attempt's model")
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    committed = raw_store.get_profile(PROFILE_ID)["modelPaths"].values()
    assert not stale.parent.parent.exists()
    assert all(Path(path).is_file() for path in committed)
    assert {p.name for p in models_dir.iterdir()} == {Path(path).relative_to(models_dir).parts[0] for path in committed}


def test_a_redelivery_of_a_committed_job_redoes_the_skipped_cleanup(queues, make_worker, handler, train,
                                                                    raw_store, tmp_path, monkeypatch):
    """A worker that died right after the commit left scratch behind; the redelivery removes it, work-free."""
    import worker.voice.commit as commit_module

    train.during = write_work_files
    monkeypatch.setattr(commit_module.Commit, "clean_up", lambda *args: None)
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    assert attempt_dirs(tmp_path), "the crash left the attempt's scratch"
    monkeypatch.undo()
    queues.send(message_body())
    assert worker.run_once() == "ack"
    assert_only_logs_left_and_complete(tmp_path, raw_store)
