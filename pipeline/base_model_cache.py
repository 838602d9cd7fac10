"""The host's cache of the pipeline's base model (``pipeline.base_model`` is what the config pins): fetched
once per host into a content-addressed cache, verified byte for byte, and handed to the stages as
``{base_model_dir}``.

The config names the files, each with its size and SHA-256, so what a stage starts from is fixed by
the config alone, whatever the ``location`` (an ``s3://bucket/prefix`` or a local directory) serves.
The cache entry is named by a digest over that file list (``BaseModelSpec.digest``): the SHA-256 of the
canonical JSON of the list sorted by path, each file ``{"path", "sha256", "size"}`` (keys sorted, no
spaces). The name, location and licence are not part of it: the same bytes from another mirror are the
same entry, and two configs that pin the same files share it.

Layout under the cache root (``BASE_MODEL_CACHE_DIR``)::

    .lock                   the fetch lock (``fcntl.flock``): one fetch at a time on the host
    <digest>/...            a published entry: complete, verified, read-only, never changed again
    .tmp-<digest>-<random>/ a fetch under way (or left by a crash: removed by the next lock holder)

A fetch writes into a temp directory beside the entry, verifies every file as it streams (never past
its declared size), syncs it, then ``rename``s it to ``<digest>``: an entry is either absent or whole,
so a reader never sees a half-written file. The workers of one host share the root; a second worker
that starts while the first fetches waits on the lock, then finds the entry published. A base that
cannot be fetched or does not verify is the host's problem, not a job's: ``HostUnfit``, raised at
start-up before the first receive.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from pipeline.base_model import BaseModelFile, BaseModelSpec
from pipeline.errors import HostUnfit
from pipeline.files import OutputRefused, fsync_dir, open_regular, sha256_and_size_of
from worker.core.aws import aws_error_text

log = structlog.get_logger(__name__)

CHECK_NAME = "base model"
LOCK_NAME = ".lock"
TEMP_PREFIX = ".tmp-"
_CHUNK = 1024 * 1024
# How often a worker waiting for another's fetch tries the lock again (and hears a stop request).
LOCK_POLL_S = 0.5
# ---------------------------------------------------------------- sources


class Source(Protocol):
    """Where a base's files come from: ``open`` yields a readable stream of one declared file."""

    def describe(self) -> str: ...

    def open(self, file: BaseModelFile) -> contextlib.AbstractContextManager[Any]: ...


class S3Source:
    """Files under ``s3://bucket/prefix``, read with an injected boto3 client; botocore's errors end here."""

    def __init__(self, s3: Any, location: str):
        self._s3 = s3
        self._bucket, _, prefix = location[len("s3://"):].partition("/")
        self._prefix = prefix.strip("/")

    def describe(self) -> str:
        return f"s3://{self._bucket}/{self._prefix}" if self._prefix else f"s3://{self._bucket}"

    def key(self, file: BaseModelFile) -> str:
        return f"{self._prefix}/{file.path}" if self._prefix else file.path

    @contextlib.contextmanager
    def open(self, file: BaseModelFile) -> Iterator[Any]:
        key = self.key(file)
        try:
            response = self._s3.get_object(Bucket=self._bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            raise HostUnfit(CHECK_NAME, f"s3://{self._bucket}/{key}: {aws_error_text(exc)}") from None
        body = response["Body"]
        try:
            length = response.get("ContentLength")
            if isinstance(length, int) and length != file.size:
                raise HostUnfit(CHECK_NAME, f"{file.path}: the object has {length} bytes, the config "
                                            f"declares {file.size}")
            yield _TranslatedBody(body, f"s3://{self._bucket}/{key}")
        finally:
            body.close()


class _TranslatedBody:
    """A streaming body whose read errors (a reset connection mid-file) become ``HostUnfit``."""

    def __init__(self, body: Any, shown: str):
        self._body, self._shown = body, shown

    def read(self, size: int) -> bytes:
        try:
            return self._body.read(size)
        except (BotoCoreError, OSError) as exc:
            raise HostUnfit(CHECK_NAME, f"{self._shown}: read failed ({type(exc).__name__}: {exc})") from None


class LocalSource:
    """Files under a local directory (an image's layer, a mounted volume), none reached through a link."""

    def __init__(self, location: str):
        self._root = Path(location)

    def describe(self) -> str:
        return str(self._root)

    @contextlib.contextmanager
    def open(self, file: BaseModelFile) -> Iterator[Any]:
        # The location itself is the operator's to choose (it may be a link); below it, no link.
        root = Path(os.path.realpath(self._root))
        try:
            fd = open_regular(root, file.path)
        except OutputRefused as exc:
            raise HostUnfit(CHECK_NAME, f"{root / file.path}: {exc}") from None
        except OSError as exc:
            raise HostUnfit(CHECK_NAME, f"{root / file.path}: {exc.strerror or exc}") from None
        with os.fdopen(fd, "rb") as handle:
            yield handle


def source_for(spec: BaseModelSpec, s3: Any | None) -> Source:
    if spec.location.startswith("s3://"):
        if s3 is None:
            raise HostUnfit(CHECK_NAME, f"{spec.location}: no S3 client to fetch it with")
        return S3Source(s3, spec.location)
    return LocalSource(spec.location)


# ---------------------------------------------------------------- the cache


@dataclass(frozen=True)
class Ensured:
    """A published, verified entry: its directory, and whether this call fetched it."""

    directory: Path
    fetched: bool


class BaseModelCache:
    """The host's content-addressed cache of base models under ``root``, shared by its workers."""

    def __init__(self, root: Path, *, wait: Callable[[float], None] = time.sleep):
        self.root = Path(root)
        # Between lock attempts; the daemon's raises once a stop is requested, ending the start-up.
        self._wait = wait

    def entry(self, spec: BaseModelSpec) -> Path:
        return self.root / spec.digest_hex

    def ensure(self, spec: BaseModelSpec, source: Source) -> Ensured:
        """The spec's entry, published and verified, fetching it first when absent; ``HostUnfit`` otherwise."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HostUnfit(CHECK_NAME, f"BASE_MODEL_CACHE_DIR {self.root}: {exc.strerror or exc}") from None
        entry = self.entry(spec)
        if not entry.exists():
            with self._locked(spec):
                # Another worker of the host may have published it while this one waited.
                if not entry.exists():
                    self._fetch(spec, source, entry)
                    return Ensured(entry, fetched=True)
        self.verify(spec, entry)
        return Ensured(entry, fetched=False)

    def verify(self, spec: BaseModelSpec, entry: Path) -> None:
        """Every declared file of a published entry is there, a regular file, of its size and digest.

        Read in full at every start: a cache entry damaged on disk would otherwise train every job of the
        host from wrong weights. Entries are never repaired in place (another worker's stage may be
        reading one): an operator removes a damaged one, and the next start fetches it again."""
        for file in spec.files:
            try:
                fd = open_regular(entry, file.path)
            except (OutputRefused, OSError) as exc:
                raise HostUnfit(CHECK_NAME, f"cached {entry / file.path}: {exc}; remove {entry} to fetch "
                                            "it again") from None
            with os.fdopen(fd, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                digest = sha256_and_size_of(handle)[0] if size == file.size else None
            if size != file.size or digest != file.sha256:
                raise HostUnfit(CHECK_NAME, f"cached {entry / file.path} does not match the config "
                                            f"(size or sha256); remove {entry} to fetch it again")

    @contextlib.contextmanager
    def _locked(self, spec: BaseModelSpec) -> Iterator[None]:
        try:
            fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o660)
        except OSError as exc:
            raise HostUnfit(CHECK_NAME, f"lock {self.root / LOCK_NAME}: {exc.strerror or exc}") from None
        try:
            waiting = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise HostUnfit(CHECK_NAME, f"lock {self.root / LOCK_NAME}: {exc.strerror}") from None
                if not waiting:
                    log.info("base_model.waiting", reason="another worker of this host is fetching",
                             digest=spec.digest_hex)
                    waiting = True
                self._wait(LOCK_POLL_S)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _fetch(self, spec: BaseModelSpec, source: Source, entry: Path) -> None:
        """Fetch into a temp directory, verify, then rename it to ``entry``. Called holding the lock."""
        try:
            self._remove_stale_temps()
        except OSError as exc:
            raise HostUnfit(CHECK_NAME, f"BASE_MODEL_CACHE_DIR {self.root}: {exc.strerror or exc}") from None
        log.info("base_model.fetching", name=spec.name, source=source.describe(), digest=spec.digest_hex,
                 files=len(spec.files), bytes=spec.total_bytes)
        try:
            temp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{spec.digest_hex}-", dir=self.root))
        except OSError as exc:
            raise HostUnfit(CHECK_NAME, f"BASE_MODEL_CACHE_DIR {self.root}: {exc.strerror or exc}") from None
        try:
            for file in spec.files:
                _fetch_file(source, file, temp)
            _seal(temp)
            os.rename(temp, entry)
            fsync_dir(self.root, strict=True)
        except BaseException as exc:
            _remove_tree(temp)
            if isinstance(exc, OSError):
                raise HostUnfit(CHECK_NAME, f"writing {self.root}: {exc.strerror or exc}") from None
            raise
        log.info("base_model.fetched", name=spec.name, digest=spec.digest_hex, directory=str(entry))

    def _remove_stale_temps(self) -> None:
        # Only the lock holder makes temp directories, so any left now are a crashed fetch's.
        for child in self.root.iterdir():
            if child.name.startswith(TEMP_PREFIX):
                _remove_tree(child)


def _fetch_file(source: Source, file: BaseModelFile, temp: Path) -> None:
    """One declared file into ``temp``, refused past its declared size or on a wrong digest."""
    target = temp.joinpath(*file.path.split("/"))
    target.parent.mkdir(parents=True, exist_ok=True)
    digest, written = hashlib.sha256(), 0
    with source.open(file) as stream, open(target, "xb") as out:
        # One byte past what is left: a file larger than declared shows at once, and is never written whole.
        while chunk := stream.read(min(_CHUNK, file.size - written + 1)):
            written += len(chunk)
            if written > file.size:
                raise HostUnfit(CHECK_NAME, f"{file.path}: larger than the {file.size} bytes the config declares")
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if written != file.size:
        raise HostUnfit(CHECK_NAME, f"{file.path}: {written} bytes, the config declares {file.size}")
    if digest.hexdigest() != file.sha256:
        raise HostUnfit(CHECK_NAME, f"{file.path}: its SHA-256 is not the one the config declares")


def _seal(temp: Path) -> None:
    """Make the fetched tree read-only and durable before it is published."""
    for current, dirs, names in os.walk(temp, topdown=False):
        for name in names:
            os.chmod(os.path.join(current, name), 0o444)
        for name in dirs:
            path = os.path.join(current, name)
            fsync_dir(Path(path), strict=True)
            os.chmod(path, 0o555)
    fsync_dir(temp, strict=True)
    # The entry's own directory stays writable by its owner until it is renamed (a directory's rename
    # to a new parent needs it); it holds no file a stage could change in place.


def _remove_tree(path: Path) -> None:
    """Remove a temp tree, sealed (read-only) parts included; never through a link (``os.walk`` does not
    follow them, and ``rmtree`` removes a link itself)."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for current, dirs, _names in os.walk(path):
        for name in dirs:
            child = os.path.join(current, name)
            if not os.path.islink(child):  # chmod would follow a link to what it points at
                with contextlib.suppress(OSError):
                    os.chmod(child, 0o700)
    shutil.rmtree(path, ignore_errors=True)
