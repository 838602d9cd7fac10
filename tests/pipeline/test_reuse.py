"""Per-attempt work directories: a retry copies earlier verified work, never a stale attempt's changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.config import StageSpec, load_pipeline_config
from pipeline.manifest import manifest_path, manifest_problem
from pipeline.reuse import adopt_checkpoints, adopt_downloads, adopt_verified_outputs
from pipeline.run import run_pipeline
from pipeline.stages import StageContext, run_stage
from pipeline.workdir import earlier_attempts, work_layout
from tests.pipeline.test_run import REPO, job_and_fetch  # noqa: F401 - the fixture
from tests.pipeline.test_stages import no_progress, runs, writer_stage
from worker.core.stop import StopSignal


@pytest.fixture(scope="module")
def default_config():
    return load_pipeline_config(REPO / "config" / "pipeline.toml")


def attempt_ctx(job_dir: Path, name: str) -> StageContext:
    dirs = work_layout(job_dir / "attempts" / name)
    return StageContext(dataset_dir=dirs.dataset, output_dir=dirs.output, checkpoints_root=dirs.checkpoints,
                        log_dir=dirs.logs, job_id="job-r", language="en")


def attempt_dir(ctx: StageContext) -> Path:
    return ctx.checkpoints_root.parent


def test_a_retry_in_a_new_attempt_dir_reuses_every_verified_stage(tmp_path, job_and_fetch, default_config):  # noqa: F811
    """The second attempt's directory is its own, yet it fetches nothing again and reruns no verified stage."""
    job, fetch = job_and_fetch
    job_dir = tmp_path / "job"
    first = run_pipeline(job, job_dir / "attempts" / "0001-aaaaaaaa", StopSignal(), config=default_config,
                         fetch=fetch, progress=lambda s, p: None)
    stage_logs = sorted(p.name for p in (job_dir / "logs").glob("*-t*.log"))
    first_files = {key: (path.read_bytes(), os.stat(path).st_ino) for key, path in first.items()}
    second = run_pipeline(job, job_dir / "attempts" / "0002-bbbbbbbb", StopSignal(), config=default_config,
                          fetch=fetch, progress=lambda s, p: None)
    assert len(fetch.calls) == len(job.recordings)
    assert sorted(p.name for p in (job_dir / "logs").glob("*-t*.log")) == stage_logs
    for key, path in second.items():
        assert path.is_relative_to(job_dir / "attempts" / "0002-bbbbbbbb" / "output")
        assert path.read_bytes() == first_files[key][0]
        assert os.stat(path).st_ino != first_files[key][1]  # a copy, not a link
    # Once its last stage adopted what it could, the earlier attempt is gone: one attempt's files.
    assert [p.name for p in (job_dir / "attempts").iterdir()] == ["0002-bbbbbbbb"]
    for stage in default_config.stages:
        output = job_dir / "attempts" / "0002-bbbbbbbb" / "output"
        assert manifest_problem(manifest_path(output, stage.name), output, stage.name, stage.fingerprint,
                                stage.outputs) is None


def test_a_lone_job_dir_has_no_earlier_attempts_and_keeps_its_logs(tmp_path):
    """A directory outside attempts/ is a job directory of its own: logs inside, nothing to reuse."""
    (tmp_path / "job").mkdir()
    assert earlier_attempts(tmp_path / "job") == []
    assert work_layout(tmp_path / "job").logs == tmp_path / "job" / "logs"


def test_earlier_attempts_order(tmp_path):
    """Attempt 10 is newer than attempt 9, whatever the token prefix; the current one is left out."""
    attempts = tmp_path / "job" / "attempts"
    for name in ("0009-ffffffff", "0010-00000000", "0002-aaaaaaaa", "0011-current"):
        (attempts / name).mkdir(parents=True)
    assert [p.name for p in earlier_attempts(attempts / "0011-current")] == [
        "0010-00000000", "0009-ffffffff", "0002-aaaaaaaa"]


def test_a_stale_attempts_change_after_its_manifest_is_not_copied(tmp_path):
    """An earlier attempt whose output was rewritten after its manifest (a surviving trainer) is not adopted."""
    job_dir = tmp_path / "job"
    old, new = attempt_ctx(job_dir, "0001-aaaaaaaa"), attempt_ctx(job_dir, "0002-bbbbbbbb")
    stage = writer_stage(tmp_path)
    run_stage(stage, old, StopSignal(), no_progress)
    (old.output_dir / "w/b.bin").write_bytes(b"X" * 10)  # same size, other bytes
    assert adopt_verified_outputs(stage, [old.output_dir], new.output_dir) is None
    assert not manifest_path(new.output_dir, stage.name).exists()
    assert not (new.output_dir / "w/b.bin").exists()
    run_stage(stage, new, StopSignal(), no_progress)
    assert (new.output_dir / "w/b.bin").read_bytes() == b"B" * 10
    assert len(runs(tmp_path)) == 2


def test_verified_outputs_come_from_the_newest_attempt_that_verifies(tmp_path):
    """With two earlier attempts, the newest whose manifest verifies is copied and the stage is skipped."""
    job_dir = tmp_path / "job"
    older, newer, current = (attempt_ctx(job_dir, n) for n in ("0001-aaaaaaaa", "0002-bbbbbbbb", "0003-cccccccc"))
    stage = writer_stage(tmp_path)
    run_stage(stage, older, StopSignal(), no_progress)
    run_stage(stage, newer, StopSignal(), no_progress)
    manifest_path(newer.output_dir, stage.name).write_text("{broken")
    assert adopt_verified_outputs(stage, [newer.output_dir, older.output_dir], current.output_dir) == older.output_dir
    assert run_stage(stage, current, StopSignal(), no_progress).skipped
    assert len(runs(tmp_path)) == 2


def test_a_resumable_stage_gets_the_newest_earlier_checkpoints_as_a_copy(tmp_path):
    """The newest non-empty checkpoint dir is copied (new inodes), so an old trainer cannot change it."""
    stage = StageSpec(name="train", argv=("x",), outputs=("o",), resumable=True)
    job_dir = tmp_path / "job"
    older, newer, current = (attempt_ctx(job_dir, n) for n in ("0001-aaaaaaaa", "0002-bbbbbbbb", "0003-cccccccc"))
    (older.checkpoint_dir(stage)).mkdir(parents=True)
    (older.checkpoint_dir(stage) / "ckpt-1").write_bytes(b"old")
    (newer.checkpoint_dir(stage) / "sub").mkdir(parents=True)
    (newer.checkpoint_dir(stage) / "sub" / "ckpt-2").write_bytes(b"new")
    (newer.checkpoint_dir(stage) / "link").symlink_to(tmp_path)
    source = adopt_checkpoints([attempt_dir(newer), attempt_dir(older)], attempt_dir(current), "checkpoints/train")
    assert source == attempt_dir(newer)
    copied = current.checkpoint_dir(stage) / "sub" / "ckpt-2"
    assert copied.read_bytes() == b"new"
    assert os.stat(copied).st_ino != os.stat(newer.checkpoint_dir(stage) / "sub" / "ckpt-2").st_ino
    assert not (current.checkpoint_dir(stage) / "link").exists()
    (newer.checkpoint_dir(stage) / "sub" / "ckpt-2").write_bytes(b"rewritten by a survivor")
    assert copied.read_bytes() == b"new"


RESUMABLE = StageSpec(name="train", argv=("x",), outputs=("o",), resumable=True)


@pytest.fixture
def outside_dir(tmp_path_factory) -> Path:
    """A directory outside the job laid out like an attempt's checkpoints/, output/ and downloads/."""
    directory = tmp_path_factory.mktemp("outside-the-job")
    (directory / "train").mkdir()
    (directory / "train" / "ckpt-9").write_bytes(b"not the job's")
    (directory / "00000.audio").write_bytes(b"not the job's")
    return directory


@pytest.mark.parametrize("linked", ["checkpoints", "checkpoints/train"])
def test_checkpoints_reached_through_a_link_in_an_earlier_attempt_are_not_copied(tmp_path, outside_dir, linked):
    """An earlier attempt whose checkpoints/ (or checkpoints/<stage>) is a link out of the job gives nothing."""
    job_dir = tmp_path / "job"
    older, current = attempt_ctx(job_dir, "0001-aaaaaaaa"), attempt_ctx(job_dir, "0002-bbbbbbbb")
    attempt_dir(older).mkdir(parents=True)
    target = outside_dir if linked == "checkpoints" else outside_dir / "train"
    (attempt_dir(older) / linked).parent.mkdir(parents=True, exist_ok=True)
    (attempt_dir(older) / linked).symlink_to(target)
    assert adopt_checkpoints([attempt_dir(older)], attempt_dir(current), "checkpoints/train") is None
    assert list(current.checkpoint_dir(RESUMABLE).iterdir()) == []
    assert (outside_dir / "train" / "ckpt-9").read_bytes() == b"not the job's"


def test_a_linked_checkpoints_dir_in_this_attempt_is_replaced_not_written_through(tmp_path, outside_dir):
    """This attempt's checkpoints/ made a link by an earlier stage: the copy lands in a real directory
    inside the attempt, and the outside directory is neither written nor emptied."""
    job_dir = tmp_path / "job"
    older, current = attempt_ctx(job_dir, "0001-aaaaaaaa"), attempt_ctx(job_dir, "0002-bbbbbbbb")
    older.checkpoint_dir(RESUMABLE).mkdir(parents=True)
    (older.checkpoint_dir(RESUMABLE) / "ckpt-1").write_bytes(b"old")
    (outside_dir / "train" / "ckpt-9").unlink()  # empty there: the old code copied into it
    attempt_dir(current).mkdir(parents=True)
    current.checkpoints_root.symlink_to(outside_dir)
    assert adopt_checkpoints([attempt_dir(older)], attempt_dir(current), "checkpoints/train") == attempt_dir(older)
    assert not current.checkpoints_root.is_symlink()
    assert (current.checkpoint_dir(RESUMABLE) / "ckpt-1").read_bytes() == b"old"
    assert sorted(p.name for p in outside_dir.rglob("*")) == ["00000.audio", "train"]


def test_verified_outputs_behind_a_linked_output_dir_are_not_copied(tmp_path, outside_dir):
    """An earlier attempt whose output/ is a link (to a copy of verified outputs, manifest included) gives nothing."""
    job_dir = tmp_path / "job"
    old, new = attempt_ctx(job_dir, "0001-aaaaaaaa"), attempt_ctx(job_dir, "0002-bbbbbbbb")
    stage = writer_stage(tmp_path)
    run_stage(stage, old, StopSignal(), no_progress)
    moved = outside_dir / "output"
    old.output_dir.rename(moved)
    old.output_dir.symlink_to(moved)
    assert adopt_verified_outputs(stage, [old.output_dir], new.output_dir) is None
    assert not (new.output_dir / "w/b.bin").exists()
    assert not manifest_path(new.output_dir, stage.name).exists()


def test_downloads_behind_a_linked_downloads_dir_are_not_copied(tmp_path, outside_dir):
    """An earlier attempt whose downloads/ is a link out of the job: the recording is not taken from there."""
    job_dir = tmp_path / "job"
    older, current = job_dir / "attempts" / "0001-aaaaaaaa", job_dir / "attempts" / "0002-bbbbbbbb"
    older.mkdir(parents=True)
    (older / "downloads").symlink_to(outside_dir)
    (current / "downloads").mkdir(parents=True)
    assert adopt_downloads([older / "downloads"], current / "downloads", ["00000.audio"]) == []
    assert not (current / "downloads" / "00000.audio").exists()
