"""Whether a failed attempt failed for its host rather than for its job: small pure decisions.

A host fault is a device gone (a stage's exit 70) or a work file system that is full, over its quota,
read-only, failing (EIO) or gone while a job runs. Retrying the job on this host would fail again,
and recording each such attempt as the job's failure lets five bad hosts dead-letter a healthy job,
so the handler releases the job to another host instead and this host leaves service.

A job can fill a disk by itself (recordings larger than the host's disk): the rule that keeps that
from passing as a host fault forever is ``host_fault_verdict``: a job is released for host faults at
most ``max_releases`` times (counted on its record, ``hostFaults``); the next fault is the job's own
failure, recorded and retried as any other, and the host stays in service.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path

from pipeline.errors import HostCondition

# The errnos that say the work file system, not the job, is at fault; ENOENT only counts through
# WorkRoot (a missing file is too often the job's own).
DISK_ERRNOS = {
    errno.ENOSPC: "full",
    errno.EDQUOT: "over its quota",
    errno.EROFS: "read-only",
    errno.EIO: "failing (I/O error)",
}
# How far down an exception's causes and contexts the search goes: the chains the pipeline builds are
# two or three deep, and a cycle must not loop.
_CHAIN_DEPTH = 8
# Released as host faults at most this many times (HOST_FAULT_MAX_RELEASES): then a fault is the job's.
DEFAULT_MAX_RELEASES = 2


class Verdict(StrEnum):
    RELEASE = "release"  # the host's fault: release the job, take the host out of service
    JOBS_OWN = "jobs_own"  # released often enough: the job's own failure, the host stays


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < _CHAIN_DEPTH:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def host_fault_of(exc: BaseException) -> str | None:
    """Why ``exc`` is the host's fault (one line), or None when nothing says it is: a ``HostCondition``
    anywhere in its chain, or an ``OSError`` whose errno names a disk fault."""
    for link in _chain(exc):
        if isinstance(link, HostCondition):
            return str(link).splitlines()[0] if str(link) else type(link).__name__
        if isinstance(link, OSError) and link.errno in DISK_ERRNOS:
            return f"the work file system is {DISK_ERRNOS[link.errno]} ({link.strerror or link})"
    return None


def work_fs_fault(work_root: Path, min_free_bytes: int) -> str | None:
    """Why the work file system cannot take job files now (gone, read-only, below ``min_free_bytes``
    free), or None: asked after a stage failed for no stated reason, as a trainer that met a full
    disk exits with its own code."""
    try:
        usage = os.statvfs(work_root)
    except OSError as exc:
        return f"WORK_ROOT {work_root} cannot be read ({exc.strerror or exc})"
    return fs_usage_fault(usage.f_bavail * usage.f_frsize, bool(usage.f_flag & os.ST_RDONLY), min_free_bytes)


def fs_usage_fault(free_bytes: int, read_only: bool, min_free_bytes: int) -> str | None:
    if read_only:
        return "the work file system is read-only"
    if free_bytes < min_free_bytes:
        return f"the work file system has {free_bytes} bytes free, below WORK_MIN_FREE_BYTES={min_free_bytes}"
    return None


def host_fault_verdict(released_before: int, max_releases: int) -> Verdict:
    """A job released for host faults ``released_before`` times: released once more while under
    ``max_releases``, else its own failure (see the module docstring)."""
    return Verdict.RELEASE if released_before < max_releases else Verdict.JOBS_OWN


def host_faults_of(document: object) -> int:
    """The record's ``hostFaults`` count; 0 when absent or not a count (another writer's)."""
    value = document.get("hostFaults") if isinstance(document, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
