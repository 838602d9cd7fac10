"""Where a job's files live: every directory name and every layout function, in one place.

    $WORK_ROOT/                                  WorkRoot: written only while it is the directory the
    |                                            worker's first job found (same device and inode)
    +-- <environment>/<directoryName>/<jobId>/   the job directory                  work_dir_for
    |   +-- logs/                                LOGS_DIR: every attempt's step logs, timestamped; the
    |   |                                        one entry the post-commit cleanup keeps
    |   +-- attempts/                            ATTEMPTS_DIR
    |       +-- <attempt id>/                    <number, 4 digits>-<first 8 hex of the claim token>
    |           |                                attempt_dir_name, attempt_dir_for; its siblings are
    |           |                                the job's earlier attempts          earlier_attempts
    |           +-- downloads/00000.audio ...    DOWNLOADS_DIR: named by index       download_path
    |           +-- dataset/                     DATASET_DIR
    |           +-- output/                      OUTPUT_DIR: the stages' outputs, the artifacts and
    |           |                                .manifests/ (pipeline.config.MANIFEST_DIR_NAME)
    |           +-- checkpoints/<stage>/         CHECKPOINTS_DIR
    +-- .models/                                 DEFAULT_MODELS_DIR: MODELS_ROOT when unset
    |   +-- <environment>/<directoryName>/<jobId>/                                  models_dir_for
    |       +-- <sha256>/<path under output/>    a published artifact  published_path, published_rel
    +-- .base-models/                            BASE_MODEL_CACHE_DIR_NAME: BASE_MODEL_CACHE_DIR when
        +-- <digest>/<path>                      unset; the host's verified base models, shared by its
                                                 workers (pipeline/base_model.py)

``work_layout`` maps an attempt directory to its step directories (a directory outside attempts/ is
a lone job directory: tests and benchmarks, logs inside it, no earlier attempts). After the commit
``remove_work_files`` empties the job directory except ``logs/`` and ``remove_unpublished`` removes
what of the job's models directory no committed path lies in. Every name below a root is built from
validated names only (``worker.core.names``); a name starting with a dot is never an environment
name, so the models tree cannot meet a job directory.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath
from typing import Protocol

from pipeline.errors import StageFailed
from pipeline.reuse import attempt_order
from worker.core.errors import InvalidMessage

ATTEMPTS_DIR = "attempts"
LOGS_DIR = "logs"
DOWNLOADS_DIR = "downloads"
DATASET_DIR = "dataset"
OUTPUT_DIR = "output"
CHECKPOINTS_DIR = "checkpoints"
# MODELS_ROOT unless set: below WORK_ROOT, under a name no environment can have.
DEFAULT_MODELS_DIR = ".models"
# BASE_MODEL_CACHE_DIR unless set: below WORK_ROOT, under a name no environment can have.
BASE_MODEL_CACHE_DIR_NAME = ".base-models"


class JobPlace(Protocol):
    """The validated names that place a job's directories (``worker.voice.message.Job``)."""

    @property
    def environment(self) -> str: ...

    @property
    def directory_name(self) -> str: ...

    @property
    def job_id(self) -> str: ...


# --- the job's directories


def work_dir_for(work_root: Path, job: JobPlace) -> Path:
    """``$WORK_ROOT/<environment>/<directoryName>/<jobId>``: built only from validated names."""
    return _below(work_root, job, "work directory", "WORK_ROOT")


def models_dir_for(models_root: Path, job: JobPlace) -> Path:
    """``$MODELS_ROOT/<environment>/<directoryName>/<jobId>``: built only from validated names."""
    return _below(models_root, job, "models directory", "MODELS_ROOT")


def _below(root: Path, job: JobPlace, what: str, root_name: str) -> Path:
    root = Path(root).resolve()
    path = (root / job.environment / job.directory_name / job.job_id).resolve()
    if root not in path.parents:
        raise InvalidMessage(f"{what} {path} escapes {root_name}")
    return path


def default_models_root(work_root: Path | str) -> Path:
    """MODELS_ROOT when it is not set: ``<WORK_ROOT>/.models``."""
    return Path(work_root) / DEFAULT_MODELS_DIR


def attempt_dir_name(attempt_number: int, token: str) -> str:
    """``<attempt number, 4 digits>-<first 8 hex of the claim token>``: unique per claim, sorts by number.
    What names an attempt's directory and its mirror in S3 (``pipeline.remote_work``)."""
    return f"{attempt_number:04d}-{token[:8]}"


def attempt_dir_for(job_dir: Path, attempt_number: int, token: str) -> Path:
    return job_dir / ATTEMPTS_DIR / attempt_dir_name(attempt_number, token)


# --- an attempt's directories


@dataclass(frozen=True)
class WorkLayout:
    """The step directories of an attempt directory (or a lone job directory), and where logs go."""

    downloads: Path
    dataset: Path
    output: Path
    checkpoints: Path
    logs: Path

    def directories(self) -> tuple[Path, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


def work_layout(work_dir: Path) -> WorkLayout:
    return WorkLayout(
        downloads=work_dir / DOWNLOADS_DIR,
        dataset=work_dir / DATASET_DIR,
        output=work_dir / OUTPUT_DIR,
        checkpoints=work_dir / CHECKPOINTS_DIR,
        logs=job_dir_of(work_dir) / LOGS_DIR,
    )


def job_dir_of(work_dir: Path) -> Path:
    """The job directory an attempt directory belongs to; a lone job directory is its own."""
    return work_dir.parent.parent if is_attempt_dir(work_dir) else work_dir


def is_attempt_dir(work_dir: Path) -> bool:
    return work_dir.parent.name == ATTEMPTS_DIR


def earlier_attempts(work_dir: Path) -> list[Path]:
    """The job's other attempt directories, newest first; none for a lone job directory."""
    if not is_attempt_dir(work_dir) or not work_dir.parent.is_dir():
        return []
    others = [entry for entry in work_dir.parent.iterdir()
              if entry != work_dir and entry.is_dir() and not entry.is_symlink()]
    return sorted(others, key=lambda entry: attempt_order(entry.name), reverse=True)


def download_path(downloads_dir: Path, index: int) -> Path:
    # Named by index only: nothing from the URL reaches the file system.
    return downloads_dir / f"{index:05d}.audio"


# --- the published models


def published_path(models_dir: Path, sha256_hex: str, rel: str) -> Path:
    """``<models dir>/<sha256>/<rel>``, where ``rel`` is the artifact's path under output/."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or any(p in ("..", ".") for p in parts):
        raise ValueError(f"artifact path must be relative and stay below its directory: {rel!r}")
    return models_dir / sha256_hex / Path(*parts)


def published_rel(models_dir: Path, path: Path) -> str | None:
    """The artifact's relative path when ``path`` is a published file of ``models_dir``, else None."""
    try:
        parts = Path(path).relative_to(models_dir).parts
    except ValueError:
        return None
    return "/".join(parts[1:]) if len(parts) >= 2 else None


# --- WORK_ROOT itself


class WorkRoot:
    """WORK_ROOT, written only while it is the directory this worker's first job found.

    After an unmount the path names the directory under the mount point (or nothing, and the
    pipeline would create it): another disk, one no other host sees and none meant to fill up.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        # (device, inode) as the first job found it; None until then.
        self._identity: tuple[int, int] | None = None

    def check(self) -> None:
        """StageFailed unless job files may go into WORK_ROOT now (the first call makes it)."""
        if self._identity is None:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StageFailed(f"cannot create WORK_ROOT {self.path}: {exc.strerror or exc}") from exc
            self._identity = directory_identity(self.path)
            return
        problem = work_root_problem(self._identity, directory_identity(self.path))
        if problem is not None:
            raise StageFailed(f"WORK_ROOT {self.path} {problem}: no job files are written there until "
                              "it is back; a new file system there is used after a restart of the worker")


def directory_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the directory at ``path`` (links followed), or None when there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISDIR(info.st_mode) else None


def work_root_problem(first: tuple[int, int] | None, now: tuple[int, int] | None) -> str | None:
    """Why WORK_ROOT is no longer the directory the worker first worked in, or None while it is."""
    if first is None or now == first:
        return None
    if now is None:
        return "is gone (removed, or its file system unmounted)"
    return "is another directory than the one this worker started with (unmounted, remounted or replaced)"


# --- removal after the commit


def remove_work_files(work_dir: Path, models_root: Path | None = None) -> list[str]:
    """Delete everything in ``work_dir`` except its logs/ directory; one line per entry left behind.

    The attempts/ directory is emptied attempt by attempt, entry by entry, so one failure never
    keeps the rest. An entry inside ``models_root`` or holding it is never removed: published models
    outlive scratch. A symbolic link is removed, never followed.
    """
    models = Path(models_root).resolve() if models_root is not None else None
    failures: list[str] = []
    for entry in _entries(work_dir):
        is_dir = entry.is_dir() and not entry.is_symlink()  # a link is removed, never followed
        if (is_dir and entry.name == LOGS_DIR) or (models is not None and _overlaps(entry, models)):
            continue
        if is_dir and entry.name == ATTEMPTS_DIR:
            for attempt in _entries(entry):
                if attempt.is_dir() and not attempt.is_symlink():
                    failures += [f"{attempt.name}/{line}" for line in _remove_entries(_entries(attempt))]
                failures += _remove_entries([attempt], empty_dirs_only=True)
            failures += _remove_entries([entry], empty_dirs_only=True)
        else:
            failures += _remove_entries([entry])
    return failures


def unpublished_leftovers(models_dir: Path, model_paths: Iterable[str]) -> list[Path]:
    """Entries of a job's models directory that no committed model path lies in: the digests a stale or
    failed attempt published (and their temp files), which nothing will ever name."""
    keep = {Path(path).relative_to(models_dir).parts[0] for path in model_paths
            if models_dir in Path(path).parents}
    return [entry for entry in _entries(models_dir) if entry.name not in keep]


def remove_unpublished(models_dir: Path, model_paths: Iterable[str]) -> list[str]:
    """Remove the ``unpublished_leftovers``; one line per entry left behind."""
    return _remove_entries(unpublished_leftovers(models_dir, model_paths))


def _remove_entries(entries: Iterable[Path], *, empty_dirs_only: bool = False) -> list[str]:
    failures = []
    for entry in entries:
        is_dir = entry.is_dir() and not entry.is_symlink()
        try:
            if is_dir and empty_dirs_only:
                if not any(entry.iterdir()):
                    entry.rmdir()
            elif is_dir:
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as exc:
            failures.append(f"{entry.name}: {exc.strerror or exc}")
    return failures


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() and not directory.is_symlink() else []


def _overlaps(entry: Path, models: Path) -> bool:
    where = entry.parent.resolve() / entry.name  # the entry itself unresolved: a link is not followed
    return where == models or where in models.parents or models in where.parents
