"""The pipeline's base model: pinned in the config (``[base_model]``), fetched once per host into a
content-addressed cache, verified byte for byte, and handed to the stages as ``{base_model_dir}``.

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
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from pipeline.errors import HostUnfit
from pipeline.files import OutputRefused, open_regular
from worker.core.names import is_sha256_hex

log = structlog.get_logger(__name__)

CHECK_NAME = "base model"
LOCK_NAME = ".lock"
TEMP_PREFIX = ".tmp-"
_CHUNK = 1024 * 1024
# How often a worker waiting for another's fetch tries the lock again (and hears a stop request).
LOCK_POLL_S = 0.5
# A path component of a file the base declares: plain ASCII, never "." or ".." or a hidden name (which
# also keeps a declared file from meeting the cache's own dot names).
_PART = re.compile(r"[A-Za-z0-9_+=@-][A-Za-z0-9._+=@-]{0,254}", re.ASCII)
_MAX_DEPTH = 16
MAX_FILES = 10_000
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", re.ASCII)
_KEYS = frozenset({"name", "location", "licence", "files"})
_FILE_KEYS = frozenset({"path", "size", "sha256"})


@dataclass(frozen=True)
class BaseModelFile:
    path: str  # validated: relative, plain components, no "..", at most _MAX_DEPTH deep
    size: int
    sha256: str  # lower-case hex


@dataclass(frozen=True)
class BaseModelIdentity:
    """What a job was trained from: the base's name, the digest of its file list, and its licence.

    A value the handler's config can carry and the records can store as it is (``as_record``)."""

    name: str
    digest: str  # "sha256:<hex>", the cache entry's name with its algorithm
    licence: str

    def as_record(self) -> dict[str, str]:
        return {"name": self.name, "digest": self.digest, "licence": self.licence}


@dataclass(frozen=True)
class BaseModelSpec:
    """The ``[base_model]`` table, validated."""

    name: str
    location: str  # "s3://bucket/prefix" or an absolute local directory
    licence: str
    files: tuple[BaseModelFile, ...]  # sorted by path

    @property
    def digest_hex(self) -> str:
        """The SHA-256 over the file list (see the module's docstring): the cache entry's name."""
        listing = [{"path": f.path, "sha256": f.sha256, "size": f.size}
                   for f in sorted(self.files, key=lambda f: f.path)]
        canonical = json.dumps(listing, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()

    @property
    def identity(self) -> BaseModelIdentity:
        return BaseModelIdentity(name=self.name, digest=f"sha256:{self.digest_hex}", licence=self.licence)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


# ---------------------------------------------------------------- the config table


def parse_base_model(raw: Any, problems: list[str]) -> BaseModelSpec | None:
    """The ``[base_model]`` table, or None (absent, or with problems, each appended as one line)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        problems.append("base_model must be a table")
        return None
    before = len(problems)
    for key in sorted(set(raw) - _KEYS):
        problems.append(f"base_model: unknown key {key!r}")
    name, licence, location = raw.get("name"), raw.get("licence"), raw.get("location")
    for key, value in (("name", name), ("licence", licence)):
        if not isinstance(value, str) or not value.strip() or len(value) > 200 or not value.isprintable():
            problems.append(f"base_model.{key}: must be a non-empty line of text (at most 200 characters)")
    if not isinstance(location, str) or (why := location_problem(location)):
        problems.append(f"base_model.location: {why if isinstance(location, str) else 'must be a string'}")
    files = _parse_files(raw.get("files"), problems)
    if isinstance(location, str) and not location.startswith("s3://") and len(problems) == before:
        for file in files:
            if why := _linked_component(Path(location), file.path):
                problems.append(f"base_model.files: {file.path!r} {why}")
    if len(problems) > before:
        return None
    assert isinstance(name, str) and isinstance(licence, str) and isinstance(location, str)
    return BaseModelSpec(name=name, location=location, licence=licence, files=tuple(files))


def location_problem(location: str) -> str | None:
    """Why ``location`` is neither ``s3://bucket[/prefix]`` nor an absolute local directory, or None."""
    if location.startswith("s3://"):
        bucket, _, prefix = location[len("s3://"):].partition("/")
        if not _BUCKET.fullmatch(bucket):
            return f"{location!r} names no valid bucket (s3://bucket/prefix)"
        if not prefix.isprintable() or "//" in prefix or any(p in (".", "..") for p in prefix.split("/")):
            return f"{location!r} has a prefix with an empty, '.' or '..' part, or an unprintable character"
        return None
    if "\x00" in location or not os.path.isabs(location):
        return f"{location!r} is neither s3://bucket/prefix nor an absolute directory"
    return None


def file_path_problem(path: object) -> str | None:
    """Why ``path`` is not a file a base may declare: relative, plain components, no ``..``."""
    if not isinstance(path, str) or not path:
        return "must be a non-empty relative path"
    if path.startswith("/"):
        return "is absolute; it must be relative to the location"
    parts = path.split("/")
    if ".." in parts:
        return "escapes the location ('..')"
    if len(parts) > _MAX_DEPTH or not all(_PART.fullmatch(part) for part in parts):
        return (f"is not a plain relative path (ASCII letters, digits and ._+=@- per component, none "
                f"starting with a dot, at most {_MAX_DEPTH} deep)")
    return None


def _parse_files(raw: Any, problems: list[str]) -> list[BaseModelFile]:
    if not isinstance(raw, list) or not raw:
        problems.append("base_model.files: must be a non-empty array of {path, size, sha256}")
        return []
    if len(raw) > MAX_FILES:
        problems.append(f"base_model.files: {len(raw)} files, more than {MAX_FILES}")
        return []
    files: dict[str, BaseModelFile] = {}
    for index, entry in enumerate(raw):
        label = f"base_model.files[{index}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{label}: must be a table {{path, size, sha256}}")
            continue
        if unknown := sorted(set(entry) - _FILE_KEYS):
            problems.append(f"{label}: unknown keys {', '.join(map(repr, unknown))}")
        path, size, digest = entry.get("path"), entry.get("size"), entry.get("sha256")
        if why := file_path_problem(path):
            problems.append(f"{label}: path {str(path)[:80]!r} {why}")
            continue
        assert isinstance(path, str)
        if type(size) is not int or size < 0:
            problems.append(f"{label}: size must be a whole number of bytes, 0 or more")
        elif not is_sha256_hex(digest):
            problems.append(f"{label}: sha256 must be 64 lower-case hex digits")
        elif path in files:
            problems.append(f"{label}: {path!r} is listed twice")
        else:
            files[path] = BaseModelFile(path=path, size=size, sha256=digest)
    # A file cannot also be a directory another file lies in.
    for path in files:
        parents = PurePosixPath(path).parents
        if clash := next((str(p) for p in parents if str(p) in files), None):
            problems.append(f"base_model.files: {clash!r} is a file, so {path!r} cannot lie below it")
    return [files[path] for path in sorted(files)]


def _linked_component(root: Path, rel: str) -> str | None:
    """Why ``root/rel`` cannot be read without following a link, when that can be told now (a location
    that is not there yet is the fetch's to report)."""
    current = Path(os.path.realpath(root))
    for part in rel.split("/"):
        current = current / part
        try:
            info = os.lstat(current)
        except OSError:
            return None
        if stat.S_ISLNK(info.st_mode):
            return f"is reached through a symbolic link ({current}); the base's files must be real files"
    return None


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
            raise HostUnfit(CHECK_NAME, f"s3://{self._bucket}/{key}: {_aws_text(exc)}") from None
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


def _aws_text(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code')}: {error.get('Message')}"
    return f"{type(exc).__name__}: {exc}"


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
                digest = _sha256(handle) if size == file.size else None
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
            _fsync_dir(self.root)
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
            _fsync_dir(Path(path))
            os.chmod(path, 0o555)
    _fsync_dir(temp)
    # The entry's own directory stays writable by its owner until it is renamed (a directory's rename
    # to a new parent needs it); it holds no file a stage could change in place.


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _sha256(handle) -> str:
    digest = hashlib.sha256()
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()
