"""An attempt's resumable work mirrored in S3, so a retry on another host starts where the last left off.

After a spot reclaim the retry normally runs on another instance, whose work root is empty: without a
shared file system every checkpoint and every finished stage would be lost. With
``CHECKPOINT_S3_SYNC_SECONDS`` set, each attempt mirrors, under its own key prefix:

- a resumable stage's ``{checkpoint_dir}``, every interval while the stage runs and once more when it
  ends (a stop included: the checkpoint a trainer writes on its checkpoint signal gets there);
- a finished stage's verified outputs and its manifest, after the manifest is written (but the last
  stage's: the commit uploads those a moment later).

and before a stage runs, an attempt that finds nothing locally takes the newest other attempt's
verified outputs (the stage is then skipped; never the last stage's, which no attempt mirrors) or,
for a resumable stage, the checkpoints of the other attempt, newer than any local attempt's, that had
got furthest: each listing records the stage's last reported progress when its set was read, and the
highest wins (a tie, or listings without one, the newest attempt). An attempt that started over (its
restore failed) therefore never hides an older attempt's further checkpoints.

**The trust model.** Every worker role can write anywhere under ``.work/``, so nothing found there
vouches for itself. After an attempt writes a checkpoint listing or an output manifest, it records
the SHA-256 of those very bytes on its own history entry in the job record, fenced on its claim
token (the ``Ledger``: ``Store.record_mirror``). A restore starts from the record, not from a
listing of the bucket: it considers only the attempts the record names (attempt number and claim
token give the attempt's key prefix), fetches only the listings and manifests the record vouches
for, refuses one whose bytes do not hash to the recorded digest, and checks every file against the
size and SHA-256 that vouched listing or manifest names, stopping a download at its declared size.
So a planted attempt, listing, manifest or blob restores nothing: at worst it costs the retry the
head start. Everything is written through real directories only (no link followed).

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
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from pipeline.config import MANIFEST_DIR_NAME, StageSpec
from pipeline.files import (
    OutputRefused,
    open_real_dir,
    open_regular,
    output_parts,
    real_directory,
    sha256_and_size_of,
)
from pipeline.manifest import TEMP_MARKER, atomic_write_at, manifest_from_bytes, manifest_path, replaced_at
from pipeline.reuse import attempt_order, remove_tree
from worker.core.names import is_sha256_hex
from worker.core.stop import StopSignal

log = structlog.get_logger(__name__)

WORK_KEY_DIR = ".work"
LISTING_VERSION = 1
SHARED_FILE_SYSTEMS = frozenset({"nfs", "nfs4", "efs", "lustre", "cifs", "smb3", "glusterfs", "ceph", "9p"})
_CHUNK = 1024 * 1024
# Once a shutdown is announced: how often the checkpoint directory is mirrored, so the checkpoint
# written on the checkpoint signal gets out within the grace.
NOTICE_SYNC_INTERVAL_S = 5.0
# The push after a stage stopped or failed: what it has not sent by then, the next attempt redoes,
# rather than the message being released after the orchestrator's kill.
FINAL_PUSH_BUDGET_S = 10.0
_WAKE_S = 1.0
# Bounds on one restore, far above any real set, so that even a listing the record vouches for (a
# trainer gone wrong) cannot fill the disk or turn a restore into thousands of requests.
MAX_LISTING_FILES = 1000
MAX_RESTORE_BYTES = 256 * 1024**3
MAX_DOCUMENT_BYTES = 1024 * 1024  # a listing or a manifest
# A name read back from the record or a listing: ASCII only, full match (``'²'.isdigit()`` is true).
ATTEMPT_NAME = re.compile(r"[0-9]{1,9}-[A-Za-z0-9]{1,64}", re.ASCII)
_PATH_PART = re.compile(r"[A-Za-z0-9_+=@-][A-Za-z0-9._+=@-]{0,254}", re.ASCII)
_MAX_DEPTH = 16
CHECKPOINTS_ITEM, OUTPUT_ITEM = "checkpoints", "output"


def ledger_item(kind: str, stage: str) -> str:
    """The name a mirrored listing (``checkpoints/<stage>``) or manifest (``output/<stage>``) is vouched under."""
    return f"{kind}/{stage}"


class Ledger(Protocol):
    """What the job record says about the job's mirrors: the one source a restore believes.

    ``vouched()``: attempt name (``pipeline.workdir.attempt_dir_name``) -> {item: SHA-256 of the listing or
    manifest bytes that attempt mirrored}, for the job's other attempts, as the record held them when
    this attempt claimed the job. ``vouch(item, sha256_hex)``: record this attempt's own, fenced on
    its claim (raises when it cannot: the mirror is then not vouched for, and nothing restores it).
    """

    def vouched(self) -> Mapping[str, Mapping[str, str]]: ...

    def vouch(self, item: str, sha256_hex: str) -> None: ...


@dataclass
class MemoryLedger:
    """A ledger kept in memory, shared by the attempts of one job: for tests and benchmarks, as the
    job record is in production (``worker.voice.mirror_ledger``)."""

    attempt: str
    records: dict[str, dict[str, str]] = field(default_factory=dict)

    def for_attempt(self, attempt: str) -> MemoryLedger:
        return MemoryLedger(attempt, self.records)

    def vouched(self) -> Mapping[str, Mapping[str, str]]:
        return {name: dict(items) for name, items in self.records.items() if name != self.attempt}

    def vouch(self, item: str, sha256_hex: str) -> None:
        self.records.setdefault(self.attempt, {})[item] = sha256_hex


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

    def __init__(self, s3: Any, config: RemoteWorkConfig, job_key: str, attempt: str, ledger: Ledger):
        self._s3, self._bucket = s3, config.bucket
        self.sync_interval_s = config.sync_interval_s
        self._root = "/".join(part for part in (config.prefix.strip("/"), WORK_KEY_DIR, job_key) if part)
        self._attempt = attempt
        self._ledger = ledger
        self._mine = f"{self._root}/attempts/{attempt}"
        self._lock = threading.Lock()  # the sync thread and the stage loop push to the same mirror
        # rel -> (identity, sha256) per stage: an unchanged checkpoint is not hashed or sent again.
        self._known: dict[str, dict[str, tuple[tuple, str]]] = {}
        self._sent: dict[str, set[str]] = {}
        # Per stage: the digests of the listings this attempt put in S3, and of the one the record vouches for.
        self._listings: dict[str, set[str]] = {}
        self._vouched: dict[str, str] = {}

    # ------------------------------------------------------------------ checkpoints
    def push_checkpoints(self, stage: str, directory: Path, progress: float | None = None) -> int:
        """Mirror the checkpoint directory as it is now; returns the files sent. ``progress``: the
        stage's progress (percent) as last reported before the files are read, recorded in the listing.
        Never raises: a mirror that fails is a head start lost, never a failure of the job."""
        with self._lock:
            try:
                return self._push_checkpoints(stage, directory, progress)
            except Exception as exc:  # noqa: BLE001 - best effort by design (s3transfer raises its own types)
                log.warning("remote_work.push_failed", stage=stage, what="checkpoints", error=_short(exc))
                return 0

    def _push_checkpoints(self, stage: str, directory: Path, progress: float | None) -> int:
        known = self._known.setdefault(stage, {})
        sent = self._sent.setdefault(stage, set())
        blob_prefix = f"{self._mine}/checkpoints/{stage}/"
        files: dict[str, dict] = {}
        uploaded, complete = 0, True
        for rel, handle in _checkpoint_files(directory):
            if _path_problem(rel) is not None:
                handle.close()
                log.warning("remote_work.file_not_mirrored", stage=stage, file=rel[:200],
                            why="not a plain ASCII path a restore would accept")
                continue
            with handle:
                before = _identity(os.fstat(handle.fileno()))
                cached = known.get(rel)
                if cached is not None and cached[0] == before:
                    digest = cached[1]
                else:
                    digest, _size = sha256_and_size_of(handle)
                    if _identity(os.fstat(handle.fileno())) != before:
                        complete = False  # being written: the next round takes it
                        continue
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
                        complete = False
                        continue
                    sent.add(digest)
                    uploaded += 1
            files[rel] = {"sha256": digest, "size": before[1]}
        if not complete or not files:
            # A set with a file left out would be a torn checkpoint, and an empty one would replace a
            # host's own checkpoints with nothing: the mirror keeps naming the last whole set (its
            # blobs stay), and the next round tries again.
            return uploaded
        listing = {"version": LISTING_VERSION, "stage": stage, "attempt": self._attempt, "files": files}
        if progress is not None and math.isfinite(progress):
            listing["progress"] = min(100.0, max(0.0, float(progress)))
        body = json.dumps(listing, sort_keys=True).encode()
        listing_digest = hashlib.sha256(body).hexdigest()
        listings = self._listings.setdefault(stage, set())
        if listing_digest not in listings:
            # Under its own digest, beside the one the record vouches for until the new one is: a
            # vouch that fails (a store away, this attempt fenced out) never costs the set before.
            self._s3.put_object(Bucket=self._bucket, Key=self._listing_key(self._attempt, stage, listing_digest),
                                Body=body)
            listings.add(listing_digest)
        if self._vouched.get(stage) != listing_digest:
            # An exception here leaves the blobs and listing the record still vouches for, and the
            # next round tries again.
            self._ledger.vouch(ledger_item(CHECKPOINTS_ITEM, stage), listing_digest)
            self._vouched[stage] = listing_digest
            for stale in sorted(listings - {listing_digest}):
                self._s3.delete_object(Bucket=self._bucket, Key=self._listing_key(self._attempt, stage, stale))
                listings.discard(stale)
        # Only now that the record vouches for the new set: the blobs nothing names any more go.
        for digest in sorted(sent - {entry["sha256"] for entry in files.values()}):
            self._s3.delete_object(Bucket=self._bucket, Key=blob_prefix + digest)
            sent.discard(digest)
        if uploaded:
            log.info("remote_work.checkpoints_pushed", stage=stage, files=len(files), sent=uploaded)
        return uploaded

    @contextlib.contextmanager
    def syncing(self, stage: str, directory: Path, stop: StopSignal | None = None,
                progress_of: Callable[[], float | None] = lambda: None) -> Iterator[None]:
        """Mirror ``directory`` every interval while the block runs; once the shutdown is announced
        (``stop.forewarned()``), every ``NOTICE_SYNC_INTERVAL_S``, so the checkpoint the stage writes on
        its checkpoint signal is mirrored within the grace. A block that ends in an exception (a stop,
        a failure) gets one more push, bounded by ``FINAL_PUSH_BUDGET_S`` so a shutdown still releases
        its message in time; a stage that succeeded needs none (its outputs are mirrored instead).
        ``progress_of`` gives the stage's last reported progress, recorded with each set."""
        done = threading.Event()

        def push() -> None:
            self.push_checkpoints(stage, directory, progress_of())

        def loop() -> None:
            # Woken every slice, so a shutdown announced during a long interval is seen at once.
            last_s = time.monotonic()
            while not done.wait(min(self._interval_s(stop), _WAKE_S)):
                if time.monotonic() - last_s >= self._interval_s(stop):
                    push()
                    last_s = time.monotonic()

        thread = threading.Thread(target=loop, name=f"checkpoint-sync-{stage}", daemon=True)
        thread.start()
        try:
            yield
        except BaseException:
            done.set()
            thread.join()
            last = threading.Thread(target=push, name=f"checkpoint-final-{stage}", daemon=True)
            last.start()
            last.join(FINAL_PUSH_BUDGET_S)
            if last.is_alive():  # it goes on in the background; what it has not sent, the next attempt redoes
                log.warning("remote_work.final_push_cut", stage=stage, budget_s=FINAL_PUSH_BUDGET_S)
            raise
        finally:
            done.set()
            thread.join()

    def _interval_s(self, stop: StopSignal | None) -> float:
        if stop is not None and stop.forewarned():
            return min(self.sync_interval_s, NOTICE_SYNC_INTERVAL_S)
        return self.sync_interval_s

    def pull_checkpoints(self, stage: str, directory: Path, newer_than: str | None = None) -> str | None:
        """Replace ``directory`` with the mirrored checkpoints of the other attempt that got furthest,
        among those newer than ``newer_than`` (a local attempt's name) that the job record vouches
        for; returns the attempt or None. Downloaded and verified beside it first: a restore that
        fails leaves the directory as it was, and the next candidate is tried. Never raises."""
        try:
            return self._pull_checkpoints(stage, directory, newer_than)
        except Exception as exc:  # noqa: BLE001 - a restore that fails is a stage that starts without it
            log.warning("remote_work.restore_failed", stage=stage, what="checkpoints", error=_short(exc))
            return None

    def _pull_checkpoints(self, stage: str, directory: Path, newer_than: str | None) -> str | None:
        staging = directory.with_name(f".restore-{directory.name}")
        for attempt, listing in self._checkpoint_sets(stage, newer_than):
            try:
                _empty(staging)
                for rel, entry in sorted(listing["files"].items()):
                    self._download(f"{self._root}/attempts/{attempt}/checkpoints/{stage}/{entry['sha256']}",
                                   staging, rel, entry["size"], entry["sha256"])
                remove_tree(directory)
                os.rename(staging, directory)
            except Exception as exc:  # noqa: BLE001 - a restore that fails is a stage that starts without it
                log.warning("remote_work.restore_failed", stage=stage, what="checkpoints", attempt=attempt,
                            error=_short(exc))
                remove_tree(staging)
                continue
            log.info("remote_work.checkpoints_restored", stage=stage, attempt=attempt, files=len(listing["files"]),
                     progress=listing.get("progress"))
            return attempt
        return None

    def _checkpoint_sets(self, stage: str, newer_than: str | None) -> list[tuple[str, dict]]:
        """(attempt, listing) of each vouched mirrored set for ``stage``, furthest first."""
        sets = []
        item = ledger_item(CHECKPOINTS_ITEM, stage)
        for attempt, items in self._other_attempts(newer_than):  # newest first: the sort keeps that for ties
            if item not in items:
                continue
            try:
                raw = self._vouched_document(self._listing_key(attempt, stage, items[item]), items[item])
                listing = json.loads(raw)
                problem = listing_problem(listing, stage, attempt)
                if problem is not None:
                    raise RestoreMismatch(f"listing refused: {problem}")
            except Exception as exc:  # noqa: BLE001 - an unreadable or refused listing is a candidate less
                log.warning("remote_work.restore_failed", stage=stage, what="checkpoints", attempt=attempt,
                            error=_short(exc))
                continue
            sets.append((attempt, listing))
        return sorted(sets, key=lambda found: _progress(found[1]), reverse=True)

    # ------------------------------------------------------------------ verified outputs
    def push_outputs(self, stage: StageSpec, output_dir: Path) -> None:
        """Mirror a stage's outputs and then its manifest (written already). Never raises."""
        with self._lock:
            try:
                for rel in stage.outputs:
                    with os.fdopen(open_regular(output_dir, rel), "rb") as handle:
                        self._s3.upload_fileobj(handle, self._bucket, f"{self._mine}/output/{rel}")
                manifest = manifest_path(output_dir, stage.name)
                body = manifest.read_bytes()
                self._s3.put_object(Bucket=self._bucket, Key=f"{self._mine}/output/.manifests/{manifest.name}",
                                    Body=body)
                self._ledger.vouch(ledger_item(OUTPUT_ITEM, stage.name), hashlib.sha256(body).hexdigest())
            except Exception as exc:  # noqa: BLE001 - best effort by design
                log.warning("remote_work.push_failed", stage=stage.name, what="outputs", error=_short(exc))
                return
        log.info("remote_work.outputs_pushed", stage=stage.name, files=len(stage.outputs))

    def pull_outputs(self, stage: StageSpec, output_dir: Path) -> str | None:
        """The stage's verified outputs from the newest other attempt whose mirrored manifest the job
        record vouches for, its manifest written last; returns the attempt or None (the stage then
        runs). Never raises."""
        try:
            return self._pull_outputs(stage, output_dir)
        except Exception as exc:  # noqa: BLE001 - a restore that fails is a stage that runs
            log.warning("remote_work.restore_failed", stage=stage.name, what="outputs", error=_short(exc))
            return None

    def _pull_outputs(self, stage: StageSpec, output_dir: Path) -> str | None:
        item = ledger_item(OUTPUT_ITEM, stage.name)
        for attempt, items in self._other_attempts(None):
            if item not in items:
                continue
            base = f"{self._root}/attempts/{attempt}/output"
            try:
                raw = self._vouched_document(f"{base}/.manifests/{stage.name}.json", items[item])
                manifest = _parse_manifest(raw, stage)
                for rel in stage.outputs:
                    entry = manifest["outputs"][rel]
                    problem = _size_problem(entry.get("size"), MAX_RESTORE_BYTES)
                    if problem is not None:
                        raise RestoreMismatch(f"{rel}: {problem}")
                    self._download(f"{base}/{rel}", output_dir, rel, entry["size"], entry["sha256"])
                _write_in_real_dir(output_dir, MANIFEST_DIR_NAME, f"{stage.name}.json", raw)
            except Exception as exc:  # noqa: BLE001 - a restore that fails is a stage that runs
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
        except Exception as exc:  # noqa: BLE001 - the job is committed: its mirror is the lifecycle rule's then
            log.warning("remote_work.forget_failed", error=_short(exc))
        return deleted

    # ------------------------------------------------------------------ helpers
    def _other_attempts(self, newer_than: str | None) -> list[tuple[str, Mapping[str, str]]]:
        """(name, vouched items) of the job's other attempts that the record vouches for, newest first,
        only those newer than ``newer_than``. Names come from the record, never from a bucket listing."""
        try:
            vouched = self._ledger.vouched()
        except Exception as exc:  # noqa: BLE001 - no record to believe: nothing to restore
            log.warning("remote_work.list_failed", error=_short(exc))
            return []
        floor = attempt_order(newer_than) if newer_than else None
        others = []
        for name, items in vouched.items():
            if not isinstance(name, str) or not ATTEMPT_NAME.fullmatch(name):
                log.warning("remote_work.attempt_skipped", attempt=repr(name)[:80], why="not an attempt name")
                continue
            if name != self._attempt and (floor is None or attempt_order(name) > floor):
                others.append((name, items))
        return sorted(others, key=lambda found: attempt_order(found[0]), reverse=True)

    def _listing_key(self, attempt: str, stage: str, sha256_hex: str) -> str:
        return f"{self._root}/attempts/{attempt}/checkpoints/{stage}.{sha256_hex}.json"

    def _vouched_document(self, key: str, sha256_hex: str) -> bytes:
        """The listing or manifest at ``key``, when its bytes are the ones the record vouches for."""
        response = self._s3.get_object(Bucket=self._bucket, Key=key)
        body = response["Body"]
        try:
            raw = body.read(MAX_DOCUMENT_BYTES + 1)
        finally:
            body.close()
        if len(raw) > MAX_DOCUMENT_BYTES or hashlib.sha256(raw).hexdigest() != sha256_hex:
            raise RestoreMismatch(f"{key.rsplit('/', 1)[-1]}: not the document the job record vouches for")
        return raw

    def _download(self, key: str, root: Path, rel: str, size: int, sha256_hex: str) -> None:
        """``root/rel`` from ``key``, checked against ``size`` and ``sha256_hex`` before it takes its name;
        written by descriptor into real directories under a fresh temp name (no link followed). The
        object is read in one stream and never past ``size``: a larger one is refused at its length,
        or as soon as more arrives than was declared."""
        parts = output_parts(rel)
        response = self._s3.get_object(Bucket=self._bucket, Key=key)
        body = response["Body"]
        try:
            if response.get("ContentLength") != size:
                raise RestoreMismatch(f"{rel}: the object's length is not what was recorded")
            real_directory(root.parent, "/".join([root.name, *parts[:-1]]))
            dir_fd = open_real_dir(root.parent, "/".join([root.name, *parts[:-1]]))
            try:
                digest, written = hashlib.sha256(), 0
                with replaced_at(dir_fd, parts[-1]) as out:
                    while chunk := body.read(min(_CHUNK, size - written + 1)):
                        written += len(chunk)
                        if written > size:
                            raise RestoreMismatch(f"{rel}: more bytes than were recorded")
                        digest.update(chunk)
                        out.write(chunk)
                    if (written, digest.hexdigest()) != (size, sha256_hex):
                        raise RestoreMismatch(f"{rel}: what was downloaded is not what was recorded")
            finally:
                os.close(dir_fd)
        finally:
            body.close()


def _parse_manifest(raw: bytes, stage: StageSpec) -> dict:
    """The mirrored manifest when it is one for this very stage definition; ValueError otherwise."""
    manifest, problem = manifest_from_bytes(raw, stage.name, stage.fingerprint, stage.outputs)
    if manifest is None:
        raise ValueError(problem)
    return manifest


def _progress(listing: dict) -> float:
    """A listing's recorded progress, or -1 when it has none (an older worker's, or never reported)."""
    value = listing.get("progress")
    return -1.0 if value is None else float(value)


def _size_problem(size: object, most: int) -> str | None:
    if type(size) is not int:
        return "its size is not a whole number"
    if not 0 <= size <= most:
        return f"its size {size} is outside 0..{most}"
    return None


def _path_problem(rel: object) -> str | None:
    """Why ``rel`` is not a path a restore writes (plain ASCII components, no dot ones, not too deep)."""
    if not isinstance(rel, str):
        return "not a text"
    parts = rel.split("/")
    if len(parts) > _MAX_DEPTH or not all(_PATH_PART.fullmatch(part) for part in parts):
        return f"{rel[:80]!r} is not a plain relative path"
    return None


def listing_problem(listing: Any, stage: str, attempt: str) -> str | None:
    """Why a mirrored checkpoint listing is refused, or None. Checked whole before anything is fetched:
    the file count, every name, size and digest, the total, and the progress (a percent, 0 to 100)."""
    if not isinstance(listing, dict) or listing.get("version") != LISTING_VERSION:
        return "not a listing of this version"
    if listing.get("stage") != stage or listing.get("attempt") != attempt:
        return "names another stage or attempt"
    progress = listing.get("progress")
    if progress is not None and (type(progress) not in (int, float) or not 0 <= progress <= 100):
        return f"progress {str(progress)[:40]} is not a percent"
    files = listing.get("files")
    if not isinstance(files, dict) or not files:
        return "names no files"
    if len(files) > MAX_LISTING_FILES:
        return f"names {len(files)} files, more than {MAX_LISTING_FILES}"
    total = 0
    for rel, entry in files.items():
        problem = _path_problem(rel)
        if problem is None and not isinstance(entry, dict):
            problem = "its entry is not an object"
        if problem is None:
            problem = _size_problem(entry.get("size"), MAX_RESTORE_BYTES)
        if problem is None and not is_sha256_hex(entry.get("sha256")):
            problem = "its digest is not a SHA-256"
        if problem is not None:
            return f"file {str(rel)[:80]!r}: {problem}"
        total += entry["size"]
    if total > MAX_RESTORE_BYTES:
        return f"names {total} bytes, more than {MAX_RESTORE_BYTES}"
    return None


def _checkpoint_files(directory: Path) -> Iterator[tuple[str, Any]]:
    """(path relative to ``directory``, open file) of each regular file below it, reached without a
    link (from the attempt directory down: a stage may have made ``checkpoints/`` a link); links,
    temp files and anything else are left out. The caller closes each file."""
    try:
        top = open_real_dir(directory.parent.parent, f"{directory.parent.name}/{directory.name}")
    except OutputRefused:
        return
    try:
        for current, _dirs, names, current_fd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
            for name in sorted(names):
                if TEMP_MARKER in name:
                    continue
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=current_fd)
                except OSError:
                    continue  # a link (ELOOP), a fifo, or gone
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    continue
                os.set_blocking(fd, True)
                yield os.path.normpath(os.path.join(current, name)), os.fdopen(fd, "rb")
    finally:
        os.close(top)


def _write_in_real_dir(root: Path, directory: str, name: str, data: bytes) -> None:
    real_directory(root, directory)
    dir_fd = open_real_dir(root, directory)
    try:
        atomic_write_at(dir_fd, name, data)
    finally:
        os.close(dir_fd)


def _identity(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _empty(directory: Path) -> None:
    real_directory(directory.parent, directory.name, empty=True)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]

