"""An attempt's resumable work mirrored in S3, so a retry on another host starts where the last left off.

After a spot reclaim the retry normally runs on another instance, whose work root is empty: without a
shared file system every checkpoint and every finished stage would be lost. With
``CHECKPOINT_S3_SYNC_SECONDS`` set, each attempt mirrors, under its own key prefix:

- a resumable stage's ``{checkpoint_dir}``, every interval while the stage runs and once more when it
  ends (a stop included: the checkpoint a trainer writes on its checkpoint signal gets there);
- a finished stage's verified outputs and its manifest, after the manifest is written (but the last
  stage's: the commit uploads those a moment later).

and before a stage runs, an attempt that finds nothing locally takes the newest other attempt's
verified outputs (the stage is then skipped) or, for a resumable stage, its checkpoints when they are
newer than any local attempt's. Everything restored is checked against the SHA-256 recorded beside
it as it is downloaded, and written through real directories only (no link followed).

Keys: ``<S3_PREFIX>/.work/<environment>/<directoryName>/<jobId>/attempts/<attempt>/...``, built
from the validated names of the job's work directory (a name starting with a dot is never an
environment, so these keys cannot meet a profile's artifacts). An attempt writes only below its own
attempt's prefix: one that lost its lease can add to its own mirror, never change another attempt's
or the committed artifacts. Checkpoint files are stored under their SHA-256 (``checkpoints/<stage>/
<sha256>``) with a listing (``checkpoints/<stage>.json``) written after them, so a file rewritten
during an upload can never tear the set a retry restores: the listing names only complete blobs.
The mirror of a committed job is deleted with its work files; an abandoned one is left to the
bucket's lifecycle rule on ``.work/``.

Mirroring is a head start, never a condition: an S3 error is a warning and the job goes on; a
restore that fails is a stage that runs. Where the work root is a shared file system (NFS, EFS)
another host sees the attempts directly, and nothing is mirrored (``shared_file_system``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from pipeline.config import StageSpec
from pipeline.files import OutputRefused, fsync_dir, open_regular, output_parts, real_directory
from pipeline.manifest import TEMP_MARKER, atomic_write_bytes, manifest_from_bytes, manifest_path
from pipeline.reuse import attempt_order

log = structlog.get_logger(__name__)

WORK_KEY_DIR = ".work"
LISTING_VERSION = 1
SHARED_FILE_SYSTEMS = frozenset({"nfs", "nfs4", "efs", "lustre", "cifs", "smb3", "glusterfs", "ceph", "9p"})
_CHUNK = 1024 * 1024
_S3_ERRORS = (BotoCoreError, ClientError, OSError)


@dataclass(frozen=True)
class RemoteWorkConfig:
    """Where attempts mirror their work (the artifacts' bucket and prefix) and how often."""

    bucket: str
    prefix: str
    sync_interval_s: float


class RestoreMismatch(Exception):
    """What was downloaded is not what its listing or manifest recorded."""


def shared_file_system(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the shared file system ``path`` lies on (``nfs4``, ...), or None when it is local.

    Read from the mount table: the longest mount point that contains the path decides."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, fstype = "", None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount_point = fields[4].replace("\\040", " ")
        kind = line.split(" - ", 1)[1].split()[0]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, kind
    return fstype if fstype in SHARED_FILE_SYSTEMS else None


def job_key(job_dir: Path) -> str:
    """``<environment>/<directoryName>/<jobId>``: the job directory's path below the work root."""
    return "/".join(job_dir.parts[-3:])


class RemoteWork:
    """One attempt's mirror in S3, and what it can restore from the job's other attempts."""

    def __init__(self, s3: Any, config: RemoteWorkConfig, job_key: str, attempt: str):
        self._s3, self._bucket = s3, config.bucket
        self.sync_interval_s = config.sync_interval_s
        self._root = "/".join(part for part in (config.prefix.strip("/"), WORK_KEY_DIR, job_key) if part)
        self._attempt = attempt
        self._mine = f"{self._root}/attempts/{attempt}"
        self._lock = threading.Lock()  # the sync thread and the stage loop push to the same mirror
        # rel -> (identity, sha256) per stage: an unchanged checkpoint is not hashed or sent again.
        self._known: dict[str, dict[str, tuple[tuple, str]]] = {}
        self._sent: dict[str, set[str]] = {}

    # ------------------------------------------------------------------ checkpoints
    def push_checkpoints(self, stage: str, directory: Path) -> int:
        """Mirror the checkpoint directory as it is now; returns the files sent. Never raises."""
        with self._lock:
            try:
                return self._push_checkpoints(stage, directory)
            except _S3_ERRORS as exc:
                log.warning("remote_work.push_failed", stage=stage, what="checkpoints", error=_short(exc))
                return 0

    def _push_checkpoints(self, stage: str, directory: Path) -> int:
        known = self._known.setdefault(stage, {})
        sent = self._sent.setdefault(stage, set())
        blob_prefix = f"{self._mine}/checkpoints/{stage}/"
        files: dict[str, dict] = {}
        uploaded = 0
        for rel in _regular_files(directory):
            try:
                fd = open_regular(directory, rel)
            except OutputRefused:
                continue
            with os.fdopen(fd, "rb") as handle:
                before = _identity(os.fstat(handle.fileno()))
                cached = known.get(rel)
                if cached is not None and cached[0] == before:
                    digest = cached[1]
                else:
                    digest, _size = _sha256(handle)
                    if _identity(os.fstat(handle.fileno())) != before:
                        continue  # being written: the next round takes it
                    known[rel] = (before, digest)
                if digest not in sent:
                    # A descriptor of its own: s3transfer closes the file object it was given, and
                    # the identity is read again from this one after the upload.
                    with os.fdopen(os.dup(handle.fileno()), "rb") as upload:
                        upload.seek(0)
                        self._s3.upload_fileobj(upload, self._bucket, blob_prefix + digest)
                    if _identity(os.fstat(handle.fileno())) != before:
                        # Rewritten while sent: the blob's name may not match its bytes, so it goes.
                        self._s3.delete_object(Bucket=self._bucket, Key=blob_prefix + digest)
                        continue
                    sent.add(digest)
                    uploaded += 1
            files[rel] = {"sha256": digest, "size": before[1]}
        listing = {"version": LISTING_VERSION, "stage": stage, "attempt": self._attempt, "files": files}
        self._s3.put_object(Bucket=self._bucket, Key=f"{self._mine}/checkpoints/{stage}.json",
                            Body=json.dumps(listing, sort_keys=True).encode())
        # Only now that the listing names the new set: the blobs nothing names any more go.
        for digest in sorted(sent - {entry["sha256"] for entry in files.values()}):
            self._s3.delete_object(Bucket=self._bucket, Key=blob_prefix + digest)
            sent.discard(digest)
        if uploaded:
            log.info("remote_work.checkpoints_pushed", stage=stage, files=len(files), sent=uploaded)
        return uploaded

    @contextlib.contextmanager
    def syncing(self, stage: str, directory: Path) -> Iterator[None]:
        """Mirror ``directory`` every interval while the block runs, and once more when it ends."""
        done = threading.Event()

        def loop() -> None:
            while not done.wait(self.sync_interval_s):
                self.push_checkpoints(stage, directory)

        thread = threading.Thread(target=loop, name=f"checkpoint-sync-{stage}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self.push_checkpoints(stage, directory)

    def pull_checkpoints(self, stage: str, directory: Path, newer_than: str | None = None) -> str | None:
        """Fill ``directory`` (emptied first) with the newest other attempt's mirrored checkpoints, if that
        attempt is newer than ``newer_than`` (a local attempt's name); returns the attempt or None."""
        for attempt in self._other_attempts(newer_than):
            try:
                listing = self._get_json(f"{self._root}/attempts/{attempt}/checkpoints/{stage}.json")
                if listing is None or not _is_listing(listing, stage):
                    continue
                _empty(directory)
                for rel, entry in sorted(listing["files"].items()):
                    self._download(f"{self._root}/attempts/{attempt}/checkpoints/{stage}/{entry['sha256']}",
                                   directory, rel, entry["size"], entry["sha256"])
            except (RestoreMismatch, ValueError, *_S3_ERRORS) as exc:
                log.warning("remote_work.restore_failed", stage=stage, what="checkpoints", attempt=attempt,
                            error=_short(exc))
                _empty(directory)
                continue
            log.info("remote_work.checkpoints_restored", stage=stage, attempt=attempt, files=len(listing["files"]))
            return attempt
        return None

    # ------------------------------------------------------------------ verified outputs
    def push_outputs(self, stage: StageSpec, output_dir: Path) -> None:
        """Mirror a stage's outputs and then its manifest (written already). Never raises."""
        with self._lock:
            try:
                for rel in stage.outputs:
                    with os.fdopen(open_regular(output_dir, rel), "rb") as handle:
                        self._s3.upload_fileobj(handle, self._bucket, f"{self._mine}/output/{rel}")
                manifest = manifest_path(output_dir, stage.name)
                self._s3.put_object(Bucket=self._bucket, Key=f"{self._mine}/output/.manifests/{manifest.name}",
                                    Body=manifest.read_bytes())
            except (OutputRefused, *_S3_ERRORS) as exc:
                log.warning("remote_work.push_failed", stage=stage.name, what="outputs", error=_short(exc))
                return
        log.info("remote_work.outputs_pushed", stage=stage.name, files=len(stage.outputs))

    def pull_outputs(self, stage: StageSpec, output_dir: Path) -> str | None:
        """The stage's verified outputs from the newest other attempt that mirrored them, its manifest
        written last; returns the attempt or None (the stage then runs)."""
        for attempt in self._other_attempts(None):
            base = f"{self._root}/attempts/{attempt}/output"
            try:
                raw = self._get_bytes(f"{base}/.manifests/{stage.name}.json")
                if raw is None:
                    continue
                manifest = _parse_manifest(raw, stage)
                for rel in stage.outputs:
                    entry = manifest["outputs"][rel]
                    self._download(f"{base}/{rel}", output_dir, rel, entry["size"], entry["sha256"])
                path = manifest_path(output_dir, stage.name)
                real_directory(output_dir, path.parent.name)
                atomic_write_bytes(path, raw)
            except (RestoreMismatch, ValueError, KeyError, TypeError, *_S3_ERRORS) as exc:
                log.warning("remote_work.restore_failed", stage=stage.name, what="outputs", attempt=attempt,
                            error=_short(exc))
                continue
            log.info("remote_work.outputs_restored", stage=stage.name, attempt=attempt)
            return attempt
        return None

    # ------------------------------------------------------------------ the job's whole mirror
    def forget(self) -> int:
        """Delete every attempt's mirror of the job (after its commit); returns the objects deleted."""
        deleted = 0
        try:
            paginator = self._s3.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self._bucket, Prefix=f"{self._root}/"):
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if keys:
                    self._s3.delete_objects(Bucket=self._bucket, Delete={"Objects": keys, "Quiet": True})
                    deleted += len(keys)
        except _S3_ERRORS as exc:
            log.warning("remote_work.forget_failed", error=_short(exc))
        return deleted

    # ------------------------------------------------------------------ helpers
    def _other_attempts(self, newer_than: str | None) -> list[str]:
        """The job's other mirrored attempts, newest first, only those newer than ``newer_than``."""
        try:
            paginator = self._s3.get_paginator("list_objects_v2")
            names = [prefix["Prefix"][len(f"{self._root}/attempts/"):].rstrip("/")
                     for page in paginator.paginate(Bucket=self._bucket, Prefix=f"{self._root}/attempts/",
                                                    Delimiter="/")
                     for prefix in page.get("CommonPrefixes", [])]
        except _S3_ERRORS as exc:
            log.warning("remote_work.list_failed", error=_short(exc))
            return []
        floor = attempt_order(newer_than) if newer_than else None
        others = [name for name in names if name != self._attempt and "/" not in name
                  and (floor is None or attempt_order(name) > floor)]
        return sorted(others, key=attempt_order, reverse=True)

    def _get_bytes(self, key: str) -> bytes | None:
        try:
            return self._s3.get_object(Bucket=self._bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def _get_json(self, key: str) -> Any:
        raw = self._get_bytes(key)
        return None if raw is None else json.loads(raw)

    def _download(self, key: str, root: Path, rel: str, size: int, sha256_hex: str) -> None:
        """``root/rel`` from ``key``, checked against ``size`` and ``sha256_hex`` before it takes its name."""
        parts = output_parts(rel)
        target_dir = real_directory(root.parent, "/".join([root.name, *parts[:-1]]))
        target = target_dir / parts[-1]
        temp = target.with_name(f".{target.name}{TEMP_MARKER}{os.getpid()}")
        try:
            digest = hashlib.sha256()
            with open(temp, "wb") as out:
                writer = _Hashing(out, digest)
                self._s3.download_fileobj(self._bucket, key, writer)
                out.flush()
                os.fsync(out.fileno())
            if (writer.size, digest.hexdigest()) != (size, sha256_hex):
                raise RestoreMismatch(f"{rel}: what was downloaded is not what was recorded")
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        fsync_dir(target_dir)


class _Hashing:
    """A file object that hashes what is written to it in order (downloads run with use_threads=False)."""

    def __init__(self, out, digest):
        self._out, self._digest, self.size = out, digest, 0

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        self.size += len(data)
        return self._out.write(data)


def _parse_manifest(raw: bytes, stage: StageSpec) -> dict:
    """The mirrored manifest when it is one for this very stage definition; ValueError otherwise."""
    manifest, problem = manifest_from_bytes(raw, stage.name, stage.fingerprint, stage.outputs)
    if manifest is None:
        raise ValueError(problem)
    return manifest


def _is_listing(listing: Any, stage: str) -> bool:
    if not isinstance(listing, dict) or listing.get("version") != LISTING_VERSION or listing.get("stage") != stage:
        return False
    files = listing.get("files")
    return isinstance(files, dict) and all(
        isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64
        and all(c in "0123456789abcdef" for c in entry["sha256"])
        and isinstance(entry.get("size"), int) for entry in files.values())


def _regular_files(directory: Path) -> list[str]:
    """Paths of the regular files below ``directory``, relative to it; links and temp files left out."""
    found = []
    for current, dirs, files in os.walk(directory, followlinks=False):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(current, d))]
        for name in files:
            path = os.path.join(current, name)
            if TEMP_MARKER in name or not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            found.append(os.path.relpath(path, directory))
    return sorted(found)


def _identity(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _sha256(handle) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _empty(directory: Path) -> None:
    real_directory(directory.parent, directory.name, empty=True)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]

