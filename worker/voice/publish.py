"""Publishing the artifacts where the profile's ``modelPaths`` can keep naming them.

An attempt's output directory is scratch: it is removed after the commit. The profile's local model
paths are part of what "completed" means, so before they are written (commit step 3) each artifact
is copied to ``$MODELS_ROOT/<environment>/<directoryName>/<jobId>/<sha256>/<relative path>``:

- content-addressed: a file's directory is named by its SHA-256, so two attempts that trained
  different bytes publish to different paths, and a stale attempt can never change what a committed
  profile names;
- no second copy, no second hash: the attempt's own file is hard-linked to its final name, after its
  data is fsynced, when the descriptor opened for it still shows the identity its stage manifest
  recorded with the digest (``pipeline.manifest.Recorded``: nothing wrote to it since it was hashed)
  and MODELS_ROOT is on the same file system. The attempt's output directory is removed after the
  commit, which only drops its name for the file. Otherwise (another file system, no identity) the
  file is copied to a temp file in the same directory, hashed as it is copied, fsynced and then
  hard-linked to its final name;
- read-only (no write bit) and never replaced: ``os.link`` fails when the name exists; an existing
  file is kept when its size and SHA-256 match, and refused (a retryable ``StorageError``) when they
  do not;
- written before the paths, not after the commit: once step 3 has written them, a crash at any later
  point leaves a profile whose paths already exist, and a retry (``worker.voice.commit.reusable_paths``)
  finds them.

Nothing here removes a published file; the job's scratch cleanup never reaches ``MODELS_ROOT``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import structlog

from pipeline.files import FileIdentity, OutputRefused, fsync_dir, open_output, sha256_and_size, sha256_and_size_of
from pipeline.manifest import Recorded
from pipeline.workdir import published_path
from worker.voice.errors import StorageError

log = structlog.get_logger(__name__)

_TEMP_MARKER = ".publishing-"
_WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
# Why a hard link of the open file can fail where a copy would not: another file system, no /proc
# mounted (the link goes through /proc/self/fd), a kernel's hard-link protection, too many links.
_CANNOT_LINK = frozenset({errno.EXDEV, errno.ENOENT, errno.EPERM, errno.EACCES, errno.EMLINK, errno.EOPNOTSUPP})


def publish_all(base_dir: Path, sources: Mapping[str, str], rels: Mapping[str, str],
                digests: Mapping[str, str], models_dir: Path,
                recorded: Mapping[str, Recorded] | None = None) -> dict[str, Path]:
    """Publish each artifact; the published paths.

    ``sources``: each file's path under ``base_dir`` (read by the pipeline's one output rule, no link
    followed); ``rels``: its path relative to the output directory; ``digests``: the SHA-256 its S3
    object was stored under, which the published file must hold too; ``recorded``: what the stage
    manifests record by path under ``base_dir`` (``pipeline.manifest.recorded_outputs``).
    """
    recorded = recorded or {}
    try:
        return {name: publish_file(base_dir, sources[name], rels[name], digests[name], models_dir,
                                   _identity_for(recorded.get(sources[name]), digests[name]))
                for name in sources}
    except OSError as exc:
        raise StorageError(f"publishing the models failed at {Path(exc.filename or 'MODELS_ROOT').name}: "
                           f"{exc.strerror or exc}") from exc


def _identity_for(recorded: Recorded | None, sha256_hex: str) -> FileIdentity | None:
    return recorded.identity if recorded is not None and recorded.sha256 == sha256_hex else None


def publish_file(base_dir: Path, source_rel: str, rel: str, sha256_hex: str, models_dir: Path,
                 identity: FileIdentity | None = None) -> Path:
    """Publish one file; returns its published path (the existing one when the same bytes are there).

    ``identity``: the file's identity when it was hashed to ``sha256_hex``; while the open file still
    shows it, the file itself is linked into place, else a copy is checked against the digest."""
    final = published_path(models_dir, sha256_hex, rel)
    if final == Path(base_dir) / source_rel:
        return final  # already the published file (a retry reusing the profile's paths)
    try:
        fd = open_output(Path(base_dir), source_rel)
    except OutputRefused as exc:
        raise StorageError(f"artifact {source_rel} cannot be published: {exc}") from exc
    with os.fdopen(fd, "rb") as source:
        now = FileIdentity.of_fd(source.fileno())
        size = now.size
        if _same_file_there(final, sha256_hex, size):
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        if identity is not None and identity == now and _linked(source.fileno(), final, sha256_hex, size, identity):
            fsync_dir(final.parent)
            log.info("artifacts.published", file=rel, sha256=sha256_hex, linked=True)
            return final
        temp = final.with_name(f".{final.name}{_TEMP_MARKER}{os.getpid()}-{os.urandom(4).hex()}")
        try:
            if _copy(source, temp)[0] != sha256_hex:
                raise StorageError(f"{rel} changed since it was uploaded: its bytes no longer match "
                                   f"{sha256_hex[:12]}")
            try:
                os.link(temp, final)
            except FileExistsError:
                # Someone (another attempt) published first: theirs stays, if it holds the same bytes.
                if not _same_file_there(final, sha256_hex, size):
                    raise StorageError(f"published file {final} exists with other content; it is never "
                                       "replaced") from None
            fsync_dir(final.parent)
        finally:
            temp.unlink(missing_ok=True)
    log.info("artifacts.published", file=rel, sha256=sha256_hex)
    return final


def _linked(fd: int, final: Path, sha256_hex: str, size: int, identity: FileIdentity) -> bool:
    """Hard-link the open file itself (the inode whose identity was checked, not whatever its path
    names now) to ``final``, its data synced first; False when this file system cannot, or the file
    was written to meanwhile, to copy (and hash) instead."""
    os.fsync(fd)  # the model paths written next must name bytes that are on disk
    # One file now has two names, the attempt's and the published one. Nothing writes the attempt's
    # any more (every stage process ended with its keeper, a child subreaper, before the manifest
    # hashed it, and the job's survivors on this host are ended before each step); read-only, it
    # also refuses a later open for writing through either name.
    try:
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~_WRITE_BITS)
    except PermissionError:
        return False  # not this process's file to make read-only: a copy is
    # A directory descriptor makes os.link call linkat(AT_SYMLINK_FOLLOW), which links the inode the
    # /proc entry stands for; plain link(2) would try to link the /proc entry itself.
    dir_fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.link(f"/proc/self/fd/{fd}", final.name, dst_dir_fd=dir_fd, follow_symlinks=True)
    except FileExistsError:
        # Someone (another attempt) published first: theirs stays, if it holds the same bytes.
        if not _same_file_there(final, sha256_hex, size):
            raise StorageError(f"published file {final} exists with other content; it is never replaced") from None
    except OSError as exc:
        if exc.errno in _CANNOT_LINK:
            return False
        raise
    else:
        if not _unwritten_since(fd, identity):
            os.unlink(final.name, dir_fd=dir_fd)  # our own link, made a moment ago: nothing names it yet
            return False
    finally:
        os.close(dir_fd)
    return True


def _unwritten_since(fd: int, identity: FileIdentity) -> bool:
    """Whether the file still has the content ``identity`` was recorded with. Its change time moved (the
    mode, the link), so the rest is compared: same file, size and modification time."""
    now = FileIdentity.of_fd(fd)
    return (now.device, now.inode, now.size, now.mtime_ns) == (
        identity.device, identity.inode, identity.size, identity.mtime_ns)


def _same_file_there(path: Path, sha256_hex: str, size: int) -> bool:
    """Whether ``path`` is a regular file (not a link) holding exactly these bytes; a mismatch raises."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISREG(info.st_mode) and info.st_size == size and sha256_and_size(path) == (sha256_hex, size):
        return True
    raise StorageError(f"published file {path} exists with other content; it is never replaced")


def _copy(source: BinaryIO, temp: Path) -> tuple[str, int]:
    """Copy into a new ``temp`` (exclusive create), fsynced; the (sha256, size) of what was copied."""
    dst_fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o440)  # published: read-only
    with os.fdopen(dst_fd, "wb") as dst:
        return sha256_and_size_of(source, copy_to=dst)
