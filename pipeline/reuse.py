"""A retry's head start: copying an earlier attempt's finished work into the new attempt's directory.

Each attempt works in a directory of its own (``pipeline.workdir.work_layout``), so an attempt that lost
its job (its worker stopped, cut off, or killed while its trainer survived) can never write into the
new attempt's files. What it already finished is still worth having, so before the steps run:

- a stage whose manifest verifies in an earlier attempt (newest first) gets that attempt's outputs
  copied, each one checked against the manifest's size and SHA-256 *as it is copied* (a stale
  trainer could still be rewriting the source), and the manifest written last, atomically: the stage
  is then skipped, exactly as if it had run here;
- a resumable stage with no such manifest gets the newest earlier checkpoint directory copied, so it
  resumes instead of starting over;
- a recording downloaded by an earlier attempt is moved (renamed) rather than fetched again (a download
  is renamed into place only when whole, so a file under its final name is complete). Moved, not
  copied: only the worker writes downloads, never a trainer, and this host's earlier stages were
  ended first (``end_survivors``), so a retry costs no second copy of the recordings. On a shared
  work root (another host's stale attempt may still read it) they are copied.

Outputs and checkpoints are copied, never hard-linked: a surviving old trainer writing a file in
place would otherwise change the new attempt's copy too. Nothing is read through a symbolic link (each source is
walked from its attempt directory, component by component, its root included), nothing is written
through one (a link where a target directory should be is replaced by a real directory), and each
copy lands under its final name only once complete (temp file, fsync, rename).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from pipeline.config import StageSpec
from pipeline.files import (
    OutputRefused,
    fsync_dir,
    open_real_dir,
    open_regular,
    output_parts,
    real_directory,
    relative_output,
    remove_output,
    sha256_and_size_of,
)
from pipeline.manifest import TEMP_MARKER, atomic_write_bytes, manifest_path, read_manifest

_ATTEMPT = re.compile(r"([0-9]{1,9})-(.*)", re.ASCII | re.DOTALL)


def attempt_order(name: str) -> tuple[int, str]:
    """Sort key of an attempt directory name (``<attempt number>-<token prefix>``): by number. Any other
    name sorts first, never raises: ``'²'.isdigit()`` is true, but ``int('²')`` fails."""
    found = _ATTEMPT.fullmatch(name)
    return (int(found[1]), found[2]) if found else (-1, name)


class CopyMismatch(Exception):
    """The source no longer holds what the manifest recorded."""


def adopt_verified_outputs(stage: StageSpec, earlier_output_dirs: Sequence[Path], output_dir: Path) -> Path | None:
    """Copy the stage's outputs from the newest earlier attempt whose manifest vouches for them.

    Returns the output directory copied from, or None (nothing verified anywhere: the stage runs).
    An earlier output directory that is itself a link is passed over: what it points to is not the job's.
    """
    for source in earlier_output_dirs:
        if not _is_real_dir(source):
            continue
        manifest, _problem = read_manifest(manifest_path(source, stage.name), stage.name, stage.fingerprint,
                                           stage.outputs)
        if manifest is None:
            continue
        copied = []
        try:
            for rel in stage.outputs:
                entry = manifest["outputs"][rel]
                if not isinstance(entry, dict):
                    raise CopyMismatch(rel)
                copy_file(source, rel, output_dir, expect=(entry.get("size"), entry.get("sha256")))
                copied.append(rel)
        except (CopyMismatch, OSError):
            for rel in copied:
                remove_output(output_dir, rel)
            continue
        target = manifest_path(output_dir, stage.name)
        real_directory(output_dir.parent, relative_output(output_dir.parent, target.parent))
        atomic_write_bytes(target, json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n")
        return source
    return None


def adopt_checkpoints(earlier_work_dirs: Sequence[Path], work_dir: Path, relative_dir: str) -> Path | None:
    """Copy the newest earlier attempt's non-empty ``relative_dir`` (``checkpoints/<stage>``) into this
    attempt's, when that holds no file yet; returns the earlier attempt directory copied from.

    Both sides are walked from their attempt directory without following a link: an earlier
    ``checkpoints`` or ``checkpoints/<stage>`` that is a link is passed over, and one here is removed
    itself and replaced by a real directory, so nothing outside the job is read, written or deleted.
    """
    checkpoint_dir = real_directory(work_dir, relative_dir)
    if _has_files(checkpoint_dir):
        return None
    for source in earlier_work_dirs:
        temp = checkpoint_dir.with_name(f".{checkpoint_dir.name}{TEMP_MARKER}{os.getpid()}")
        remove_tree(temp)
        try:
            copied = copy_tree(source, relative_dir, temp)
        except (CopyMismatch, OSError):
            copied = 0
        if not copied:
            remove_tree(temp)
            continue
        remove_tree(checkpoint_dir)
        os.rename(temp, checkpoint_dir)
        fsync_dir(checkpoint_dir.parent)
        return source
    return None


def adopt_downloads(earlier_download_dirs: Sequence[Path], downloads_dir: Path, names: Sequence[str], *,
                    move: bool = False) -> list[str]:
    """Take each named download missing here from the newest earlier attempt that has it: moved with
    ``move`` (see the module docstring), else copied; the names taken."""
    copied = []
    for name in names:
        if (downloads_dir / name).exists():
            continue
        for source in earlier_download_dirs:
            try:
                if move:
                    move_file(source, name, downloads_dir)
                else:
                    copy_file(source, name, downloads_dir)
            except (CopyMismatch, OSError):
                continue
            copied.append(name)
            break
    return copied


def move_file(source_root: Path, name: str, target_dir: Path) -> None:
    """Rename the regular file ``source_root/name`` (a real directory, no link anywhere: checked as
    ``copy_file`` does) to ``target_dir/name``; ``CopyMismatch`` when it is not such a file."""
    try:
        fd = open_regular(source_root, name)
    except OutputRefused as exc:
        raise CopyMismatch(f"{name}: {exc}") from None
    os.close(fd)
    os.rename(source_root / name, target_dir / name)
    fsync_dir(target_dir)


def copy_file(source_root: Path, rel: str, target_root: Path, *, expect: tuple | None = None) -> None:
    """Copy ``source_root/rel`` to ``target_root/rel``; with ``expect`` (size, sha256) it must match.

    The source must be a regular file reached through real directories only, ``source_root``
    included (``pipeline.files.open_regular``); the target's directories are made real ones (a link
    there is replaced, never followed).
    """
    parts = output_parts(rel)
    target_dir = real_directory(target_root.parent, "/".join([target_root.name, *parts[:-1]]))
    _copy_to(source_root, rel, target_dir / parts[-1], expect)


def copy_tree(source_root: Path, relative_dir: str, target: Path) -> int:
    """Copy the regular files and directories under ``source_root/relative_dir`` into ``target``;
    links and other kinds are left out. Returns the number of files copied."""
    try:
        fd = open_real_dir(source_root, relative_dir)
    except OutputRefused as exc:
        raise CopyMismatch(f"{relative_dir}: {exc}") from None
    try:
        with os.scandir(fd) as entries:
            found = [(entry.name, entry.is_dir(follow_symlinks=False), entry.is_file(follow_symlinks=False))
                     for entry in entries]
    finally:
        os.close(fd)
    target.mkdir(exist_ok=True)
    copied = 0
    for name, is_dir, is_file in found:
        if is_dir:
            copied += copy_tree(source_root, f"{relative_dir}/{name}", target / name)
        elif is_file and TEMP_MARKER not in name:
            _copy_to(source_root, f"{relative_dir}/{name}", target / name, None)
            copied += 1
    return copied


def _copy_to(source_root: Path, rel: str, target: Path, expect: tuple | None) -> None:
    temp = target.with_name(f".{target.name}{TEMP_MARKER}{os.getpid()}")
    try:
        fd = open_regular(source_root, rel)
    except OutputRefused as exc:
        raise CopyMismatch(f"{rel}: {exc}") from None
    try:
        with os.fdopen(fd, "rb") as src, open(temp, "wb") as dst:
            sha256_hex, size = sha256_and_size_of(src, copy_to=dst)
        if expect is not None and (size, sha256_hex) != tuple(expect):
            raise CopyMismatch(f"{rel} changed since its manifest was written")
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _has_files(directory: Path) -> bool:
    if not _is_real_dir(directory):
        return False
    for _root, _dirs, files in os.walk(directory):
        if files:
            return True
    return False


def remove_tree(path: Path) -> None:
    """Remove ``path`` if it is there: a link or a file is unlinked, a real directory removed with
    rmtree (which follows no link)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
