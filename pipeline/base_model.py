"""The pipeline's base model as the config pins it (``[base_model]``): its files, each with its size and
SHA-256, its identity (name, digest, licence), parsed and checked at config load.

The config names the files, so what a stage starts from is fixed by the config alone, whatever the
``location`` (an ``s3://bucket/prefix`` or a local directory) serves. The digest that names the base
(``BaseModelSpec.digest``) is the SHA-256 of the canonical JSON of that file list sorted by path, each
file ``{"path", "sha256", "size"}`` (keys sorted, no spaces). The name, location and licence are not
part of it: the same bytes from another mirror are the same base, and two configs that pin the same
files share one cache entry.

Pure and light (the standard library only): the config parser imports it, and so does every process
that reads a pipeline config, the dataset child included. The host's cache of the files, which talks
to S3 and logs, is ``pipeline.base_model_cache``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from worker.core.names import is_sha256_hex

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
