"""Stage manifests and durable file writes.

A stage's outputs count only when its manifest verifies: the manifest is written after the stage
succeeded, atomically (temp file, fsync, rename, fsync of the directory), and lists every declared
output's size and sha256. Anything a crashed attempt left behind therefore has no manifest, or one
that no longer matches, and is redone. The same atomic write serves the dataset builder and the
reference trainer's checkpoints.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, NamedTuple

from pipeline.config import MANIFEST_DIR_NAME
from pipeline.files import (
    FileIdentity,
    OutputRefused,
    fsync_dir,
    open_output,
    open_real_dir,
    open_regular,
    output_digest,
    real_directory,
    sha256_and_size_of,
)
from worker.core.names import is_sha256_hex

MANIFEST_VERSION = 1
TEMP_MARKER = ".tmp-"
# A recorded identity lets a reader skip hashing a file, and a manifest lies in the output directory,
# which the stages write: so only a manifest this process wrote may vouch with one. Its outputs are
# sealed with a key that lives only in this process's memory (never in a file or a stage's
# environment; ``run`` makes the worker undumpable); any other manifest's digests are checked by hashing.
_SEAL_KEY = secrets.token_bytes(32)


@contextmanager
def replaced_atomically(path: Path, *, sync_dir: bool = True) -> Iterator[Path]:
    """Yield a temp path beside ``path`` to write; on success it is synced and renamed onto ``path``,
    on any failure removed, so ``path`` holds either its old content or all of the new.

    ``sync_dir=False`` leaves the rename's durability to a caller that syncs the directory once after
    many files (``fsync_dir``), before anything that vouches for them is written."""
    temp = path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}")
    try:
        yield temp
        with open(temp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either its old content or all of ``data``, never a part."""
    with replaced_atomically(Path(path)) as temp:
        try:
            temp.write_bytes(data)
        except OSError as exc:
            if exc.filename is not None:
                raise
            # A failed write (a full disk) names no file; the job's error should say which one.
            raise OSError(exc.errno, exc.strerror, Path(path).name) from exc


def remove_stale_temps(directory: Path) -> None:
    """Delete temp files an interrupted ``atomic_write_bytes`` left in ``directory``."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.startswith(".") and TEMP_MARKER in entry.name and entry.is_file():
            entry.unlink(missing_ok=True)


class Recorded(NamedTuple):
    """What a stage manifest records of one output: its digest and size, and the file's identity when
    it was hashed (``pipeline.files.FileIdentity``). A reader whose open file still has that identity
    has the hashed bytes without reading them again; without one (an older manifest, a racy file, a
    copy), whoever relies on the digest hashes what it reads."""

    sha256: str
    size: int
    identity: FileIdentity | None = None


def describe_outputs(output_dir: Path, outputs: Iterable[str]) -> dict[str, dict]:
    """Relative path -> {size, sha256[, identity]} for each output, as recorded in a manifest."""
    described = {}
    for rel in outputs:
        # Read the way the uploader reads it: a symlink anywhere on the path is refused, not hashed.
        sha256_hex, size, identity = output_digest(output_dir, rel)
        described[rel] = {"size": size, "sha256": sha256_hex}
        if identity is not None:
            described[rel]["identity"] = identity.as_record()
    return described


def manifest_path(output_dir: Path, stage_name: str) -> Path:
    return output_dir / MANIFEST_DIR_NAME / f"{stage_name}.json"


def write_manifest(
    path: Path, output_dir: Path, stage_name: str, fingerprint: str, outputs: Sequence[str]
) -> dict:
    """Record the stage's outputs as they are now; returns the manifest written.

    It may run while the next stage runs (``pipeline.stages.ManifestWriter``), and that stage can
    replace ``.manifests`` or plant links in it: the directory is reached without a link and the file
    written into it by descriptor, under a fresh temp name that no link can stand in for.
    """
    if path.parent != output_dir / MANIFEST_DIR_NAME:
        raise ValueError(f"a manifest belongs in {output_dir / MANIFEST_DIR_NAME}, not {path.parent}")
    described = describe_outputs(output_dir, outputs)
    manifest = {
        "version": MANIFEST_VERSION,
        "stage": stage_name,
        "fingerprint": fingerprint,
        "outputs": described,
        "seal": _seal(described),
    }
    real_directory(output_dir, MANIFEST_DIR_NAME)  # a link there is removed, never followed
    try:
        dir_fd = open_real_dir(output_dir, MANIFEST_DIR_NAME)
    except OutputRefused as exc:  # replaced by a link since: the write fails, the manifest is not written
        raise OSError(errno.ELOOP, f"{MANIFEST_DIR_NAME}: {exc}", str(path.parent)) from None
    try:
        atomic_write_at(dir_fd, path.name, json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n")
    finally:
        os.close(dir_fd)
    return manifest


def atomic_write_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``data`` as ``name`` in the directory open as ``dir_fd``: the old content or all of the new."""
    with replaced_at(dir_fd, name) as handle:
        handle.write(data)


@contextmanager
def replaced_at(dir_fd: int, name: str) -> Iterator[BinaryIO]:
    """A new file to write that takes the name ``name`` in the directory open as ``dir_fd`` once the
    block ends (synced, renamed, the directory synced), or is removed if the block raises.

    The temp file is created anew with O_EXCL|O_NOFOLLOW under a random name, so nothing planted in the
    directory (a link to a file elsewhere) is written through; the rename goes by descriptor too."""
    temp = f".{name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.fsync(dir_fd)


def manifest_problem(
    path: Path, output_dir: Path, stage_name: str, fingerprint: str, outputs: Sequence[str]
) -> str | None:
    """Why the manifest does not vouch for the outputs on disk, or None when it does."""
    manifest, problem = read_manifest(path, stage_name, fingerprint, outputs)
    if manifest is None:
        return problem
    recorded = manifest["outputs"]
    for rel in outputs:
        entry = recorded[rel]
        if not isinstance(entry, dict):
            return f"output {rel} is missing"
        try:
            fd = open_output(output_dir, rel)
        except OutputRefused as exc:
            return f"output {rel} is {exc}"
        with os.fdopen(fd, "rb") as handle:
            sha256_hex, size = sha256_and_size_of(handle)
        if entry.get("size") != size:
            return f"output {rel} changed size"
        if entry.get("sha256") != sha256_hex:
            return f"output {rel} changed content"
    return None


def read_manifest(
    path: Path, stage_name: str, fingerprint: str, outputs: Sequence[str]
) -> tuple[dict, None] | tuple[None, str]:
    """(the manifest, None) when it is one for this stage definition, else (None, why not).

    Only the manifest itself is checked here, not the files it lists (``manifest_problem`` does both).
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, "no manifest"
    except OSError as exc:
        return None, f"manifest unreadable ({type(exc).__name__})"
    return manifest_from_bytes(raw, stage_name, fingerprint, outputs)


def manifest_from_bytes(
    raw: bytes, stage_name: str, fingerprint: str, outputs: Sequence[str]
) -> tuple[dict, None] | tuple[None, str]:
    """``read_manifest`` for a manifest's bytes (one mirrored in S3, say)."""
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        return None, f"manifest unreadable ({type(exc).__name__})"
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        return None, "manifest has an unknown format"
    if manifest.get("stage") != stage_name or manifest.get("fingerprint") != fingerprint:
        return None, "manifest was written for a different stage definition"
    recorded = manifest.get("outputs")
    if not isinstance(recorded, dict) or set(recorded) != set(outputs):
        return None, "manifest lists different outputs"
    return manifest, None


def recorded_outputs(output_dir: Path) -> dict[str, Recorded]:
    """Relative path -> ``Recorded`` of every output a stage manifest in ``output_dir`` records.

    What the manifests say, not what the files hold now: whoever relies on a digest checks the file
    it reads against it, by its identity or by hashing it (the uploader and the publisher do). Read
    by the no-link rule; a manifest that does not parse is skipped, and so is an output whose entry is
    malformed or that two manifests disagree about.
    """
    try:
        names = sorted(os.listdir(Path(output_dir) / MANIFEST_DIR_NAME))
    except OSError:
        return {}
    recorded: dict[str, Recorded] = {}
    disputed: set[str] = set()
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with os.fdopen(open_regular(output_dir, f"{MANIFEST_DIR_NAME}/{name}"), "rb") as handle:
                manifest = json.loads(handle.read())
        except (OutputRefused, OSError, ValueError):
            continue
        if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
            continue
        outputs = manifest.get("outputs")
        sealed = isinstance(outputs, dict) and hmac.compare_digest(str(manifest.get("seal", "")), _seal(outputs))
        for rel, entry in (outputs.items() if isinstance(outputs, dict) else ()):
            described = _described(entry, sealed)
            if described is None or recorded.get(rel, described) != described:
                disputed.add(rel)
            if described is not None:
                recorded[rel] = described
    return {rel: entry for rel, entry in recorded.items() if rel not in disputed}


def _seal(outputs: dict) -> str:
    return hmac.new(_SEAL_KEY, json.dumps(outputs, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def _described(entry: object, sealed: bool) -> Recorded | None:
    if not isinstance(entry, dict):
        return None
    sha256_hex, size = entry.get("sha256"), entry.get("size")
    if not is_sha256_hex(sha256_hex):
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return None
    identity = FileIdentity.from_record(entry.get("identity")) if sealed else None
    return Recorded(sha256_hex, size, identity if identity is not None and identity.size == size else None)
