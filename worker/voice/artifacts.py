"""The five trained artifacts: checked on disk, then written to S3 where a stale attempt cannot change them.

* Keys are content-addressed: ``<prefix>/<environment>/<profileId>/<jobId>/<sha256>/<path under
  output/>``. Another attempt's different bytes land under other keys; the same bytes under the
  same key, with the same content.
* Writes are conditional (``If-None-Match: *``): an existing object is never replaced. When one is
  there already it is reused if its recorded sha256 and size match, else the upload fails. A retry
  finds its objects with one HeadObject first, so it never re-sends gigabytes it already stored.
* The claim is proven by the caller's guards: ``proof`` before each object is written, ``part_proof``
  before each multipart part and before the completion. A guard that raises aborts the upload.
* Bytes are read from the file opened without following any link (``pipeline.files.open_output``),
  hashed and sent from that one descriptor, and checksummed (SHA-256) in transit.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from pipeline.files import (
    OutputRefused,
    open_output,
    output_parts,
    output_problem,
    relative_output,
    sha256_and_size_of,
)
from worker.core.errors import StageFailed, StorageError
from worker.voice.message import is_safe_name
from worker.core.redact import redact_urls_in_text
from worker.voice.records.rules import ASSET_KEYS

log = structlog.get_logger(__name__)

Guard = Callable[[], None]  # raises (LeaseLost, Stopped) when the claim is no longer ours
KeyFor = Callable[[str, str], str]  # (sha256 hex, path under output/) -> key

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# 412: an object exists at the key; 409: a concurrent conditional write to it is in progress.
_EXISTS_CODES = frozenset({"412", "PreconditionFailed", "409", "ConditionalRequestConflict"})
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
S3_MAX_PARTS = 10_000


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
    if not _SHA256_HEX.fullmatch(sha256_hex):
        raise ValueError(f"not a lower-case hex SHA-256: {sha256_hex!r}")
    return (job_key_prefix(prefix, environment, profile_id, job_id) + sha256_hex + "/"
            + "/".join(output_parts(relative_path)))


def _prefix_parts(prefix: str) -> list[str]:
    return [part for part in prefix.split("/") if part]


def ordered_assets(names: Iterable[str]) -> list[str]:
    """The five known assets in their fixed order (``ASSET_KEYS``), then any others alphabetically."""
    present = set(names)
    return [n for n in ASSET_KEYS if n in present] + sorted(present - set(ASSET_KEYS))


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


def stale_leftovers(written: Iterable[str], job: Mapping | None, referenced: Iterable[str]) -> list[str]:
    """Of the objects a stale attempt wrote, those it may delete: only once the job is committed (its
    holder's own cleanup may already have run), and never one the committed paths name (the same bytes
    make the same key, so the committed object can be the one this attempt wrote)."""
    if (job or {}).get("status") != "completed":
        return []
    return unreferenced(written, referenced)


@dataclass(frozen=True)
class Stored:
    """Where one artifact is, and whether this upload created the object."""

    uri: str
    key: str
    written: bool  # False: an object already holding these bytes was reused


class ArtifactUploader:
    def __init__(
        self,
        s3_client,
        bucket: str,
        *,
        multipart_threshold_bytes: int = 8 * 1024 * 1024,
        multipart_chunk_bytes: int = 8 * 1024 * 1024,
        max_concurrency: int = 4,
    ) -> None:
        self._s3 = s3_client
        self._bucket = bucket
        self._threshold_bytes = multipart_threshold_bytes
        self._chunk_bytes = multipart_chunk_bytes
        self._concurrency = max_concurrency

    def uri(self, key: str) -> str:
        return f"s3://{self._bucket}/{key}"

    def key_of(self, uri: str) -> str | None:
        """The key of an s3:// URI in this uploader's bucket; None for anything else."""
        bucket, _, key = str(uri).removeprefix("s3://").partition("/")
        return key if str(uri).startswith("s3://") and bucket == self._bucket and key else None

    def upload(self, output_dir: Path, relative_path: str, key_for: Callable[[str], str], *,
               proof: Guard = _no_guard, part_proof: Guard = _no_guard) -> Stored:
        """Store the output at ``key_for(sha256)``, reusing an object that already holds its bytes."""
        try:
            fd = open_output(Path(output_dir), relative_path)
        except OutputRefused as exc:
            raise StageFailed(f"artifact {relative_path} cannot be uploaded: {exc}") from exc
        with os.fdopen(fd, "rb") as handle:
            try:
                small = os.fstat(handle.fileno()).st_size < self._threshold_bytes
                data = handle.read() if small else None
                sha256_hex, size_bytes = (
                    (hashlib.sha256(data).hexdigest(), len(data)) if data is not None
                    else sha256_and_size_of(handle))
            except OSError as exc:
                raise StageFailed(f"cannot read artifact {relative_path}: {exc.strerror or exc}") from exc
            key = key_for(sha256_hex)
            if object_matches(self._head(key), sha256_hex, size_bytes):
                log.info("artifacts.reused", key=key, size_bytes=size_bytes)
                return Stored(self.uri(key), key, written=False)
            proof()
            started_s = time.monotonic()
            if data is not None:
                written = self._put(key, data, sha256_hex)
            else:
                handle.seek(0)
                written = self._put_multipart(handle, key, sha256_hex, size_bytes, part_proof)
        if written:
            log.info("artifacts.uploaded", key=key, size_bytes=size_bytes,
                     duration_s=round(time.monotonic() - started_s, 3))
        return Stored(self.uri(key), key, written=written)

    def upload_all(self, output_dir: Path, files: Mapping[str, Path], key_for: KeyFor, *,
                   proof: Guard = _no_guard, part_proof: Guard = _no_guard,
                   written: list[str] | None = None) -> dict[str, str]:
        """Upload every asset in the fixed order; asset name -> s3:// URI, in that order.

        ``written`` collects, as they land, the keys this call created (not those it reused), so a
        caller that loses its claim midway knows what it may have left behind.
        """
        uris = {}
        for name in ordered_assets(files):
            path = Path(files[name])
            try:
                relative = relative_output(Path(output_dir), path)
            except ValueError as exc:
                raise StageFailed(f"artifact {name} ({path}) is outside the output directory") from exc
            stored = self.upload(output_dir, relative, lambda sha, rel=relative: key_for(sha, rel),
                                 proof=proof, part_proof=part_proof)
            if stored.written and written is not None:
                written.append(stored.key)
            uris[name] = stored.uri
        return uris

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (ListObjectsV2, paginated)."""
        keys = []
        try:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix):
                keys.extend(item["Key"] for item in page.get("Contents") or [])
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"listing {self.uri(prefix)} failed: {_describe(exc)}") from exc
        return keys

    def delete(self, key: str) -> None:
        try:
            self._s3.delete_object(Bucket=self._bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"deleting {self.uri(key)} failed: {_describe(exc)}") from exc

    # --- writes that never replace an object

    def _put(self, key: str, data: bytes, sha256_hex: str) -> bool:
        try:
            self._s3.put_object(Bucket=self._bucket, Key=key, Body=data, Metadata={"sha256": sha256_hex},
                                ChecksumAlgorithm="SHA256", IfNoneMatch="*")
        except ClientError as exc:
            if _error_code(exc) in _EXISTS_CODES:
                self._accept_existing(key, sha256_hex, len(data))
                return False
            raise StorageError(f"upload to {self.uri(key)} failed: {_describe(exc)}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"upload to {self.uri(key)} failed: {_describe(exc)}") from exc
        return True

    # Hand-written rather than s3transfer's upload_file: that one cannot make the completion
    # conditional (If-None-Match is not among its allowed upload arguments) and has no hook to prove
    # the claim before each part.
    def _put_multipart(self, handle: BinaryIO, key: str, sha256_hex: str, size_bytes: int,
                       part_proof: Guard) -> bool:
        uri = self.uri(key)
        chunk_bytes = max(self._chunk_bytes, -(-size_bytes // S3_MAX_PARTS))
        try:
            upload_id = self._s3.create_multipart_upload(
                Bucket=self._bucket, Key=key, Metadata={"sha256": sha256_hex}, ChecksumAlgorithm="SHA256",
            )["UploadId"]
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"upload to {uri} failed: {_describe(exc)}") from exc
        try:
            parts = self._send_parts(handle, key, upload_id, chunk_bytes, sha256_hex, part_proof)
            part_proof()
            self._s3.complete_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id,
                                               MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except ClientError as exc:
            self._abort(key, upload_id)
            if _error_code(exc) in _EXISTS_CODES:
                self._accept_existing(key, sha256_hex, size_bytes)
                return False
            raise StorageError(f"upload to {uri} failed: {_describe(exc)}") from exc
        except BotoCoreError as exc:
            self._abort(key, upload_id)
            raise StorageError(f"upload to {uri} failed: {_describe(exc)}") from exc
        except BaseException:
            self._abort(key, upload_id)
            raise
        return True

    def _send_parts(self, handle: BinaryIO, key: str, upload_id: str, chunk_bytes: int, sha256_hex: str,
                    part_proof: Guard) -> list[dict]:
        """Read the parts in order (hashing them again) and send up to ``max_concurrency`` at once."""
        digest = hashlib.sha256()
        parts: list[dict] = []
        with ThreadPoolExecutor(self._concurrency, thread_name_prefix="upload-part") as pool:
            pending: set[Future] = set()
            try:
                number = 0
                while data := handle.read(chunk_bytes):
                    number += 1
                    digest.update(data)
                    while len(pending) >= self._concurrency:
                        done, pending = wait(pending, return_when=FIRST_COMPLETED)
                        parts.extend(future.result() for future in done)
                    pending.add(pool.submit(self._send_part, key, upload_id, number, data, part_proof))
                done, pending = wait(pending)
                parts.extend(future.result() for future in done)
            except BaseException:
                for future in pending:
                    future.cancel()  # parts not started yet never start; those in flight finish
                raise
        if digest.hexdigest() != sha256_hex:
            # The key names the bytes hashed first; a file rewritten since is not what it names.
            raise StageFailed(f"artifact for {key} changed while it was uploaded")
        return sorted(parts, key=lambda part: part["PartNumber"])

    def _send_part(self, key: str, upload_id: str, number: int, data: bytes, part_proof: Guard) -> dict:
        part_proof()
        answer = self._s3.upload_part(Bucket=self._bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                      Body=data, ChecksumAlgorithm="SHA256")
        part = {"PartNumber": number, "ETag": answer["ETag"]}
        if answer.get("ChecksumSHA256"):
            part["ChecksumSHA256"] = answer["ChecksumSHA256"]
        return part

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._s3.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)
        except (ClientError, BotoCoreError) as exc:
            # The bucket's lifecycle rule removes incomplete uploads after a week.
            log.warning("artifacts.abort_failed", key=key, error=_describe(exc))

    def _accept_existing(self, key: str, sha256_hex: str, size_bytes: int) -> None:
        """Another write got to the key first: fine if it holds our bytes, never replaced otherwise."""
        if not object_matches(self._head(key), sha256_hex, size_bytes):
            raise StorageError(f"{self.uri(key)} already holds other bytes; an existing object is never replaced")
        log.info("artifacts.reused", key=key, size_bytes=size_bytes, note="written concurrently")

    def _head(self, key: str) -> dict | None:
        try:
            return self._s3.head_object(Bucket=self._bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            if isinstance(exc, ClientError) and _error_code(exc) in _NOT_FOUND_CODES:
                return None  # not uploaded yet
            raise StorageError(f"checking {self.uri(key)} failed: {_describe(exc)}") from exc


def _error_code(exc: ClientError) -> str:
    error = exc.response.get("Error") or {}
    status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(error.get("Code") or status or "")


def _describe(exc: BaseException) -> str:
    # botocore messages can carry endpoint URLs; keep them, minus any query string.
    return redact_urls_in_text(f"{type(exc).__name__}: {exc}")[:300]
