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
                                                 workers (pipeline/base_model_cache.py)

A retry takes the downloads of the job's earlier attempts (moved, ``pipeline.reuse``), then trims
them to what it may still adopt stage by stage (``trim_earlier_attempts``), and removes them once its
last stage has adopted what it could (``remove_attempt_dirs``): a job holds one attempt's files, and
its earlier ones only until its stages no longer need them. A job that ended (committed, cancelled,
refused, dead-lettered) is emptied but for ``logs/`` (``remove_work_files``), and ``prune_stage_logs``
removes what ended jobs left once it is old or their logs together exceed a bound.

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

from pipeline.errors import HostCondition, StageFailed
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
            raise HostCondition(f"WORK_ROOT {self.path} {problem}: no job files are written there until "
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


# --- what a retry leaves of the job's earlier attempts


# What a retry may still take from an earlier attempt once its downloads were taken: each stage's
# verified outputs and checkpoints, read stage by stage (pipeline.run). Its dataset and anything else
# is never read again.
ADOPTABLE_LATER = (OUTPUT_DIR, CHECKPOINTS_DIR)


def trim_earlier_attempts(earlier: Iterable[Path]) -> list[str]:
    """Remove from each earlier attempt directory all but ``ADOPTABLE_LATER``; one line per entry left."""
    failures: list[str] = []
    for attempt in earlier:
        if attempt.is_dir() and not attempt.is_symlink():
            failures += [f"{attempt.name}/{line}" for line in
                         _remove_entries(e for e in _entries(attempt) if e.name not in ADOPTABLE_LATER)]
    return failures


def remove_attempt_dirs(earlier: Iterable[Path]) -> list[str]:
    """Remove earlier attempt directories whole, once nothing more is taken from them; one line per
    attempt left behind. A link is removed, never followed."""
    return _remove_entries(list(earlier))


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


# --- the work root over months: pruning what ended jobs left, and how much is there


# Nothing touched this recently is removed: a job dir this new may be a redelivery starting right now.
PRUNE_MIN_AGE_S = 3600.0


@dataclass(frozen=True)
class JobDirUsage:
    """One job directory on disk: its size, its newest change, and whether its job ended (no attempts/)."""

    path: Path
    bytes: int
    newest_s: float
    ended: bool


def job_dirs(work_root: Path) -> list[Path]:
    """``<environment>/<directoryName>/<jobId>`` directories under ``work_root``; dot names (the models,
    the base model cache) and links are never entered."""
    found = []
    for environment in _entries(work_root):
        if environment.name.startswith(".") or not _real_dir(environment):
            continue
        for directory in _entries(environment):
            if _real_dir(directory):
                found += [job for job in _entries(directory) if _real_dir(job)]
    return found


def job_dir_usage(job_dir: Path) -> JobDirUsage:
    """Sizes and times of what ``job_dir`` holds, read without following a link."""
    total, newest = 0, _mtime(job_dir)
    for root, dirs, files in os.walk(job_dir):  # os.walk follows no link to a directory by default
        for name in dirs + files:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            newest = max(newest, info.st_mtime)
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return JobDirUsage(job_dir, total, newest, ended=not (job_dir / ATTEMPTS_DIR).exists())


def prune_decisions(jobs: Iterable[JobDirUsage], now_s: float, max_age_s: float, max_bytes: int,
                    min_age_s: float = PRUNE_MIN_AGE_S) -> list[Path]:
    """The job directories to remove whole: any not changed for ``max_age_s`` (0: none by age), then,
    oldest first, ended ones while the ended ones left hold more than ``max_bytes`` (0: no bound).
    Never one changed within ``min_age_s``."""
    settled = [job for job in jobs if now_s - job.newest_s >= min_age_s]
    doomed = [job for job in settled if max_age_s > 0 and now_s - job.newest_s >= max_age_s]
    if max_bytes > 0:
        kept_ended = sorted((job for job in jobs if job.ended and job not in doomed), key=lambda j: j.newest_s)
        total = sum(job.bytes for job in kept_ended)
        for job in kept_ended:
            if total <= max_bytes:
                break
            if job in settled:
                doomed.append(job)
                total -= job.bytes
    return [job.path for job in doomed]


def prune_work_root(work_root: Path, now_s: float, max_age_s: float, max_bytes: int,
                    models_root: Path | None = None) -> tuple[list[Path], list[str]]:
    """Remove the job directories ``prune_decisions`` names (none inside or holding ``models_root``),
    and the parents they leave empty; (the directories removed, one line per entry left behind)."""
    models = Path(models_root).resolve() if models_root is not None else None
    doomed = [path for path in prune_decisions([job_dir_usage(job) for job in job_dirs(work_root)], now_s,
                                               max_age_s, max_bytes)
              if models is None or not _overlaps(path, models)]
    failures = _remove_entries(doomed)
    for path in doomed:
        for parent in (path.parent, path.parent.parent):
            _remove_entries([parent], empty_dirs_only=True)
    return doomed, failures


@dataclass(frozen=True)
class WorkRootUsage:
    bytes: int
    jobs: int
    ended_jobs: int
    free_bytes: int


def work_root_usage(work_root: Path) -> WorkRootUsage:
    """What the job directories under ``work_root`` hold, and the file system's free space."""
    usages = [job_dir_usage(job) for job in job_dirs(work_root)]
    try:
        info = os.statvfs(work_root)
        free = info.f_bavail * info.f_frsize
    except OSError:
        free = 0
    return WorkRootUsage(sum(u.bytes for u in usages), len(usages), sum(u.ended for u in usages), free)


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _mtime(path: Path) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0
