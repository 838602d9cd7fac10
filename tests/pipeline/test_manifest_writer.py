"""Stage manifests written in the background: the next stage need not wait for the hashing."""

from __future__ import annotations

import errno
import threading

import pytest

import pipeline.stages as stages
from pipeline.config import StageSpec
from pipeline.manifest import manifest_path, manifest_problem
from pipeline.stages import ManifestWriter, StageContext, run_stage
from worker.core.stop import StopSignal


@pytest.fixture
def ctx(tmp_path) -> StageContext:
    return StageContext(dataset_dir=tmp_path / "dataset", output_dir=tmp_path / "output",
                        checkpoints_root=tmp_path / "checkpoints", log_dir=tmp_path / "logs",
                        job_id="job-1", language="en")


def writer(name: str, rel: str) -> StageSpec:
    code = f"import pathlib, sys; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True); p.write_text('{name}')"
    return StageSpec(name=name, argv=("{python}", "-c", code, "{output_dir}/" + rel), outputs=(rel,))


@pytest.fixture
def held_hashing(monkeypatch):
    """Manifest writes wait until the test releases them, and note which stages were hashed when."""
    release, started = threading.Event(), []
    real = stages.write_manifest

    def slow(path, output_dir, stage_name, *rest):
        started.append(stage_name)
        assert release.wait(30)
        return real(path, output_dir, stage_name, *rest)

    monkeypatch.setattr(stages, "write_manifest", slow)
    return release, started


def test_the_next_stage_runs_while_the_previous_outputs_are_hashed(ctx, held_hashing):
    """A stage returns before its manifest is written; wait() leaves every manifest written and valid."""
    release, _started = held_hashing
    first, second = writer("first", "a/one.bin"), writer("second", "b/two.bin")
    manifests = ManifestWriter()
    try:
        run_stage(first, ctx, StopSignal(), lambda *_: None, manifests=manifests)
        run_stage(second, ctx, StopSignal(), lambda *_: None, manifests=manifests)
        assert (ctx.output_dir / "b" / "two.bin").read_text() == "second"  # ran with the first still hashing
        assert not manifest_path(ctx.output_dir, "first").exists()
        release.set()
        manifests.wait()
    finally:
        release.set()
        manifests.close()
    for stage in (first, second):
        path = manifest_path(ctx.output_dir, stage.name)
        assert manifest_problem(path, ctx.output_dir, stage.name, stage.fingerprint, stage.outputs) is None


def test_a_manifest_that_cannot_be_written_fails_with_its_stages_outputs_removed(ctx, monkeypatch):
    """A failed background write is raised by the next check or wait, and its stage's outputs are gone."""
    def full_disk(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stages, "write_manifest", full_disk)
    stage = writer("first", "a/one.bin")
    manifests = ManifestWriter()
    try:
        run_stage(stage, ctx, StopSignal(), lambda *_: None, manifests=manifests)
        with pytest.raises(OSError, match="No space left"):
            manifests.wait()
        assert not (ctx.output_dir / "a" / "one.bin").exists()
        manifests.wait()  # raised once: nothing left pending
    finally:
        manifests.close()


def test_check_never_waits_on_a_write_in_progress(ctx, held_hashing):
    """check() returns at once while a manifest is still being written."""
    release, started = held_hashing
    manifests = ManifestWriter()
    try:
        run_stage(writer("first", "a/one.bin"), ctx, StopSignal(), lambda *_: None, manifests=manifests)
        manifests.check()
        assert not manifest_path(ctx.output_dir, "first").exists()
    finally:
        release.set()
        manifests.close()
    assert started == ["first"]


def test_a_manifest_written_behind_the_next_stage_never_lands_outside_the_job(ctx, held_hashing, tmp_path):
    """A .manifests swapped for a link out of the job while a manifest is being hashed (as the next
    stage could) is replaced, never followed: the manifest lands in the output directory, none outside."""
    import shutil

    release, started = held_hashing
    outside = tmp_path / "outside"
    outside.mkdir()
    manifests = ManifestWriter()
    try:
        run_stage(writer("first", "a/one.bin"), ctx, StopSignal(), lambda *_: None, manifests=manifests)
        shutil.rmtree(ctx.output_dir / ".manifests")
        (ctx.output_dir / ".manifests").symlink_to(outside)
        release.set()
        manifests.wait()
    finally:
        release.set()
        manifests.close()
    assert started == ["first"]
    assert list(outside.iterdir()) == []
    assert not (ctx.output_dir / ".manifests").is_symlink()
    assert manifest_path(ctx.output_dir, "first").is_file()


def test_a_slow_task_after_a_manifest_neither_delays_the_next_manifest_nor_the_close(ctx):
    """A mirror upload after stage one's manifest runs on its own thread: stage two's manifest is
    written meanwhile, and close() returns without waiting for the upload."""
    import threading

    release, finished = threading.Event(), threading.Event()

    def slow_upload():
        release.wait(20)
        finished.set()

    manifests = ManifestWriter()
    try:
        run_stage(writer("first", "a/one.bin"), ctx, StopSignal(), lambda *_: None, manifests=manifests)
        manifests.then(slow_upload)
        run_stage(writer("second", "b/two.bin"), ctx, StopSignal(), lambda *_: None, manifests=manifests)
        manifests.wait()
        assert manifest_path(ctx.output_dir, "second").is_file()
        manifests.close()
        assert not finished.is_set()  # neither the wait nor the close waited for the upload
    finally:
        release.set()
