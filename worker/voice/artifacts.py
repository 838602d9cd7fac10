"""The five trained artifacts: checked on disk, then uploaded to S3 under deterministic keys.

Uploads are idempotent: an object whose recorded sha256 and size match the local file is reused, so
a retried job (or one whose delete failed after commit) never re-sends gigabytes it already stored.
Bytes are checksummed (SHA-256) in transit, so S3 rejects a corrupted upload instead of storing it.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

import structlog
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError

from pipeline.files import sha256_and_size
from worker.core.errors import StageFailed, StorageError
from worker.voice.message import is_safe_name
from worker.core.redact import redact_urls_in_text
from worker.voice.store import ASSET_KEYS

log = structlog.get_logger(__name__)

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


def artifact_key(
    prefix: str, environment: str, profile_id: str, job_id: str, relative_path: str
) -> str:
    """``<prefix>/<environment>/<profileId>/<jobId>/<relative_path>``, with no empty parts."""
    named = {"environment": environment, "profile_id": profile_id, "job_id": job_id}
    for label, value in named.items():
        if not is_safe_name(value):
            raise ValueError(f"{label} is not a safe key part: {value!r}")
    parts = [*_prefix_parts(prefix), environment, profile_id, job_id, *_relative_parts(relative_path)]
    return "/".join(parts)


def _prefix_parts(prefix: str) -> list[str]:
    return [part for part in prefix.split("/") if part]


def _relative_parts(relative_path: str) -> list[str]:
    path = PurePosixPath(relative_path)
    if path.is_absolute():
        raise ValueError(f"artifact path must be relative to the output dir: {relative_path!r}")
    # PurePosixPath drops "." and repeated "/" but keeps "..", which would climb out of the job.
    parts = [part for part in path.parts if part != "."]
    if ".." in parts or "\\" in relative_path:
        raise ValueError(f"artifact path must stay under the output directory: {relative_path!r}")
    if not parts:
        raise ValueError(f"artifact path is empty: {relative_path!r}")
    return parts


def ordered_assets(names: Iterable[str]) -> list[str]:
    """The five known assets in their fixed order (``ASSET_KEYS``), then any others alphabetically."""
    present = set(names)
    return [n for n in ASSET_KEYS if n in present] + sorted(present - set(ASSET_KEYS))


def verify_local(files: Mapping[str, Path]) -> None:
    """Every artifact is a non-empty regular file; else ``StageFailed`` naming each bad asset."""
    problems = [
        f"{name} ({files[name]}): {problem}"
        for name in ordered_assets(files)
        if (problem := _local_file_problem(Path(files[name])))
    ]
    if problems:
        raise StageFailed("artifacts not ready: " + "; ".join(problems))


def _local_file_problem(path: Path) -> str | None:
    # lstat: a symlink is not an output the trainer wrote, and could point anywhere on the host.
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or type(exc).__name__})"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    return "empty" if info.st_size == 0 else None


def object_matches(head: Mapping | None, sha256_hex: str, size_bytes: int) -> bool:
    """Whether a HeadObject answer (None: no object) already holds exactly these bytes."""
    if head is None:
        return False
    recorded = (head.get("Metadata") or {}).get("sha256")
    return recorded == sha256_hex and head.get("ContentLength") == size_bytes


class ArtifactUploader:
    def __init__(
        self,
        s3_client,
        bucket: str,
        *,
        multipart_threshold_bytes: int = 8 * 1024 * 1024,
        multipart_chunk_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self._s3 = s3_client
        self._bucket = bucket
        # "classic": the thresholds above decide multipart; the CRT client would pick its own.
        self._transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold_bytes,
            multipart_chunksize=multipart_chunk_bytes,
            max_concurrency=4,
            preferred_transfer_client="classic",
        )

    def upload(self, local_path: Path, key: str) -> str:
        """Store ``local_path`` at ``key`` (reusing a matching object) and return its s3:// URI."""
        uri = f"s3://{self._bucket}/{key}"
        try:
            sha256_hex, size_bytes = sha256_and_size(Path(local_path))
        except OSError as exc:
            raise StageFailed(f"cannot read artifact {local_path}: {exc.strerror or exc}") from exc
        if object_matches(self._head(key), sha256_hex, size_bytes):
            log.info("artifacts.reused", key=key, size_bytes=size_bytes)
            return uri
        started_s = time.monotonic()
        try:
            self._s3.upload_file(
                Filename=str(local_path),
                Bucket=self._bucket,
                Key=key,
                ExtraArgs={"Metadata": {"sha256": sha256_hex}, "ChecksumAlgorithm": "SHA256"},
                Config=self._transfer_config,
            )
        except (ClientError, BotoCoreError, Boto3Error, OSError) as exc:
            raise StorageError(f"upload to {uri} failed: {_describe(exc)}") from exc
        log.info(
            "artifacts.uploaded",
            key=key,
            size_bytes=size_bytes,
            duration_s=round(time.monotonic() - started_s, 3),
        )
        return uri

    def upload_all(self, files: Mapping[str, Path], keys: Mapping[str, str]) -> dict[str, str]:
        """Upload every asset in the fixed order; asset name -> s3:// URI, in that order."""
        if set(files) != set(keys):
            raise ValueError(
                f"files and keys name different assets: {sorted(set(files) ^ set(keys))}"
            )
        return {name: self.upload(Path(files[name]), keys[name]) for name in ordered_assets(files)}

    def _head(self, key: str) -> dict | None:
        try:
            return self._s3.head_object(Bucket=self._bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            if isinstance(exc, ClientError) and _error_code(exc) in _NOT_FOUND_CODES:
                return None  # not uploaded yet
            uri = f"s3://{self._bucket}/{key}"
            raise StorageError(f"checking {uri} failed: {_describe(exc)}") from exc


def _error_code(exc: ClientError) -> str:
    error = exc.response.get("Error") or {}
    status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(error.get("Code") or status or "")


def _describe(exc: BaseException) -> str:
    # botocore messages can carry endpoint URLs; keep them, minus any query string.
    return redact_urls_in_text(f"{type(exc).__name__}: {exc}")[:300]
