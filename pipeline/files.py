"""File helpers shared by the pipeline and the uploader: whole-file hashing and directory fsync."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HASH_CHUNK_BYTES = 1 << 20


def sha256_and_size(path: Path) -> tuple[str, int]:
    """(hex SHA-256, size in bytes) of a file, read in bounded chunks.

    The size is what was hashed, so the pair describes one and the same content.
    """
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    return sha256_and_size(path)[0]


def fsync_dir(directory: Path, *, strict: bool = False) -> None:
    """Make a rename in ``directory`` durable.

    Best effort by default: where a directory cannot be opened or synced, it is skipped. ``strict``
    callers, for whom an unsynced rename is a failed write, get the ``OSError`` instead.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)
