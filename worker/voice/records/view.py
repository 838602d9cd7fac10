"""The tolerant reading of the records: any job or profile document as a typed record with its
problems, never an exception (``worker.voice.records.models`` holds the models and their field types).

The operator commands render only from these readings, each invalid field as ``?`` with a warning;
the handler dead-letters, before its claim, a job whose records hold a malformed field it decides on
(``unworkable``: the strict part of the reading) instead of failing deeper in with an error it would
retry.
"""

from __future__ import annotations

import re

from worker.voice.records.models import (
    JOB_STATUSES,
    PROFILE_STATUSES,
    RECORD,
    HistoryEntry,
    JobRecord,
    Lease,
    Note,
    Problem,
    ProfileRecord,
    Progress,
    RecordedError,
    in_utc,
    read_job,
    read_profile,
    shown,
)
from worker.voice.records.rules import FAILED_ATTEMPTS, FINAL_STATUSES

__all__ = ["JOB_STATUSES", "PROFILE_STATUSES", "RECORD", "HistoryEntry", "JobRecord", "JobView", "Lease", "Note",
           "Problem", "ProfileRecord", "ProfileView", "Progress", "RecordedError", "in_utc", "job_view",
           "profile_view", "shown", "unworkable"]

# What the commands draw from: the typed records themselves.
JobView = JobRecord
ProfileView = ProfileRecord


def job_view(doc: object) -> JobRecord:
    """Any value (a stored document, a record already read) as a job record. Never raises."""
    return doc if isinstance(doc, JobRecord) else read_job(doc)


def profile_view(doc: object) -> ProfileRecord:
    """Any value as a profile record. Never raises."""
    return doc if isinstance(doc, ProfileRecord) else read_profile(doc)


# What the handler reads from a job record to decide (complete already? failed before? whose lease,
# still live? cancel requested?) and what its claim and error writes compute from. The status is not
# among them: a value it does not know is not final, so a claim replaces it, as it always has.
_WORKER_JOB_FIELDS = frozenset({RECORD, "attempts", FAILED_ATTEMPTS, "cancelRequested", "lease",
                                "lease.expiresAt", "history", "history[]", "error", "error.retryable"})
# A job in a final status is only acknowledged, never claimed or written: of the job, only what is
# read before the claim counts (its error: is this a permanently failed message?).
_FINAL_JOB_FIELDS = frozenset({RECORD, "error"})
# And from the profile: whether the job is complete, and which published files a retry may reuse.
_WORKER_PROFILE_FIELDS = frozenset({RECORD, "modelPaths", "s3Paths"})


def unworkable(job: object, profile: object) -> list[str]:
    """The problems of these records that the worker cannot work past, one line each ("job attempts:
    ..."); none for a record that is missing. A time no store can write back counts wherever it is,
    unless the job is final (nothing will be written)."""
    if job is None:
        return []
    view = job_view(job)
    final = view.status in FINAL_STATUSES
    job_fields = _FINAL_JOB_FIELDS if final else _WORKER_JOB_FIELDS
    lines = [f"job {p}" for p in view.problems
             if (p.unwritable and not final) or re.sub(r"\[\d+\]", "[]", p.field) in job_fields]
    if profile is not None:
        lines += [f"profile {p}" for p in profile_view(profile).problems
                  if (p.unwritable and not final) or p.field.split(".")[0] in _WORKER_PROFILE_FIELDS]
    return lines
