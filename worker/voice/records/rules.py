"""The pure rules both stores share: what a record looks like, who may change it, and into what.

Each store decides with the same small functions here (is this job claimable? does this token hold
it? what does the record look like after a claim?) and enforces the same conditions again inside its
own atomic conditional write, so the two implementations cannot drift apart in what they allow.
Stored documents are plain dicts with DESIGN.md's camelCase field names, ``_id`` as ``str`` and
timezone-aware UTC datetimes truncated to milliseconds (what MongoDB keeps), so both stores hold
identical records. The fences and the changes a swap makes work on those documents, so a write keeps
every field it does not change, whoever stored it; what the worker decides from a record it read
(complete? failed how often? what did it cost? which mirrors are vouched for?) is decided on the
typed records of ``worker.voice.records.models``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from pipeline.config import REQUIRED_ARTIFACTS
from worker.core.errors import InvalidMessage
from worker.core.redact import redact_text
from worker.voice.records.models import (
    CANCELLED,
    COMPLETED,
    ERROR,
    PENDING,
    PROCESSING,
    REFUSED,
    JobRecord,
    ProfileRecord,
    read_job,
)


class ClaimOutcome(StrEnum):
    """What a claim found (``Claim.outcome``): the job is ours now, or why not."""

    CLAIMED = "claimed"
    HELD = "held"  # another attempt's lease is live
    COMPLETED = COMPLETED  # a final status: nothing left to do
    CANCELLED = CANCELLED
    REFUSED = REFUSED
    MISSING = "missing"  # no job record (yet)


# No claim, error or cancel request ever moves a job out of these.
FINAL_STATUSES = (COMPLETED, CANCELLED, REFUSED)
HISTORY_LIMIT = 20
# A record is not a log file: an unbounded message (a stage's whole stderr) must not bloat it.
ERROR_MESSAGE_MAX_CHARS = 2000
# The profile's per-job claim tokens (see holds_profile_claim), and the field they replaced.
CLAIMS, LEGACY_CLAIM_TOKEN = "claims", "claimToken"
# Distinct jobs whose claims a profile keeps: a job is fenced out only after this many other jobs of
# its profile were claimed since its own claim, far beyond any real re-train overlap.
CLAIMS_KEPT = 20
# The progress stage an attempt writes (fenced) just before it persists; no stage can be named so.
COMMITTING = "(committing)"
# The job record's list of the artifact keys its commit wrote, set with the commit marker (completed):
# what is_complete judges the profile's paths against, so a config that grows the set later leaves
# the jobs completed before it complete.
ARTIFACTS = "artifacts"
# Attempts that ended in a recorded retryable failure: what MAX_FAILED_ATTEMPTS is counted against.
# A release (shutdown, drain, lease handover) or a crash that recorded nothing never adds to it.
FAILED_ATTEMPTS = "failedAttempts"
# Releases because the host failed the attempt (its GPU gone, its work file system full or gone): no
# failure, no retry spent; the history entry ends HOST_FAULT with its HOST_FAULT_REASON, and the count
# (kept here: the history is trimmed) bounds how often a job may pass a fault as the host's
# (pipeline.host_faults.host_fault_verdict).
HOST_FAULTS, HOST_FAULT, HOST_FAULT_REASON = "hostFaults", "host_fault", "hostFault"
# Trainer-stage wall time (GPU-seconds): each history entry carries its attempt's, kept up by the
# attempt's own fenced writes; entries dropped by HISTORY_LIMIT are folded into these job totals.
GPU_SECONDS, EARLIER_GPU_SECONDS, EARLIER_WASTED_GPU_SECONDS = (
    "gpuSeconds", "earlierGpuSeconds", "earlierWastedGpuSeconds")
# An attempt's history entry: what it mirrored to S3, by item, as the SHA-256 of the listing or manifest
# it wrote there (with_mirror); the only thing a restore from the mirror believes.
MIRROR = "mirror"
# The job's metric series ({stage: {name: [[step, value], ...]}}, worker.voice.records.training) and the
# device a history entry's trainer stages ran on (what its gpuSeconds are seconds of).
METRICS, DEVICE = "metrics", "device"
# An attempt's history entry: its stages' NOTE lines (what they left out of the data, say), the last few.
NOTES, NOTES_KEPT, NOTE_MAX_CHARS = "notes", 10, 500
# The evaluation's figures (worker.voice.quality builds them): on the job record (with_quality, fenced
# on the attempt's token; kept by a refusal) and on the profile at the commit.
QUALITY = "quality"
# What the trainers' data preparation kept and left out, and why (with_dataset, fenced like the quality).
DATASET = "dataset"
# The base model a job's stages started from (pipeline.base_model.BaseModelIdentity.as_record()).
BASE_MODEL = "baseModel"
_HEX_TOKEN = re.compile(r"[0-9a-f]{8,64}")


def utc_now() -> datetime:
    return datetime.now(UTC)


def to_ms(moment: datetime) -> datetime:
    """Aware UTC at millisecond precision, the resolution MongoDB stores."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    moment = moment.astimezone(UTC)
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


def committed_artifacts(job: JobRecord | None) -> tuple[str, ...]:
    """The artifact keys the job's commit wrote (its record's ``artifacts``); ``REQUIRED_ARTIFACTS`` for a
    job committed before records kept them, and for a value another writer left that is no list of names."""
    return (job.artifacts if job is not None else None) or REQUIRED_ARTIFACTS


def is_complete(job: JobRecord | None, profile: ProfileRecord | None) -> bool:
    """Both records status 'completed' and the profile holds a non-empty ``modelPaths`` and ``s3Paths``
    entry for every artifact the job committed (``committed_artifacts``): not the current config's set,
    which may have grown since."""
    if job is None or profile is None:
        return False
    if job.status != COMPLETED or profile.status != COMPLETED:
        return False
    keys = committed_artifacts(job)
    return all(paths.get(key) for paths in (profile.model_paths, profile.s3_paths) for key in keys)



# ---------------------------------------------------------------- decisions (pure)

def failed_attempts(job: JobRecord | None) -> int:
    """The job's attempts that ended in a recorded retryable failure (0 on records made before the count,
    and on a count another writer left that is no count: the error written over it replaces it)."""
    return (job.failed_attempts if job is not None else None) or 0


def lease_live(job: dict, now: datetime) -> bool:
    lease = job.get("lease")
    expires_at = lease.get("expiresAt") if isinstance(lease, dict) else None
    try:
        return isinstance(expires_at, datetime) and expires_at > now
    except TypeError:
        return False  # a naive time: another writer's, never a claim's, so no attempt holds it


def holds_lease(job: dict, token: str) -> bool:
    """The fence of every write made during an attempt: our token, and the job still being worked."""
    lease = job.get("lease")
    return job.get("status") == PROCESSING and isinstance(lease, dict) and lease.get("token") == token


def claim_refusal(job: dict | None, now: datetime) -> ClaimOutcome | None:
    """Why a claim cannot take this job now, or None when it can."""
    if job is None:
        return ClaimOutcome.MISSING
    if job.get("status") in FINAL_STATUSES:
        return ClaimOutcome(job["status"])
    if lease_live(job, now):
        return ClaimOutcome.HELD
    return None


def may_record_error(job: dict, token: str | None, now: datetime) -> bool:
    if job.get("status") in FINAL_STATUSES:
        return False
    if token is not None:
        return holds_lease(job, token)
    # An error found before any claim must not trample an attempt that is alive elsewhere.
    return not lease_live(job, now)


def committing(job: dict, now: datetime) -> bool:
    """A live attempt has begun persisting (its COMMITTING stage is newer than its claim): too late to cancel."""
    progress, started = job.get("progress"), job.get("startedAt")
    progress = progress if isinstance(progress, dict) else {}  # another writer's: no attempt wrote it
    stamped = progress.get("updatedAt")
    try:
        return (job.get("status") == PROCESSING and lease_live(job, now) and progress.get("stage") == COMMITTING
                and isinstance(started, datetime) and isinstance(stamped, datetime) and stamped >= started)
    except TypeError:
        return False  # a naive time: another writer's, not the committing stage an attempt wrote


def may_request_cancel(job: dict, now: datetime) -> bool:
    # Refused once committing: the attempt no longer reads the flag, so accepting it would be a lie.
    return job.get("status") not in FINAL_STATUSES and not committing(job, now)


def close_attempt(history: list[dict] | None, outcome: str, now: datetime, token: str | None = None) -> list[dict]:
    """Close the newest history entry if it is still running (and is ``token``'s, when given).

    A record without a history (None) has nothing to close: the result is a new, empty list.
    """
    # Another writer's history that is no list, or an entry that is no document, holds no attempt to
    # close: dropped, so the write that closes the attempt (an error, above all) can still be made.
    history = [dict(entry) for entry in (history if isinstance(history, list) else []) if isinstance(entry, dict)]
    if history and history[-1].get("outcome") == "running":
        if token is None or history[-1].get("token") == token:
            history[-1].update(end=now, outcome=outcome)
    return history


def with_history(job: dict, history: list[dict]) -> dict:
    """``job`` with ``history`` as its history, cut to the last ``HISTORY_LIMIT`` entries: the GPU-seconds
    of the entries cut are folded into the job's totals, so ``usage`` is the same before and after.

    The one place a history is trimmed: every write that appends an entry goes through it."""
    dropped, kept = history[:-HISTORY_LIMIT], history[-HISTORY_LIMIT:]
    if not dropped:
        return {**job, "history": kept}
    earlier = usage(read_job({"history": dropped}))
    return {
        **job,
        EARLIER_GPU_SECONDS: _seconds(job.get(EARLIER_GPU_SECONDS)) + earlier["gpuSeconds"],
        EARLIER_WASTED_GPU_SECONDS: _seconds(job.get(EARLIER_WASTED_GPU_SECONDS)) + earlier["wastedGpuSeconds"],
        "history": kept,
    }


def claimed(job: dict, *, owner: str, token: str, lease_s: float, now: datetime,
            message_id: str | None = None) -> dict:
    # A "running" entry left behind is an attempt that died without saying so.
    history = close_attempt(job.get("history"), "abandoned", now)
    number = int(job.get("attempts") or 0) + 1
    # The attempt's number beside its token: together they name its work (its directory, its mirror in
    # S3), so a later attempt restores only what an attempt of this record wrote (see with_mirror).
    history.append({"worker": owner, "token": token, "attempt": number, "start": now, "end": None,
                    "outcome": "running"})
    return {
        **with_history(job, history),
        "status": PROCESSING,
        # messageId tells a second delivery of this same message (our SQS lease lapsed) from a
        # duplicate message for the job (ours is still alive).
        "lease": {"owner": owner, "token": token, "expiresAt": to_ms(now + timedelta(seconds=lease_s)),
                  "messageId": message_id},
        "heartbeatAt": now,
        "startedAt": now,
        "attempts": number,
    }


def usage(job: JobRecord | None) -> dict[str, float]:
    """GPU-seconds of the job's attempts, in all and wasted, with the attempt count (``JobRecord.usage``)."""
    return job.usage() if job is not None else {"attempts": 0, "gpuSeconds": 0.0, "wastedGpuSeconds": 0.0}


def _seconds(value: object) -> float:
    # A record written before these fields, or edited by hand, still reads (as no time).
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def with_gpu_seconds(job: dict, token: str, gpu_seconds: float | None) -> dict:
    """The attempt's trainer time so far on its own history entry (none: unchanged)."""
    history = job.get("history") or []
    last = history[-1] if isinstance(history, list) and history else None
    if gpu_seconds is None or not isinstance(last, dict) or last.get("token") != token:
        return job
    entry = {**last, GPU_SECONDS: round(max(0.0, float(gpu_seconds)), 3)}
    return {**job, "history": [*history[:-1], entry]}


def with_mirror(job: dict, token: str, item: str, sha256_hex: str) -> dict:
    """The attempt's own history entry vouching that it mirrored ``item`` (``checkpoints/<stage>``,
    ``output/<stage>``) as the object whose bytes hash to ``sha256_hex``; unchanged when the newest
    entry is not ``token``'s. Written fenced on the token: only the store says what a restore may
    believe, never an object in the mirror's own prefix, which every worker role can write."""
    history = job.get("history") or []
    if not history or history[-1].get("token") != token:
        return job
    entry = history[-1]
    mirror = entry.get(MIRROR) if isinstance(entry.get(MIRROR), dict) else {}
    entry = {**entry, MIRROR: {**mirror, item: sha256_hex}}
    return {**job, "history": [*history[:-1], entry]}


def with_note(job: dict, token: str, stage: str, text: str) -> dict:
    """The attempt's own history entry keeping a stage's note (redacted, at most ``NOTE_MAX_CHARS``),
    the last ``NOTES_KEPT`` of them; unchanged when the newest entry is not ``token``'s."""
    history = job.get("history") or []
    if not history or not isinstance(history[-1], dict) or history[-1].get("token") != token:
        return job
    entry = history[-1]
    notes = [n for n in entry.get(NOTES) or [] if isinstance(n, dict)] if isinstance(entry.get(NOTES), list) else []
    note = {"stage": str(stage)[:NOTE_MAX_CHARS], "text": redact_text(str(text))[:NOTE_MAX_CHARS]}
    entry = {**entry, NOTES: [*notes, note][-NOTES_KEPT:]}
    return {**job, "history": [*history[:-1], entry]}


def vouched_mirrors(job: JobRecord | None, own_token: str) -> list[tuple[int, str, dict[str, str]]]:
    """(attempt number, claim token, {item: sha256}) of every other attempt in the record that vouched
    for a mirror, newest first. Entries of any other shape (a record edited by hand, written before
    attempt numbers) vouch for nothing: the model reads their number as None and their mirror as empty."""
    found = []
    for entry in job.history if job is not None else ():
        if (entry is None or entry.attempt is None or entry.token is None or entry.token == own_token
                or not _HEX_TOKEN.fullmatch(entry.token) or not entry.mirror):
            continue
        found.append((entry.attempt, entry.token, dict(entry.mirror)))
    return sorted(found, key=lambda found_entry: found_entry[0], reverse=True)


def renewed(job: dict, lease_s: float, now: datetime, *, token: str = "", gpu_seconds: float | None = None) -> dict:
    lease = {**job["lease"], "expiresAt": to_ms(now + timedelta(seconds=lease_s))}
    return with_gpu_seconds({**job, "lease": lease, "heartbeatAt": now}, token, gpu_seconds)


def with_progress(job: dict, stage: str, percent: float, now: datetime, *, token: str = "",
                  gpu_seconds: float | None = None, detail: Mapping[str, Any] | None = None,
                  series: Mapping[str, list] | None = None) -> dict:
    """The job's ``progress``: the stage and percent, and what ``detail`` adds (``ProgressReporter.
    detail``: step, stageIndex, stageCount, overallPercent, etaS, latest; its stage's elapsed seconds
    become ``stageStartedAt`` on the store's clock, and its device goes onto the attempt's own history
    entry, where the cost's unit is read). ``series``: the stage's metric series, replacing that
    stage's under ``metrics`` (the other stages' stay: a retry that skips a stage keeps its curve)."""
    progress: dict[str, Any] = {"stage": stage, "percent": float(percent), "updatedAt": now}
    device = None
    for key, value in (detail or {}).items():
        if key == "stageElapsedS":
            progress["stageStartedAt"] = now - timedelta(seconds=float(value))
        elif key == "device":
            device = value
        elif value is not None:
            progress[key] = value
    job = {**job, "progress": progress}
    if series is not None:
        kept = job.get(METRICS)
        job[METRICS] = {**(kept if isinstance(kept, dict) else {}), stage: dict(series)}
    return with_device(with_gpu_seconds(job, token, gpu_seconds), token, device)


def with_device(job: dict, token: str, device: str | None) -> dict:
    """The device the attempt's trainer stages ran on, on its own history entry: "cuda" once any did
    (its trainer time is GPU time), else what they declared; unchanged without one or for another token."""
    history = job.get("history") or []
    last = history[-1] if isinstance(history, list) and history else None
    if device is None or not isinstance(last, dict) or last.get("token") != token:
        return job
    if last.get(DEVICE) == "cuda" or last.get(DEVICE) == device:
        return job
    return {**job, "history": [*history[:-1], {**last, DEVICE: device}]}


# On a job's error: the worker dead-lettered the job's message for spending its retries (``errored``).
RETRIES_SPENT = "retriesSpent"


def errored(job: dict, *, token: str | None, error_type: str, message: str, retryable: bool,
            now: datetime, retries_spent: bool = False) -> dict:
    """The job ``error``. ``retries_spent``: the attempt's retryable failure spent the job's last retry,
    so the worker dead-letters its message now: recorded as such at once (``retriesSpent``, not
    retryable), and it still counts as a failed attempt."""
    if retries_spent:
        retryable = False
    if token is not None:
        history = close_attempt(job.get("history"), "retry" if retryable else "error", now, token)
    else:
        history = close_attempt(job.get("history"), "abandoned", now)
    # Every recorded message is redacted here, whatever built it: a library's text may quote a secret.
    error = {"type": error_type, "message": redact_text(str(message))[:ERROR_MESSAGE_MAX_CHARS],
             "retryable": bool(retryable), "at": now}
    if token is not None and (job.get("lease") or {}).get("messageId"):
        # Which SQS message met this error: its own redelivery is told from a new message for the job.
        error["messageId"] = job["lease"]["messageId"]
    # Only an attempt's own retryable failure spends the retry budget: an error found outside any
    # attempt (no token) did not run the job, and a permanent one is dead-lettered anyway.
    if retries_spent:
        error[RETRIES_SPENT] = True
    failed = failed_attempts(read_job(job)) + (1 if token is not None and (retryable or retries_spent) else 0)
    return {**job, "status": ERROR, "error": error, "lease": None, "history": history,
            FAILED_ATTEMPTS: failed}


def completed(job: dict, token: str, now: datetime, gpu_seconds: float | None = None,
              artifacts: Sequence[str] | None = None) -> dict:
    """The commit marker; ``artifacts``: the keys the commit wrote to the profile (kept as ``ARTIFACTS``)."""
    history = close_attempt(with_gpu_seconds(job, token, gpu_seconds).get("history"), "completed", now, token)
    marked = {**job, "status": COMPLETED, "completedAt": now, "lease": None, "error": None, "history": history}
    if artifacts is not None:
        marked[ARTIFACTS] = list(artifacts)
    return marked


def with_dataset(job: dict, dataset: dict) -> dict:
    """The job with what data preparation kept and left out (worker.voice.prep_report.dataset_record)."""
    return {**job, DATASET: dict(dataset)}


def with_quality(job: dict, quality: dict) -> dict:
    """The job with the attempt's evaluation figures (``QUALITY``), replacing an earlier attempt's."""
    return {**job, QUALITY: dict(quality)}


def refused(job: dict, token: str, now: datetime, *, error_type: str, message: str, failed: Sequence[str],
            quality: dict | None) -> dict:
    """A final refusal (the quality gate): ``REFUSED``, the lease cleared, the attempt's entry closed
    ``refused``, and why in ``error`` (not retryable; ``failed``: one line per failed bar), with the
    figures. The retry budget is left alone: nothing failed."""
    history = close_attempt(job.get("history"), REFUSED, now, token)
    error = {"type": error_type, "message": redact_text(str(message))[:ERROR_MESSAGE_MAX_CHARS],
             "retryable": False, "at": now, "failed": [str(line)[:NOTE_MAX_CHARS] for line in failed][:20]}
    if (job.get("lease") or {}).get("messageId"):
        error["messageId"] = job["lease"]["messageId"]
    marked = {**job, "status": REFUSED, "refusedAt": now, "lease": None, "error": error, "history": history}
    if quality is not None:
        marked[QUALITY] = dict(quality)
    return marked


def cancelled(job: dict, token: str, now: datetime) -> dict:
    history = close_attempt(job.get("history"), "cancelled", now, token)
    return {**job, "status": CANCELLED, "lease": None, "history": history}


def released(job: dict, token: str, now: datetime) -> dict:
    # Status stays processing: the job is unfinished, and with no lease any worker may claim it now.
    history = close_attempt(job.get("history"), "released", now, token)
    return {**job, "lease": None, "history": history}


def released_for_host_fault(job: dict, token: str, now: datetime, reason: str) -> dict:
    """Released (status stays processing) because the host failed the attempt: the history entry ends
    ``host_fault`` and says why, and ``hostFaults`` counts the job's releases for host faults (what
    ``pipeline.host_faults.host_fault_verdict`` decides on; kept outside the history, which is trimmed)."""
    history = close_attempt(job.get("history"), HOST_FAULT, now, token)
    if history and history[-1].get("token") == token:
        history[-1][HOST_FAULT_REASON] = redact_text(str(reason))[:ERROR_MESSAGE_MAX_CHARS]
    count = job.get(HOST_FAULTS)
    count = count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0
    return {**job, "lease": None, "history": history, HOST_FAULTS: count + 1}


def cancel_requested(job: dict) -> dict:
    return {**job, "cancelRequested": True}


def clock_skew_problem(offset_s: float, max_skew_s: float) -> str | None:
    """Why a worker whose clock is ``offset_s`` behind the store's must not start, or None."""
    if abs(offset_s) <= max_skew_s:
        return None
    direction = "behind" if offset_s > 0 else "ahead of"
    return (f"this host's clock is {abs(offset_s):.1f} s {direction} the store's, more than "
            f"MAX_CLOCK_SKEW_SECONDS={max_skew_s:g}: fix its time sync (NTP/chrony) before starting")


def profile_claims(profile: dict | None) -> list[dict]:
    """The profile's ``claims``: one ``{jobId, token, epoch}`` per job that claimed it, newest claim last."""
    claims = (profile or {}).get(CLAIMS)
    if not isinstance(claims, list):
        return []
    return [dict(entry) for entry in claims if isinstance(entry, dict)]


def holds_profile_claim(profile: dict | None, job_id: str, token: str) -> bool:
    """The fence of a profile write: ``token`` is the newest claim of job ``job_id`` on this profile.

    Per job, not per profile: two jobs of one profile (a re-train while an earlier one runs) each
    hold their own entry, so neither fences the other out, while a job's own later claim replaces
    its entry and so fences out the attempt it took over.
    """
    return any(entry.get("jobId") == str(job_id) and entry.get("token") == token
               for entry in profile_claims(profile))


def may_stamp_claim(profile: dict | None, job_id: str, token: str, epoch: int) -> bool:
    """The fence of a claim's profile stamp: no newer claim of ``job_id`` is on the profile already.

    ``epoch`` is the job's ``attempts`` after this claim, assigned in the claim's job swap, so a
    claimer paused between its job swap and its stamp cannot overwrite the entry of the claim that
    took the job over from it. An entry without an epoch (written before epochs) never blocks a stamp.
    """
    for entry in profile_claims(profile):
        if entry.get("jobId") != str(job_id):
            continue
        held = entry.get("epoch")
        if isinstance(held, int) and (held > epoch or (held == epoch and entry.get("token") != token)):
            return False
    return True


def with_claim(claims: list[dict], job_id: str, token: str, epoch: int) -> list[dict]:
    """``claims`` with ``job_id``'s entry set to ``token`` at ``epoch`` and moved last.

    The oldest entries past the cap are dropped.
    """
    kept = [entry for entry in claims if entry.get("jobId") != str(job_id)]
    return [*kept, {"jobId": str(job_id), "token": token, "epoch": int(epoch)}][-CLAIMS_KEPT:]


def stamped_profile(profile: dict | None, profile_id: str, job_id: str, token: str,
                    now: datetime, epoch: int) -> dict:
    """The profile after a claim: this job's claim entry set to the new token, processing unless completed."""
    base = profile if profile is not None else new_profile_record({"_id": profile_id}, job_id, now)
    status = base.get("status") if base.get("status") == COMPLETED else PROCESSING
    # The single profile-wide token fenced concurrent jobs of one profile out of each other's writes.
    base = {key: value for key, value in base.items() if key != LEGACY_CLAIM_TOKEN}
    return {**base, "status": status, CLAIMS: with_claim(profile_claims(base), job_id, token, epoch),
            "jobId": str(job_id), "updatedAt": now}


def new_job_record(job: dict, idempotency_key: str | None, now: datetime) -> dict:
    """A fresh job: the caller's fields kept, the bookkeeping fields always start from zero."""
    return {
        **job,
        "_id": str(job["_id"]),
        "status": PENDING,
        "attempts": 0,
        FAILED_ATTEMPTS: 0,
        "lease": None,
        "progress": None,
        "heartbeatAt": None,
        "error": None,
        "history": [],
        "cancelRequested": False,
        "startedAt": None,
        "completedAt": None,
        "idempotencyKey": idempotency_key,
        "createdAt": now,
    }


def new_profile_record(profile: dict, job_id: str, now: datetime) -> dict:
    return {
        **profile,
        "_id": str(profile["_id"]),
        "status": PENDING,
        "modelPaths": dict(profile.get("modelPaths") or {}),
        "s3Paths": dict(profile.get("s3Paths") or {}),
        CLAIMS: [],
        "jobId": job_id,
        "updatedAt": now,
    }


def submission(job: dict, profile: dict) -> tuple[dict, dict]:
    """Check the caller's pair and link the job to its profile; returns copies."""
    problems = []
    if not job.get("_id"):
        problems.append("job _id is required (the caller generates it)")
    if not profile.get("_id"):
        problems.append("profile _id is required")
    job, profile = dict(job), dict(profile)
    if profile.get("_id"):
        job.setdefault("profileId", str(profile["_id"]))
        if str(job["profileId"]) != str(profile["_id"]):
            problems.append("job profileId does not match the profile's _id")
    if problems:
        raise InvalidMessage(problems)
    return job, profile
