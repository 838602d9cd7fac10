"""Stage manifests and atomic writes."""

from __future__ import annotations

import json
import os

import pytest

import pipeline.files
import pipeline.manifest
from pipeline.files import FileIdentity, file_sha256
from pipeline.manifest import (
    atomic_write_bytes,
    manifest_path,
    manifest_problem,
    recorded_outputs,
    remove_stale_temps,
    write_manifest,
)

OUTPUTS = ("full/model.pth", "full/config.json")


@pytest.fixture
def written(tmp_path):
    out = tmp_path / "output"
    (out / "full").mkdir(parents=True)
    (out / "full/model.pth").write_bytes(b"weights" * 100)
    (out / "full/config.json").write_bytes(b'{"a": 1}')
    path = manifest_path(out, "train_full")
    write_manifest(path, out, "train_full", "fp1", OUTPUTS)
    return out, path


def test_fresh_manifest_verifies_and_records_sizes_and_hashes(written):
    """A manifest written after success vouches for the outputs exactly as they are."""
    out, path = written
    assert manifest_problem(path, out, "train_full", "fp1", OUTPUTS) is None
    recorded = json.loads(path.read_text())["outputs"]
    assert {key: recorded["full/model.pth"][key] for key in ("size", "sha256")} == {
        "size": 700,
        "sha256": file_sha256(out / "full/model.pth"),
    }


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda out, path: (out / "full/model.pth").write_bytes(b"Weights" * 100), "changed content"),
        (lambda out, path: (out / "full/model.pth").write_bytes(b"w"), "changed size"),
        (lambda out, path: (out / "full/config.json").unlink(), "missing"),
        (lambda out, path: path.write_bytes(path.read_bytes()[:-20]), "unreadable"),
        (lambda out, path: path.unlink(), "no manifest"),
        (lambda out, path: path.write_text('{"version": 99}'), "unknown format"),
    ],
    ids=["same-size-edit", "truncated-output", "deleted-output", "torn-manifest", "no-manifest", "format"],
)
def test_damage_voids_the_manifest(written, damage, why):
    """Any change to an output or to the manifest itself means the stage must run again."""
    out, path = written
    damage(out, path)
    problem = manifest_problem(path, out, "train_full", "fp1", OUTPUTS)
    assert problem is not None and why in problem


def _link_dir_to_a_copy(out, tmp_path):
    copy = tmp_path / "outside-copy"
    (out / "full").rename(copy)
    (out / "full").symlink_to(copy, target_is_directory=True)


def _link_file_to_a_copy(out, tmp_path):
    copy = tmp_path / "outside-model.pth"
    (out / "full/model.pth").rename(copy)
    (out / "full/model.pth").symlink_to(copy)


@pytest.mark.parametrize(("relink", "why"), [
    (_link_dir_to_a_copy, "reached through a symbolic link (full)"),
    (_link_file_to_a_copy, "not a regular file (a symbolic link)"),
], ids=["linked-directory", "linked-file"])
def test_a_link_to_identical_bytes_voids_the_manifest(written, tmp_path, relink, why):
    """Outputs swapped for links to the very same bytes elsewhere are not the stage's outputs any more."""
    out, path = written
    relink(out, tmp_path)
    problem = manifest_problem(path, out, "train_full", "fp1", OUTPUTS)
    assert problem is not None and why in problem


def test_a_manifest_is_never_written_for_outputs_behind_a_link(tmp_path):
    """Describing outputs reads them without following links: a linked directory is refused, not hashed."""
    from pipeline.files import OutputRefused

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.pth").write_bytes(b"host file")
    out = tmp_path / "output"
    out.mkdir()
    (out / "full").symlink_to(outside, target_is_directory=True)
    with pytest.raises(OutputRefused):
        write_manifest(manifest_path(out, "s"), out, "s", "fp", ("full/model.pth",))
    assert not manifest_path(out, "s").exists()


def test_a_different_stage_definition_voids_the_manifest(written):
    """A manifest from another fingerprint or another output list does not count."""
    out, path = written
    assert "different stage definition" in manifest_problem(path, out, "train_full", "fp2", OUTPUTS)
    assert "different outputs" in manifest_problem(path, out, "train_full", "fp1", OUTPUTS[:1])


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    """The target holds the new bytes and no temp file remains beside it."""
    target = tmp_path / "file.bin"
    target.write_bytes(b"old")
    atomic_write_bytes(target, b"new content")
    assert target.read_bytes() == b"new content"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]


def test_atomic_write_failure_keeps_old_content(tmp_path, monkeypatch):
    """A write that fails before the rename leaves the old file intact and no temp behind."""
    target = tmp_path / "file.bin"
    target.write_bytes(b"old")

    def broken_replace(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr("pipeline.manifest.os.replace", broken_replace)
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]


def test_remove_stale_temps_only_touches_temp_files(tmp_path):
    """Leftovers of interrupted atomic writes are removed; real files stay."""
    (tmp_path / ".model.pth.tmp-123").write_bytes(b"half")
    (tmp_path / "model.pth").write_bytes(b"whole")
    remove_stale_temps(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pth"]


def test_recorded_outputs_gives_each_manifests_digests(written):
    """recorded_outputs reads every stage manifest: (sha256, size) by output path."""
    out, _ = written
    write_manifest(manifest_path(out, "embed"), out, "embed", "fp2", ["full/config.json"])
    assert {rel: (entry.sha256, entry.size) for rel, entry in recorded_outputs(out).items()} == {
        rel: (file_sha256(out / rel), (out / rel).stat().st_size) for rel in OUTPUTS}


@pytest.fixture
def no_racy_margin(monkeypatch):
    """Files count as settled as soon as they are hashed (the tests write them just before)."""
    monkeypatch.setattr(pipeline.files, "RACY_MARGIN_NS", 0)
    monkeypatch.setattr(pipeline.files, "RACY_MARGIN_WHOLE_SECONDS_NS", 0)


def test_a_manifest_this_process_wrote_records_each_settled_files_identity(tmp_path, no_racy_margin):
    """A settled file's identity is recorded with its digest, and recorded_outputs hands it on."""
    out = tmp_path / "output"
    for rel in OUTPUTS:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(rel.encode())
    write_manifest(manifest_path(out, "train_full"), out, "train_full", "fp1", OUTPUTS)
    assert {rel: entry.identity for rel, entry in recorded_outputs(out).items()} == {
        rel: FileIdentity.of(os.stat(out / rel)) for rel in OUTPUTS}


def test_a_racy_file_gets_no_identity(tmp_path, monkeypatch):
    """A file changed less than the racy margin before its hashing ended is recorded without an identity."""
    out = tmp_path / "output"
    (out / "full").mkdir(parents=True)
    (out / "full/model.pth").write_bytes(b"just written")
    changed_ns = os.stat(out / "full/model.pth").st_ctime_ns
    clock = type("Clock", (), {"time_ns": staticmethod(lambda: changed_ns + pipeline.files.RACY_MARGIN_NS - 1),
                               "sleep": staticmethod(lambda _s: None)})
    monkeypatch.setattr(pipeline.files, "time", clock)
    write_manifest(manifest_path(out, "train_full"), out, "train_full", "fp1", ["full/model.pth"])
    assert recorded_outputs(out)["full/model.pth"].identity is None


def test_a_file_hashed_right_after_its_last_write_waits_out_the_margin_and_keeps_its_identity(tmp_path):
    """A stage's freshly written output is hashed once the racy margin has passed, so its identity is kept."""
    out = tmp_path / "output"
    (out / "full").mkdir(parents=True)
    (out / "full/model.pth").write_bytes(b"just written")
    write_manifest(manifest_path(out, "train_full"), out, "train_full", "fp1", ["full/model.pth"])
    assert recorded_outputs(out)["full/model.pth"].identity == FileIdentity.of(os.stat(out / "full/model.pth"))


def test_a_manifest_not_sealed_by_this_process_vouches_no_identity(tmp_path, no_racy_margin, monkeypatch):
    """An edited manifest, or one another process wrote, keeps its digests but loses its identities."""
    out = tmp_path / "output"
    (out / "full").mkdir(parents=True)
    (out / "full/model.pth").write_bytes(b"weights")
    path = manifest_path(out, "train_full")
    write_manifest(path, out, "train_full", "fp1", ["full/model.pth"])
    assert recorded_outputs(out)["full/model.pth"].identity is not None
    manifest = json.loads(path.read_text())
    manifest["outputs"]["full/model.pth"]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    assert recorded_outputs(out)["full/model.pth"] == pipeline.manifest.Recorded("0" * 64, 7, None)
    write_manifest(path, out, "train_full", "fp1", ["full/model.pth"])
    monkeypatch.setattr(pipeline.manifest, "_SEAL_KEY", b"another process")
    assert recorded_outputs(out)["full/model.pth"].identity is None


def test_recorded_outputs_leaves_out_what_manifests_dispute_or_garble(written):
    """An output two manifests disagree about, or a malformed entry, gets no recorded digest."""
    out, path = written
    manifest = json.loads(path.read_text())
    manifest["outputs"]["full/config.json"]["sha256"] = "0" * 64
    manifest["outputs"]["full/model.pth"]["sha256"] = "not hex"
    (path.parent / "other.json").write_text(json.dumps(manifest))
    (path.parent / "garbled.json").write_text("{")
    assert recorded_outputs(out) == {}


def test_recorded_outputs_reads_no_manifest_behind_a_link(written, tmp_path):
    """A manifests directory replaced by a link records nothing (and no directory at all records nothing)."""
    out, path = written
    elsewhere = tmp_path / "elsewhere"
    path.parent.rename(elsewhere)
    path.parent.symlink_to(elsewhere, target_is_directory=True)
    assert recorded_outputs(out) == {}
    path.parent.unlink()
    assert recorded_outputs(out) == {}
