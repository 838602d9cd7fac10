"""The shared file helpers: whole-file hashing, directory fsync, and reading and removing declared outputs
without following links."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

import pipeline.files
from pipeline.files import (
    HASH_CHUNK_BYTES,
    RACY_MARGIN_NS,
    RACY_MARGIN_WHOLE_SECONDS_NS,
    FileIdentity,
    file_sha256,
    fsync_dir,
    output_digest,
    output_problem,
    real_directory,
    remove_output,
    settled_identity,
    sha256_and_size,
)


def test_hash_and_size_cover_every_chunk(tmp_path):
    """A file longer than one read chunk is hashed and counted whole."""
    data = bytes(range(256)) * (HASH_CHUNK_BYTES // 256 * 2 + 3)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    assert sha256_and_size(path) == (hashlib.sha256(data).hexdigest(), len(data))
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()


def test_fsync_dir_is_best_effort_unless_strict(tmp_path):
    """A directory that cannot be opened is skipped by default and an error for a strict caller."""
    missing = tmp_path / "gone"
    fsync_dir(tmp_path, strict=True)
    fsync_dir(missing)
    with pytest.raises(OSError):
        fsync_dir(missing, strict=True)


# ---------------------------------------------------------------- declared outputs


def _output(tmp_path):
    out = tmp_path / "output"
    (out / "full").mkdir(parents=True)
    (out / "full/model.pth").write_bytes(b"weights")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.pth").write_bytes(b"host file")
    return out, outside


def test_a_regular_file_inside_the_output_dir_is_an_output(tmp_path):
    """A non-empty regular file reached through real directories opens and hashes."""
    out, _ = _output(tmp_path)
    assert output_problem(out, "full/model.pth") is None
    assert output_digest(out, "full/model.pth")[:2] == (hashlib.sha256(b"weights").hexdigest(), 7)


@pytest.mark.parametrize(("change", "why"), [
    (lambda out, outside: (out / "full/model.pth").unlink(), "missing"),
    (lambda out, outside: (out / "full/model.pth").write_bytes(b""), "empty"),
    (lambda out, outside: ((out / "full/model.pth").unlink(), (out / "full/model.pth").mkdir()),
     "not a regular file"),
    (lambda out, outside: ((out / "full/model.pth").unlink(), os.mkfifo(out / "full/model.pth")),
     "not a regular file"),
    (lambda out, outside: ((out / "full/model.pth").unlink(),
                           (out / "full/model.pth").symlink_to(outside / "model.pth")),
     "not a regular file (a symbolic link)"),
    (lambda out, outside: (shutil.rmtree(out / "full"), (out / "full").symlink_to(outside)),
     "reached through a symbolic link (full)"),
    (lambda out, outside: (shutil.rmtree(out / "full"), (out / "full").write_bytes(b"x")),
     "missing (full is not a directory)"),
], ids=["missing", "empty", "directory", "fifo", "linked-file", "linked-directory", "file-as-directory"])
def test_anything_but_a_regular_file_reached_without_a_link_is_refused(tmp_path, change, why):
    """Missing, empty, a directory, a FIFO (without blocking), a link, or a link on the way: each refused."""
    out, outside = _output(tmp_path)
    change(out, outside)
    assert output_problem(out, "full/model.pth") == why


def test_a_linked_output_directory_is_refused(tmp_path):
    """The output directory itself may not be a link either."""
    out, _ = _output(tmp_path)
    link = tmp_path / "linked-output"
    link.symlink_to(out, target_is_directory=True)
    assert "symbolic link" in output_problem(link, "full/model.pth")


@pytest.mark.parametrize("rel", ["", ".", "/etc/passwd", "../x", "full/../../x", "a\\b"])
def test_an_output_path_that_could_leave_the_output_dir_is_a_value_error(tmp_path, rel):
    """Absolute, climbing or empty declared paths never reach the file system."""
    with pytest.raises(ValueError):
        output_problem(tmp_path, rel)


def test_removing_an_output_behind_a_linked_directory_removes_only_the_link(tmp_path):
    """full -> outside: removing full/model.pth unlinks the link and leaves the outside file."""
    out, outside = _output(tmp_path)
    shutil.rmtree(out / "full")
    (out / "full").symlink_to(outside, target_is_directory=True)
    remove_output(out, "full/model.pth")
    assert not os.path.lexists(out / "full")
    assert (outside / "model.pth").read_bytes() == b"host file"


def test_removing_a_linked_output_removes_the_link_not_its_target(tmp_path):
    """A declared output that is a link (to a file or a directory) is unlinked; the target stays."""
    out, outside = _output(tmp_path)
    (out / "full/model.pth").unlink()
    (out / "full/model.pth").symlink_to(outside, target_is_directory=True)
    remove_output(out, "full/model.pth")
    assert not os.path.lexists(out / "full/model.pth")
    assert (outside / "model.pth").read_bytes() == b"host file"


def test_removing_outputs_takes_real_files_and_directories_and_ignores_what_is_absent(tmp_path):
    """A regular file is unlinked, a real directory removed whole, a missing one is no error."""
    out, _ = _output(tmp_path)
    remove_output(out, "full/model.pth")
    assert not (out / "full/model.pth").exists()
    (out / "full/nested").mkdir()
    (out / "full/nested/x").write_bytes(b"x")
    remove_output(out, "full")
    assert not (out / "full").exists()
    remove_output(out, "full/model.pth")
    remove_output(tmp_path / "no-output-dir", "full/model.pth")


def test_real_directory_replaces_links_and_files_on_the_way(tmp_path):
    """A link and a plain file where directories belong are removed themselves; their targets stay whole."""
    outside = tmp_path / "outside"
    (outside / "b").mkdir(parents=True)
    (outside / "b" / "keep").write_bytes(b"x")
    base = tmp_path / "attempt"
    base.mkdir()
    (base / "a").symlink_to(outside)
    made = real_directory(base, "a/b", empty=True)
    assert made == base / "a" / "b" and not (base / "a").is_symlink() and made.is_dir()
    assert (outside / "b" / "keep").read_bytes() == b"x"
    (made / "old").write_bytes(b"y")
    (base / "c").write_bytes(b"not a dir")
    real_directory(base, "c/d")
    assert (base / "c" / "d").is_dir()
    assert real_directory(base, "a/b", empty=True) == made and list(made.iterdir()) == []


def test_real_directory_refuses_a_linked_base(tmp_path):
    """The base itself is never replaced or followed: a link there is an OSError."""
    (tmp_path / "real").mkdir()
    (tmp_path / "base").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        real_directory(tmp_path / "base", "checkpoints/train")
    assert list((tmp_path / "real").iterdir()) == []


IDENTITY = FileIdentity(device=1, inode=2, size=3, mtime_ns=10_000_000_123, ctime_ns=10_000_000_456)


def test_a_file_unchanged_while_hashed_and_settled_long_enough_keeps_its_identity():
    """Hashing begun a full racy margin after its last change, the same identity before and after: vouched."""
    started_ns = IDENTITY.ctime_ns + RACY_MARGIN_NS
    assert settled_identity(IDENTITY, IDENTITY, started_ns) == IDENTITY
    assert settled_identity(IDENTITY, IDENTITY, started_ns - 1) is None


def test_a_file_that_changed_while_it_was_hashed_gets_no_identity():
    """Any difference between the identity before and after the hashing: the digest vouches for nothing."""
    later = FileIdentity(1, 2, 3, IDENTITY.mtime_ns, IDENTITY.ctime_ns + 1)
    assert settled_identity(IDENTITY, later, IDENTITY.ctime_ns + 10 * RACY_MARGIN_NS) is None


def test_whole_second_timestamps_need_a_margin_of_more_than_a_second():
    """A file system that keeps whole seconds could stamp a later write with the same second."""
    coarse = FileIdentity(1, 2, 3, mtime_ns=10_000_000_000, ctime_ns=10_000_000_000)
    assert settled_identity(coarse, coarse, coarse.ctime_ns + RACY_MARGIN_NS) is None
    assert settled_identity(coarse, coarse, coarse.ctime_ns + RACY_MARGIN_WHOLE_SECONDS_NS) == coarse


def test_output_digest_gives_the_identity_the_open_file_had(tmp_path, monkeypatch):
    """output_digest's identity is the file's own fstat when it is settled."""
    monkeypatch.setattr(pipeline.files, "RACY_MARGIN_NS", 0)
    out = tmp_path / "out"
    (out / "full").mkdir(parents=True)
    (out / "full/model.pth").write_bytes(b"weights")
    sha256_hex, size, identity = output_digest(out, "full/model.pth")
    assert (sha256_hex, size) == (hashlib.sha256(b"weights").hexdigest(), 7)
    assert identity == FileIdentity.of(os.stat(out / "full/model.pth"))
