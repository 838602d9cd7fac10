"""Checkpoint files: atomic, bounded, newest first, and a fingerprint of what they train."""

from __future__ import annotations

import os

import pytest
from voice_trainers.checkpoints import (
    atomic_write,
    checkpoint_path,
    list_checkpoints,
    prune,
    remove_stale_temps,
    run_fingerprint,
)


def test_atomic_write_replaces_the_file_and_leaves_no_temp(tmp_path):
    """The new content is in place and only the target file is in the directory."""
    target = tmp_path / "step-00000002.pt"
    target.write_bytes(b"old")
    atomic_write(target, lambda handle: handle.write(b"new"))
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["step-00000002.pt"]


def test_a_write_that_fails_keeps_the_old_file(tmp_path):
    """A crash halfway through a write leaves the previous checkpoint whole and no temp file."""
    target = tmp_path / "model.pth"
    target.write_bytes(b"old")

    def half_then_fail(handle):
        handle.write(b"ne")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.pth"]


def test_checkpoints_are_listed_newest_first_and_others_ignored(tmp_path):
    """Only step files count, ordered by step; caches, temps and foreign files are not checkpoints."""
    for step in (2, 10, 4):
        checkpoint_path(tmp_path, step).write_bytes(b"x")
    for name in ("step-2.pt", ".tmp-step-00000012.pt.99", "notes.txt", "phonemes-abc"):
        (tmp_path / name).write_bytes(b"x")
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10, 4, 2]
    assert list_checkpoints(tmp_path / "missing") == []


def test_prune_keeps_the_newest(tmp_path):
    """Pruning to two leaves the two highest steps."""
    for step in (2, 4, 6, 8):
        checkpoint_path(tmp_path, step).write_bytes(b"x")
    removed = prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step-00000002.pt", "step-00000004.pt"]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [8, 6]


def test_stale_temps_of_a_killed_run_are_removed(tmp_path):
    """Temp files left by a kill go; real files stay."""
    (tmp_path / ".tmp-step-00000004.pt.123").write_bytes(b"half")
    checkpoint_path(tmp_path, 2).write_bytes(b"x")
    remove_stale_temps(tmp_path)
    assert os.listdir(tmp_path) == ["step-00000002.pt"]


def test_the_run_fingerprint_follows_every_part():
    """Same parts in any order give the same fingerprint; any changed part gives another."""
    base = run_fingerprint(dataset="d", profile={"steps": 6, "batch": 2}, voice="en-us")
    assert run_fingerprint(voice="en-us", profile={"batch": 2, "steps": 6}, dataset="d") == base
    assert run_fingerprint(dataset="d", profile={"steps": 7, "batch": 2}, voice="en-us") != base
    assert run_fingerprint(dataset="e", profile={"steps": 6, "batch": 2}, voice="en-us") != base
    assert run_fingerprint(dataset="d", profile={"steps": 6, "batch": 2}, voice="en-gb") != base
