"""File helpers shared by the pipeline and the uploader: whole-file hashing, directory fsync, and the
one rule for reading and removing declared outputs (regular files, no symlink on the way)."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

HASH_CHUNK_BYTES = 1 << 20
# A file whose last change is closer than this to the start of its hashing is "racy" (git's word): a
# write during the hashing could land in the same timestamp tick (the kernel stamps files from a
# coarse clock, a few ms) and leave its identity unchanged. Timestamps without a sub-second part (a file system that
# keeps whole seconds) need a margin of more than one of their ticks.
RACY_MARGIN_NS = 50_000_000
RACY_MARGIN_WHOLE_SECONDS_NS = 2_000_000_000
# The longest a hashing waits for a just-written file to settle (see output_digest).
SETTLE_WAIT_MAX_NS = 50_000_000


@dataclass(frozen=True)
class FileIdentity:
    """What changes whenever a file's bytes do, read with one ``fstat``: the same file (device and
    inode), its size, and its modification and change times. A write, truncate or rename-over changes
    at least one of them; the change time cannot be set back by an unprivileged process. Recorded
    when a file is hashed, it lets a later reader trust that digest without reading the bytes again
    (the way git's index and rsync decide a file is unchanged), provided it was not racy then."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> FileIdentity:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    @classmethod
    def of_fd(cls, fd: int) -> FileIdentity:
        return cls.of(os.fstat(fd))

    def as_record(self) -> list[int]:
        return [self.device, self.inode, self.size, self.mtime_ns, self.ctime_ns]

    @classmethod
    def from_record(cls, value: object) -> FileIdentity | None:
        """The identity a manifest recorded; None for anything malformed (then the digest is checked)."""
        if not (isinstance(value, list) and len(value) == 5
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
            return None
        return cls(*value)


def racy_margin_ns(identity: FileIdentity) -> int:
    """How long after its last change a file's timestamps can no longer hide a further write."""
    whole_seconds = identity.mtime_ns % 1_000_000_000 == 0 and identity.ctime_ns % 1_000_000_000 == 0
    return RACY_MARGIN_WHOLE_SECONDS_NS if whole_seconds else RACY_MARGIN_NS


def settled_identity(before: FileIdentity, after: FileIdentity, started_ns: int) -> FileIdentity | None:
    """The identity to record for a file hashed between the two ``fstat`` calls, the hashing begun at
    ``started_ns``, or None when it cannot vouch for the digest: the file changed while it was hashed,
    or it had changed less than the racy margin before the hashing began (a write during the hashing
    could then share the last change's timestamp tick and leave the identity as it was)."""
    if before != after:
        return None
    return after if started_ns - max(after.mtime_ns, after.ctime_ns) >= racy_margin_ns(after) else None


def sha256_and_size(path: Path) -> tuple[str, int]:
    """(hex SHA-256, size in bytes) of a file, read in bounded chunks.

    The size is what was hashed, so the pair describes one and the same content.
    """
    with open(path, "rb") as handle:
        return sha256_and_size_of(handle)


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


# --- declared outputs: regular files inside the output directory, reached without a symlink
#
# A stage can make any path under its output directory a symbolic link, to a directory or a file
# anywhere on the host. Checking a path (``is_file``, ``stat``) follows such links, and an ``lstat``
# of the last component alone does not see a link earlier in the path: ``output/full -> /etc`` makes
# ``output/full/passwd`` look like a trained model. So every reader of an output opens it here, one
# component at a time relative to the directory before it, refusing a link at each step; what was
# checked is the open descriptor, so nothing swapped in after the check is what gets read.

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO a stage left behind must not block the worker; a regular file ignores it.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class OutputRefused(Exception):
    """A declared output that is not a non-empty regular file reached without a symlink; the message says why."""


def output_parts(relative_path: str) -> list[str]:
    """The components of a declared output's path relative to the output dir; ValueError if it could leave it."""
    if not relative_path or relative_path.startswith("/") or "\\" in relative_path:
        raise ValueError(f"output path must be relative to the output dir: {relative_path!r}")
    parts = [part for part in relative_path.split("/") if part not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"output path must stay under the output directory: {relative_path!r}")
    return parts


def relative_output(output_dir: Path, path: Path) -> str:
    """``path`` relative to ``output_dir`` as a POSIX string, compared lexically (no link is resolved)."""
    return Path(os.path.normpath(path)).relative_to(os.path.normpath(output_dir)).as_posix()


def _open_dir(name: str | Path, dir_fd: int | None, shown: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise OutputRefused(f"missing ({shown} does not exist)") from None
    except OSError as exc:
        raise OutputRefused(_component_problem(name, dir_fd, shown, exc)) from None


def _component_problem(name: str | Path, dir_fd: int | None, shown: str, exc: OSError) -> str:
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        info = None
    if info is not None and stat.S_ISLNK(info.st_mode):
        return f"reached through a symbolic link ({shown})"
    if info is not None and not stat.S_ISDIR(info.st_mode):
        return f"missing ({shown} is not a directory)"
    return f"unreadable ({exc.strerror or type(exc).__name__})"


def open_output(output_dir: Path, relative_path: str) -> int:
    """A read-only descriptor of the declared output, or ``OutputRefused`` saying why not.

    The output directory itself and every component below it must be a real directory (no symlink),
    and the file a non-empty regular file. The caller closes the descriptor.
    """
    file_fd = open_regular(output_dir, relative_path)
    try:
        if os.fstat(file_fd).st_size == 0:
            raise OutputRefused("empty")
    except BaseException:
        os.close(file_fd)
        raise
    return file_fd


def open_regular(root: Path, relative_path: str) -> int:
    """A read-only descriptor of the regular file ``root/relative_path`` (empty allowed), reached with no
    link in any component, ``root`` included; ``OutputRefused`` saying why not. The caller closes it."""
    parts = output_parts(relative_path)
    fd = _walk_dirs(root, parts[:-1])
    try:
        try:
            file_fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            raise OutputRefused("missing") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OutputRefused("not a regular file (a symbolic link)") from None
            raise OutputRefused(f"unreadable ({exc.strerror or type(exc).__name__})") from None
    finally:
        os.close(fd)
    try:
        if not stat.S_ISREG(os.fstat(file_fd).st_mode):
            raise OutputRefused("not a regular file")
        os.set_blocking(file_fd, True)
    except BaseException:
        os.close(file_fd)
        raise
    return file_fd


def open_real_dir(root: Path, relative_path: str) -> int:
    """A descriptor of the directory ``root/relative_path``, ``root`` and every component below it a real
    directory (no link); ``OutputRefused`` saying why not. The caller closes it."""
    return _walk_dirs(root, output_parts(relative_path))


def _walk_dirs(root: Path, parts: list[str]) -> int:
    fd = _open_dir(root, None, Path(root).name or str(root))
    try:
        for depth, part in enumerate(parts, start=1):
            next_fd = _open_dir(part, fd, "/".join(parts[:depth]))
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def output_problem(output_dir: Path, relative_path: str) -> str | None:
    """Why a declared output is not acceptable (see ``open_output``), or None when it is."""
    try:
        os.close(open_output(output_dir, relative_path))
    except OutputRefused as exc:
        return str(exc)
    return None


def output_digest(output_dir: Path, relative_path: str) -> tuple[str, int, FileIdentity | None]:
    """(hex SHA-256, size, identity) of a declared output, read through ``open_output`` (``OutputRefused``
    if refused): the identity
    (``settled_identity``) is None unless it can later vouch for this digest without a second read."""
    with os.fdopen(open_output(output_dir, relative_path), "rb") as handle:
        before = FileIdentity.of_fd(handle.fileno())
        # A stage's last file is often hashed within milliseconds of its last write: waiting out the
        # (sub-second) margin first costs at most 50 ms a stage and spares the uploader and the
        # publisher a second read of it. Whole-second timestamps would mean seconds: not waited for.
        wait_ns = racy_margin_ns(before) - (time.time_ns() - max(before.mtime_ns, before.ctime_ns))
        if 0 < wait_ns <= SETTLE_WAIT_MAX_NS:
            time.sleep(wait_ns / 1e9)
            before = FileIdentity.of_fd(handle.fileno())
        started_ns = time.time_ns()
        sha256_hex, size = sha256_and_size_of(handle)
        after = FileIdentity.of_fd(handle.fileno())
    return sha256_hex, size, settled_identity(before, after, started_ns)


def sha256_and_size_of(handle: BinaryIO, copy_to: BinaryIO | None = None) -> tuple[str, int]:
    """(hex SHA-256, size in bytes) of what is left to read from an open file, in bounded chunks.

    With ``copy_to`` the bytes are also written there and synced to disk: the digest is then that of
    exactly what was copied, read once.
    """
    digest = hashlib.sha256()
    size = 0
    while chunk := handle.read(HASH_CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
    if copy_to is not None:
        copy_to.flush()
        os.fsync(copy_to.fileno())
    return digest.hexdigest(), size


def remove_output(output_dir: Path, relative_path: str) -> None:
    """Remove a declared output, never through a link: a symlink met on the way is itself removed.

    The walk opens each directory relative to the one before it without following links; a
    component that is a link (to a directory or anything else) is unlinked and the walk ends there,
    since what lies beyond it is not the job's. A real directory at the end is removed with
    ``shutil.rmtree`` (fd-based, it does not follow links either). A symlinked output directory is
    left alone: nothing below it is read as an output (``open_output`` refuses it).
    """
    parts = output_parts(relative_path)
    try:
        fd = os.open(output_dir, _DIR_FLAGS)
    except OSError:
        return
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return
            except OSError:
                if _is_link(part, fd):
                    os.unlink(part, dir_fd=fd)
                return  # a link (now removed) or a file where a directory should be
            os.close(fd)
            fd = next_fd
        _remove_entry(parts[-1], fd)
    finally:
        os.close(fd)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _remove_entry(name: str, dir_fd: int) -> None:
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def real_directory(base: Path, relative_path: str, *, empty: bool = False) -> Path:
    """``base/relative_path`` made a real directory reached from ``base`` without a link; returns its path.

    A stage can replace any directory of its attempt (``checkpoints``, ``checkpoints/<stage>``,
    ``output``) with a link out of the job; ``mkdir(parents=True)`` and ``rmtree`` of such a path act
    on what it points to. Here each component is opened relative to the one before without following
    links, and one that is a link (or anything but a directory) is unlinked itself, never followed,
    and a real directory made in its place. With ``empty`` the last directory is removed first
    (fd-based ``rmtree``, no link followed) and made again. ``base`` is made when missing, and must
    then be a real directory: an ``OSError`` otherwise, since what lies above it is not the stage's
    to replace.
    """
    parts = output_parts(relative_path)
    Path(base).mkdir(parents=True, exist_ok=True)
    fd = os.open(base, _DIR_FLAGS)
    try:
        for depth, part in enumerate(parts, start=1):
            if empty and depth == len(parts):
                _remove_entry(part, fd)
            next_fd = _open_or_make_dir(part, fd)
            os.close(fd)
            fd = next_fd
    finally:
        os.close(fd)
    return Path(base, *parts)


def _open_or_make_dir(name: str, dir_fd: int) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=dir_fd)  # the link (or file) goes, what it points to stays
    try:
        os.mkdir(name, dir_fd=dir_fd)
    except FileExistsError:
        pass  # made meanwhile: the open below still refuses it unless it is a real directory
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
