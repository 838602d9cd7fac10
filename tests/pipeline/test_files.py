"""The shared file helpers: whole-file hashing and directory fsync."""

from __future__ import annotations

import hashlib

import pytest

from pipeline.files import HASH_CHUNK_BYTES, file_sha256, fsync_dir, sha256_and_size


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
