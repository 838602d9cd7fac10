"""The trained artifacts: checked on disk, then written to S3 where a stale attempt cannot change them.

* Keys are content-addressed: ``<prefix>/<environment>/<profileId>/<jobId>/<sha256>/<path under
  output/>``. Another attempt's different bytes land under other keys; the same bytes under the
  same key, with the same content.
* Writes are conditional (``If-None-Match: *``): an existing object is never replaced. What is stored
  already is found with one ListObjectsV2 under the keys' common prefix (the job's), not a request
  per file: an absent key costs nothing more before its write; a listed key of another size, or
  whose recorded sha256 (user metadata, which a listing does not return, so one HeadObject per listed
  key of the right size) is another, fails the upload before a byte is sent; a match is reused.
* The claim is proven by the caller's guards: ``proof`` before each object is begun, ``part_proof``
  before each request that writes (each part, the completion, a single PUT). A guard that raises stops
  every upload of the call: nothing queued is sent, open multipart uploads are aborted.
* All the files go up together through one thread pool per uploader (the process has one): at most
  ``max_concurrency`` requests in flight over all of them, at most ``max_concurrency +
  READ_AHEAD_PARTS`` parts held in memory. Objects are begun one after another, each after its proof
  and once the previous one's first write returned, so a claim lost while one object goes up lets no
  later one begin; between beginnings the largest begun file is read first, so its completion (the
  longest) overlaps the others' parts.
* Bytes are read from the file opened without following any link (``pipeline.files.open_output``).

Each file is hashed once, by its stage's manifest (``pipeline.manifest``), which records the digest
with the file's identity (``pipeline.files.FileIdentity``: device, inode, size, modification and
change times). That digest names the key (``recorded``, from ``pipeline.manifest.recorded_outputs``),
so the key is known, and a stored object reused, before a byte is read; a reused object is not read
at all (its bytes were checked when it was written). The file could still change between its
manifest and the upload, so the descriptor the bytes are read from must show the recorded identity
when it is opened and again once the last byte is read; only then is the upload completed (a
single PUT: sent). A write in between changes the identity: ``StageFailed``, the multipart upload is
aborted, and no key ever names other bytes. A file with no recorded identity (an older manifest, a
racy file, a copy) is hashed as it is read and sent from that same buffer, and checked against the
digest instead; a file no manifest records is hashed first to name its key, then checked the same way.

In flight, every request carries S3's default CRC32 checksum, not SHA-256: a multipart object's
SHA-256 checksum is a checksum of the parts' checksums, never the file's digest, so it would be a
second SHA-256 pass over every byte (about 0.6 GB/s per core here, CRC32 about 2.5 GB/s) for what
CRC32 already catches, a corrupted transfer. (Handing S3 our own digest as a single PUT's checksum is
no way out: botocore then signs the payload, another SHA-256 pass.) What the bytes are is settled by
the one SHA-256 above, stored as the ``sha256`` metadata.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from pipeline.errors import StageFailed
from pipeline.files import (
    FileIdentity,
    OutputRefused,
    open_output,
    output_parts,
    output_problem,
    relative_output,
    sha256_and_size_of,
)
from pipeline.manifest import Recorded
from worker.core.names import is_sha256_hex
from worker.core.redact import redact_urls_in_text
from worker.voice.errors import StorageError
from worker.voice.message import is_safe_name
from worker.voice.records.models import COMPLETED, JobRecord
from worker.voice.records.rules import REQUIRED_ARTIFACTS

log = structlog.get_logger(__name__)

Guard = Callable[[], None]  # raises (LeaseLost, Stopped) when the claim is no longer ours
KeyFor = Callable[[str, str], str]  # (sha256 hex, path under output/) -> key

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# 412: an object exists at the key; 409: a concurrent conditional write to it is in progress.
_EXISTS_CODES = frozenset({"412", "PreconditionFailed", "409", "ConditionalRequestConflict"})
S3_MAX_PARTS = 10_000
# Parts read ahead of the threads free to send them, so a thread that finishes finds the next one read.
READ_AHEAD_PARTS = 2
# The checksum each write carries in flight (see the module docstring for why not SHA-256).
TRANSFER_CHECKSUM = "CRC32"


def _no_guard() -> None:
    return None


def job_key_prefix(prefix: str, environment: str, profile_id: str, job_id: str) -> str:
    """``<prefix>/<environment>/<profileId>/<jobId>/``: every object of every attempt of the job is under it."""
    named = {"environment": environment, "profile_id": profile_id, "job_id": job_id}
    for label, value in named.items():
        if not is_safe_name(value):
            raise ValueError(f"{label} is not a safe key part: {value!r}")
    return "/".join([*_prefix_parts(prefix), environment, profile_id, job_id]) + "/"


def artifact_key(
    prefix: str, environment: str, profile_id: str, job_id: str, sha256_hex: str, relative_path: str
) -> str:
    """``<prefix>/<environment>/<profileId>/<jobId>/<sha256>/<relative_path>``, with no empty parts."""
    if not is_sha256_hex(sha256_hex):
        raise ValueError(f"not a lower-case hex SHA-256: {sha256_hex!r}")
    return (job_key_prefix(prefix, environment, profile_id, job_id) + sha256_hex + "/"
            + "/".join(output_parts(relative_path)))


def _prefix_parts(prefix: str) -> list[str]:
    return [part for part in prefix.split("/") if part]


def ordered_assets(names: Iterable[str]) -> list[str]:
    """The required assets in their fixed order (``REQUIRED_ARTIFACTS``), then any others a config
    adds, alphabetically."""
    present = set(names)
    return [n for n in REQUIRED_ARTIFACTS if n in present] + sorted(present - set(REQUIRED_ARTIFACTS))


def verify_local(output_dir: Path, files: Mapping[str, Path]) -> None:
    """Every artifact is a non-empty regular file inside ``output_dir`` reached without a symlink (the
    pipeline's rule, ``pipeline.files.open_output``); else ``StageFailed`` naming each bad asset."""
    problems = [
        f"{name} ({files[name]}): {problem}"
        for name in ordered_assets(files)
        if (problem := _local_file_problem(Path(output_dir), Path(files[name])))
    ]
    if problems:
        raise StageFailed("artifacts not ready: " + "; ".join(problems))


def _local_file_problem(output_dir: Path, path: Path) -> str | None:
    try:
        relative = relative_output(output_dir, path)
    except ValueError:
        return "outside the output directory"
    return output_problem(output_dir, relative)


def object_matches(head: Mapping | None, sha256_hex: str, size_bytes: int) -> bool:
    """Whether a HeadObject answer (None: no object) already holds exactly these bytes."""
    if head is None:
        return False
    recorded = (head.get("Metadata") or {}).get("sha256")
    return recorded == sha256_hex and head.get("ContentLength") == size_bytes


def unreferenced(keys: Iterable[str], referenced: Iterable[str]) -> list[str]:
    """The keys no committed path names, in order: what a cleanup may delete."""
    keep = set(referenced)
    return [key for key in keys if key not in keep]


def stale_leftovers(written: Iterable[str], job: JobRecord | None, referenced: Iterable[str]) -> list[str]:
    """Of the objects a stale attempt wrote, those it may delete: only once the job is committed (its
    holder's own cleanup may already have run), and never one the committed paths name (the same bytes
    make the same key, so the committed object can be the one this attempt wrote)."""
    if job is None or job.status != COMPLETED:
        return []
    return unreferenced(written, referenced)


@dataclass(frozen=True)
class Stored:
    """Where one artifact is, and whether this upload created the object."""

    uri: str
    key: str
    written: bool  # False: an object already holding these bytes was reused


@dataclass(eq=False)
class _Artifact:
    """One file of an ``upload_all`` call, from its open descriptor to its stored object."""

    rel: str  # path under the output directory
    handle: BinaryIO
    size_bytes: int
    sha256_hex: str
    # The identity the digest was recorded with, when the open file showed it: then the bytes read
    # are the hashed ones as long as it still shows it, and nothing is hashed again.
    identity: FileIdentity | None = None
    key: str = ""
    data: bytes | None = None  # a file below the multipart threshold, read whole: the bytes sent
    hasher: Any = None  # hashlib.sha256() of the bytes read so far (multipart, no identity)
    read_bytes: int = 0
    chunk_bytes: int = 0
    upload_id: str | None = None
    parts: list[dict] = field(default_factory=list)  # the parts sent, as the completion names them
    parts_read: int = 0
    parts_in_flight: int = 0
    stored: Stored | None = None
    started_s: float = 0.0

    @property
    def read_all(self) -> bool:
        return self.read_bytes >= self.size_bytes


class ArtifactUploader:
    """Uploads through one thread pool, made at the first upload and kept for the uploader's life: the
    process has one uploader (``worker.app``), so every job's requests share ``max_concurrency`` threads."""

    def __init__(
        self,
        s3_client,
        bucket: str,
        *,
        multipart_threshold_bytes: int = 8 * 1024 * 1024,
        multipart_chunk_bytes: int = 8 * 1024 * 1024,
        max_concurrency: int = 8,
    ) -> None:
        self._s3 = s3_client
        self._bucket = bucket
        self._threshold_bytes = multipart_threshold_bytes
        self._chunk_bytes = multipart_chunk_bytes
        self._concurrency = max_concurrency
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    def uri(self, key: str) -> str:
        return f"s3://{self._bucket}/{key}"

    def key_of(self, uri: str) -> str | None:
        """The key of an s3:// URI in this uploader's bucket; None for anything else."""
        bucket, _, key = str(uri).removeprefix("s3://").partition("/")
        return key if str(uri).startswith("s3://") and bucket == self._bucket and key else None

    def upload(self, output_dir: Path, relative_path: str, key_for: Callable[[str], str], *,
               proof: Guard = _no_guard, part_proof: Guard = _no_guard, recorded: Recorded | None = None) -> Stored:
        """Store the output at ``key_for(sha256)``, reusing an object that already holds its bytes."""
        return self._store(Path(output_dir), [relative_path], lambda sha, _rel: key_for(sha), proof, part_proof,
                           None, {relative_path: recorded} if recorded else {})[0]

    def upload_all(self, output_dir: Path, files: Mapping[str, Path], key_for: KeyFor, *,
                   proof: Guard = _no_guard, part_proof: Guard = _no_guard,
                   written: list[str] | None = None,
                   recorded: Mapping[str, Recorded] | None = None) -> dict[str, str]:
        """Upload every asset, all at once; asset name -> s3:// URI, in the fixed order.

        ``recorded``: ``Recorded`` by path under ``output_dir``, as the stage manifests record them
        (``pipeline.manifest.recorded_outputs``); a file listed there is not hashed before it is sent.
        ``written`` collects, as they land, the keys this call created (not those it reused), so a
        caller that loses its claim midway knows what it may have left behind.
        """
        names = ordered_assets(files)
        rels = []
        for name in names:
            path = Path(files[name])
            try:
                rels.append(relative_output(Path(output_dir), path))
            except ValueError as exc:
                raise StageFailed(f"artifact {name} ({path}) is outside the output directory") from exc
        stored = self._store(Path(output_dir), rels, key_for, proof, part_proof, written, recorded or {})
        return {name: item.uri for name, item in zip(names, stored, strict=True)}

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (ListObjectsV2, paginated)."""
        return list(self._listing(prefix))

    def delete(self, key: str) -> None:
        try:
            self._s3.delete_object(Bucket=self._bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"deleting {self.uri(key)} failed: {_describe(exc)}") from exc

    # --- the steps of one call: open and name, find what is stored, send the rest

    def _store(self, output_dir: Path, rels: list[str], key_for: KeyFor, proof: Guard, part_proof: Guard,
               written: list[str] | None, recorded: Mapping[str, Recorded]) -> list[Stored]:
        with ExitStack() as files:
            items = [self._open(output_dir, rel, recorded.get(rel), files) for rel in rels]
            for item in items:
                item.key = key_for(item.sha256_hex, item.rel)
            self._find_stored(items)
            self._send([item for item in items if item.stored is None], proof, part_proof, written)
        stored = [item.stored for item in items]
        if any(entry is None for entry in stored):  # every item was found stored or was just sent
            raise StorageError("an artifact was neither found stored nor uploaded")
        return [entry for entry in stored if entry is not None]

    def _open(self, output_dir: Path, rel: str, recorded: Recorded | None, files: ExitStack) -> _Artifact:
        """The file opened by the pipeline's rule, and the digest that names its key: the one its stage
        recorded (checked against the file's size now), else hashed here, once."""
        try:
            fd = open_output(output_dir, rel)
        except OutputRefused as exc:
            raise StageFailed(f"artifact {rel} cannot be uploaded: {exc}") from exc
        handle = files.enter_context(os.fdopen(fd, "rb"))
        try:
            identity = FileIdentity.of_fd(handle.fileno())
            size_bytes = identity.size
            if recorded is not None:
                if recorded.size != size_bytes:
                    raise StageFailed(f"artifact {rel} changed since its stage recorded it: {size_bytes} bytes, "
                                      f"not {recorded.size}")
                unchanged = recorded.identity is not None and recorded.identity == identity
                return _Artifact(rel, handle, size_bytes, recorded.sha256, identity=identity if unchanged else None)
            if size_bytes < self._threshold_bytes:
                data = handle.read()
                return _Artifact(rel, handle, len(data), hashlib.sha256(data).hexdigest(), data=data)
            sha256_hex, size_bytes = sha256_and_size_of(handle)
            handle.seek(0)
        except OSError as exc:
            raise StageFailed(f"cannot read artifact {rel}: {exc.strerror or exc}") from exc
        return _Artifact(rel, handle, size_bytes, sha256_hex)

    def _find_stored(self, items: list[_Artifact]) -> None:
        """One listing under the keys' common directory (the job's prefix) instead of a HeadObject per
        file; only a listed key of the right size is read with HeadObject (the sha256 is metadata)."""
        if not items:
            return
        common = os.path.commonprefix([item.key for item in items])
        listed = self._listing(common[:common.rfind("/") + 1])
        candidates = []
        for item in items:
            if item.key not in listed:
                continue
            if listed[item.key] != item.size_bytes:
                raise self._other_bytes(item.key)
            candidates.append(item)
        for item, head in zip(candidates, self._pool().map(lambda i: self._head(i.key), candidates), strict=True):
            if head is None:
                continue  # deleted since the listing: written again below
            if not object_matches(head, item.sha256_hex, item.size_bytes):
                raise self._other_bytes(item.key)
            log.info("artifacts.reused", key=item.key, size_bytes=item.size_bytes)
            item.stored = Stored(self.uri(item.key), item.key, written=False)

    def _send(self, items: list[_Artifact], proof: Guard, part_proof: Guard, written: list[str] | None) -> None:
        """Write every object, their requests in flight together (at most ``max_concurrency`` at a time).

        Objects are begun in order, each after its ``proof`` and only once the previous one's first write
        has returned, so a claim lost during one write lets no later object begin. Between beginnings,
        the largest begun file with bytes left is read first: its completion, the longest (S3
        assembles the object), then overlaps the smaller files' parts instead of ending the upload.
        Each part is hashed as it is read and sent from that very buffer, so the digest checked before
        the completion is that of the bytes sent.
        """
        to_begin = deque(items)
        reading: list[_Artifact] = []  # begun multipart uploads with bytes left to read
        in_flight: dict[Future, tuple[str, _Artifact]] = {}
        first_write: Future | None = None  # the last begun object's first write, until it returns
        if not items:
            return
        pool = self._pool()
        room = self._concurrency + READ_AHEAD_PARTS  # parts in memory: sent, queued or being sent
        try:
            while to_begin or reading or in_flight:
                if len(in_flight) < room and to_begin and first_write is None:
                    item = to_begin.popleft()
                    proof()
                    item.started_s = time.monotonic()
                    if item.data is None and item.size_bytes >= self._threshold_bytes:
                        self._create(item)
                        first_write = self._submit_part(pool, item, part_proof, in_flight)
                        if not item.read_all:
                            reading.append(item)
                    else:
                        self._read_whole(item)
                        first_write = pool.submit(self._put, item, part_proof)
                        in_flight[first_write] = ("put", item)
                    continue
                if len(in_flight) < room and reading:
                    item = max(reading, key=lambda begun: begun.size_bytes)
                    self._submit_part(pool, item, part_proof, in_flight)
                    if item.read_all:
                        reading.remove(item)
                    continue
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    kind, item = in_flight.pop(future)
                    result = future.result()
                    if future is first_write:
                        first_write = None
                    if kind == "part":
                        item.parts.append(result)
                        item.parts_in_flight -= 1
                        if item.read_all and not item.parts_in_flight:
                            in_flight[pool.submit(self._complete, item, part_proof)] = ("complete", item)
                    else:
                        self._landed(item, result, written)
        except BaseException:
            self._unwind(items, in_flight, written)
            raise

    def _landed(self, item: _Artifact, written_now: bool, written: list[str] | None) -> None:
        item.stored = Stored(self.uri(item.key), item.key, written=written_now)
        if written_now:
            if written is not None:
                written.append(item.key)
            log.info("artifacts.uploaded", key=item.key, size_bytes=item.size_bytes,
                     duration_s=round(time.monotonic() - item.started_s, 3))

    def _unwind(self, items: list[_Artifact], in_flight: dict[Future, tuple[str, _Artifact]],
                written: list[str] | None) -> None:
        """After a failure: nothing queued starts, what is in flight ends, every unfinished multipart
        upload is aborted, and ``written`` names each object that landed all the same."""
        for future in in_flight:
            future.cancel()
        wait(in_flight)
        for future, (kind, item) in in_flight.items():
            if kind != "part" and not future.cancelled() and future.exception() is None:
                self._landed(item, future.result(), written)
        for item in items:
            if item.upload_id is not None and item.stored is None:
                self._abort(item.key, item.upload_id)

    def _pool(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._concurrency, thread_name_prefix="upload")
            return self._executor

    def _read_whole(self, item: _Artifact) -> None:
        """A file sent in one PUT: read whole (unless already, to name its key), checked against its digest."""
        if item.data is None:
            try:
                item.data = item.handle.read(item.size_bytes + 1)
            except OSError as exc:
                raise StageFailed(f"cannot read artifact {item.rel}: {exc.strerror or exc}") from exc
            if not _holds_its_digest(item):
                raise _changed(item)

    def _submit_part(self, pool: ThreadPoolExecutor, item: _Artifact, part_proof: Guard,
                     in_flight: dict[Future, tuple[str, _Artifact]]) -> Future:
        """Read and hash the file's next part, and queue it; the digest is checked once the last is read."""
        try:
            data = item.handle.read(min(item.chunk_bytes, item.size_bytes - item.read_bytes))
        except OSError as exc:
            raise StageFailed(f"cannot read artifact {item.rel}: {exc.strerror or exc}") from exc
        if not data:
            raise _changed(item)  # shorter than when it was named
        if item.hasher is not None:
            item.hasher.update(data)
        item.read_bytes += len(data)
        if item.read_all and not _holds_its_digest(item):
            raise _changed(item)
        item.parts_read += 1
        item.parts_in_flight += 1
        future = pool.submit(self._send_part, item, item.parts_read, data, part_proof)
        in_flight[future] = ("part", item)
        return future

    # --- writes that never replace an object

    def _put(self, item: _Artifact, part_proof: Guard) -> bool:
        part_proof()
        try:
            self._s3.put_object(Bucket=self._bucket, Key=item.key, Body=item.data, Metadata={"sha256": item.sha256_hex},
                                ChecksumAlgorithm=TRANSFER_CHECKSUM, IfNoneMatch="*")
        except ClientError as exc:
            if _error_code(exc) in _EXISTS_CODES:
                self._accept_existing(item.key, item.sha256_hex, item.size_bytes)
                return False
            raise StorageError(f"upload to {self.uri(item.key)} failed: {_describe(exc)}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"upload to {self.uri(item.key)} failed: {_describe(exc)}") from exc
        return True

    # Hand-written rather than s3transfer's upload_file: that one cannot make the completion
    # conditional (If-None-Match is not among its allowed upload arguments) and has no hook to prove
    # the claim before each part, nor to hash exactly the bytes it sends.
    def _create(self, item: _Artifact) -> None:
        item.chunk_bytes = max(self._chunk_bytes, -(-item.size_bytes // S3_MAX_PARTS))
        item.hasher = hashlib.sha256() if item.identity is None else None
        try:
            item.upload_id = self._s3.create_multipart_upload(
                Bucket=self._bucket, Key=item.key, Metadata={"sha256": item.sha256_hex},
                ChecksumAlgorithm=TRANSFER_CHECKSUM,
            )["UploadId"]
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"upload to {self.uri(item.key)} failed: {_describe(exc)}") from exc

    def _send_part(self, item: _Artifact, number: int, data: bytes, part_proof: Guard) -> dict:
        part_proof()
        try:
            answer = self._s3.upload_part(Bucket=self._bucket, Key=item.key, UploadId=item.upload_id,
                                          PartNumber=number, Body=data, ChecksumAlgorithm=TRANSFER_CHECKSUM)
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"upload to {self.uri(item.key)} failed: {_describe(exc)}") from exc
        part = {"PartNumber": number, "ETag": answer["ETag"]}
        if answer.get(f"Checksum{TRANSFER_CHECKSUM}"):
            part[f"Checksum{TRANSFER_CHECKSUM}"] = answer[f"Checksum{TRANSFER_CHECKSUM}"]
        return part

    def _complete(self, item: _Artifact, part_proof: Guard) -> bool:
        part_proof()
        parts = sorted(item.parts, key=lambda part: part["PartNumber"])
        try:
            self._s3.complete_multipart_upload(Bucket=self._bucket, Key=item.key, UploadId=item.upload_id,
                                               MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except ClientError as exc:
            if _error_code(exc) in _EXISTS_CODES:
                if item.upload_id is not None:
                    self._abort(item.key, item.upload_id)
                item.upload_id = None
                self._accept_existing(item.key, item.sha256_hex, item.size_bytes)
                return False
            raise StorageError(f"upload to {self.uri(item.key)} failed: {_describe(exc)}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"upload to {self.uri(item.key)} failed: {_describe(exc)}") from exc
        return True

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._s3.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)
        except (ClientError, BotoCoreError) as exc:
            # The bucket's lifecycle rule removes incomplete uploads after a week.
            log.warning("artifacts.abort_failed", key=key, error=_describe(exc))

    def _accept_existing(self, key: str, sha256_hex: str, size_bytes: int) -> None:
        """Another write got to the key first: fine if it holds our bytes, never replaced otherwise."""
        if not object_matches(self._head(key), sha256_hex, size_bytes):
            raise self._other_bytes(key)
        log.info("artifacts.reused", key=key, size_bytes=size_bytes, note="written concurrently")

    def _other_bytes(self, key: str) -> StorageError:
        return StorageError(f"{self.uri(key)} already holds other bytes; an existing object is never replaced")

    def _head(self, key: str) -> dict | None:
        try:
            return self._s3.head_object(Bucket=self._bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            if isinstance(exc, ClientError) and _error_code(exc) in _NOT_FOUND_CODES:
                return None  # not uploaded yet
            raise StorageError(f"checking {self.uri(key)} failed: {_describe(exc)}") from exc

    def _listing(self, prefix: str) -> dict[str, int]:
        """Key -> size of every object under ``prefix`` (ListObjectsV2, paginated)."""
        listed: dict[str, int] = {}
        try:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix):
                listed.update((item["Key"], item["Size"]) for item in page.get("Contents") or [])
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"listing {self.uri(prefix)} failed: {_describe(exc)}") from exc
        return listed


def _holds_its_digest(item: _Artifact) -> bool:
    """Whether every byte read is the bytes the key's digest was taken of: the open file still shows the
    identity it was recorded with (nothing wrote to it since it was hashed), or what was read hashes to it."""
    if item.identity is not None:
        return FileIdentity.of_fd(item.handle.fileno()) == item.identity
    if item.data is not None:
        return hashlib.sha256(item.data).hexdigest() == item.sha256_hex
    return item.hasher is not None and item.hasher.hexdigest() == item.sha256_hex


def _changed(item: _Artifact) -> StageFailed:
    # The key names the digest the file had when it was named; bytes that no longer hash to it are not
    # what the key says, so they are never stored under it.
    return StageFailed(f"artifact for {item.key} changed while it was uploaded: its bytes no longer hash to "
                       "the digest its key names")


def _error_code(exc: ClientError) -> str:
    error = exc.response.get("Error") or {}
    status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(error.get("Code") or status or "")


def _describe(exc: BaseException) -> str:
    # botocore messages can carry endpoint URLs; keep them, minus any query string.
    return redact_urls_in_text(f"{type(exc).__name__}: {exc}")[:300]
