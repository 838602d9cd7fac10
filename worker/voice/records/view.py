"""The one typed read boundary of the records: any job or profile document as a value to render and
decide on, never an exception.

The records live in MongoDB beside the product's backend, which writes them too, so a field may hold
anything. ``job_view`` and ``profile_view`` are total (any input, a document or not): each field that
holds what the worker would write is kept, typed; any other value becomes ``None`` (shown as ``?``)
with a ``Problem`` naming the field and what was wrong. The operator commands render only from these
views; the handler dead-letters, before its claim, a job whose records hold a malformed field it
decides on (``unworkable``) instead of failing deeper in with an error it would retry.

Self-contained on purpose (plain dataclasses, the rules' names and ``usage`` only): typed records at
every boundary are to replace it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from worker.voice.records.rules import (
    CANCELLED,
    COMPLETED,
    EARLIER_GPU_SECONDS,
    EARLIER_WASTED_GPU_SECONDS,
    ERROR,
    FAILED_ATTEMPTS,
    FINAL_STATUSES,
    GPU_SECONDS,
    NOTES,
    PENDING,
    PROCESSING,
    REFUSED,
    usage,
)

JOB_STATUSES = (PENDING, PROCESSING, COMPLETED, ERROR, CANCELLED, REFUSED)
PROFILE_STATUSES = (PENDING, PROCESSING, COMPLETED)
RECORD = "(the record)"  # a Problem's field when the document itself is not one
# Beyond any record the worker writes; deeper nesting is not searched for unwritable times.
_MAX_DEPTH = 32
_MAX_COUNT = 2**31
_MAX_SECONDS = 1e12  # some 30,000 years: a larger GPU time is no measurement
_SHOWN_CHARS = 40


@dataclass(frozen=True)
class Problem:
    """One field of a record that does not hold what the worker would have written there."""

    field: str  # "attempts", "progress.percent", "history[2].start", or RECORD
    what: str
    # A time no store can write back (outside the years 1-9999 once in UTC): every write of the
    # record would fail, so the worker cannot even record an error on it.
    unwritable: bool = False

    def __str__(self) -> str:
        return f"{self.field}: {self.what}"


@dataclass(frozen=True)
class LeaseView:
    owner: str | None = None
    token: str | None = None
    expires_at: datetime | None = None
    message_id: str | None = None


@dataclass(frozen=True)
class ProgressView:
    stage: str | None = None
    percent: float | None = None
    updated_at: datetime | None = None


@dataclass(frozen=True)
class ErrorView:
    type: str | None = None
    message: str | None = None
    retryable: bool | None = None
    at: datetime | None = None
    message_id: str | None = None
    dead_lettered: bool = False  # the reconciler recorded a DLQ message (``deadLetter``)


@dataclass(frozen=True)
class AttemptView:
    """One history entry."""

    worker: str | None = None
    start: datetime | None = None
    end: datetime | None = None
    outcome: str | None = None
    gpu_seconds: float | None = None
    notes: tuple[tuple[str, str], ...] = ()  # (stage, text): what its stages noted (rules.with_note)


@dataclass(frozen=True)
class _Fields:
    """What every view has: the problems found, and a way to ask about one field."""

    problems: tuple[Problem, ...] = ()

    def invalid(self, name: str) -> bool:
        """Whether ``name`` (or anything inside it) was not valid: render it as ``?``."""
        return any(p.field == name or p.field.startswith((f"{name}.", f"{name}[")) for p in self.problems)


@dataclass(frozen=True)
class JobView(_Fields):
    id: str | None = None
    profile_id: str | None = None
    status: str | None = None
    attempts: int | None = 0
    failed_attempts: int | None = 0
    lease: LeaseView | None = None
    progress: ProgressView | None = None
    error: ErrorView | None = None
    # None stands for an entry that is not a document: it still takes its number.
    history: tuple[AttemptView | None, ...] = ()
    cancel_requested: bool | None = False
    created_at: datetime | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    heartbeat_at: datetime | None = None
    earlier_gpu_seconds: float | None = 0.0
    earlier_wasted_gpu_seconds: float | None = 0.0

    def cost(self) -> dict[str, Any]:
        """``rules.usage`` of what is valid, with the failed attempts: unreadable counts are None."""
        entries = [{GPU_SECONDS: entry.gpu_seconds, "outcome": entry.outcome}
                   for entry in self.history if entry is not None]
        spent = usage({EARLIER_GPU_SECONDS: self.earlier_gpu_seconds,
                       EARLIER_WASTED_GPU_SECONDS: self.earlier_wasted_gpu_seconds, "history": entries})
        return {**spent, "attempts": self.attempts, "failedAttempts": self.failed_attempts}


@dataclass(frozen=True)
class ProfileView(_Fields):
    id: str | None = None
    status: str | None = None
    job_id: str | None = None
    model_paths: Mapping[str, str] = field(default_factory=dict)  # the entries that are paths
    s3_paths: Mapping[str, str] = field(default_factory=dict)
    updated_at: datetime | None = None


def job_view(doc: object) -> JobView:
    """Any value as a job record's view. Never raises."""
    read = _Reader()
    try:
        return _job(doc, read)
    except Exception as exc:  # noqa: BLE001 - a reader's bug must not make a record unshowable
        read.bad(RECORD, f"could not be read ({type(exc).__name__})")
        return JobView(problems=tuple(read.problems), status=None, attempts=None, failed_attempts=None)


def profile_view(doc: object) -> ProfileView:
    """Any value as a profile record's view. Never raises."""
    read = _Reader()
    try:
        return _profile(doc, read)
    except Exception as exc:  # noqa: BLE001 - a reader's bug must not make a record unshowable
        read.bad(RECORD, f"could not be read ({type(exc).__name__})")
        return ProfileView(problems=tuple(read.problems))


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


# ---------------------------------------------------------------- reading

def _job(doc: object, read: _Reader) -> JobView:
    if not isinstance(doc, dict):
        read.bad(RECORD, f"{shown(doc)}, not a document")
        return JobView(problems=tuple(read.problems), attempts=None, failed_attempts=None)
    status = doc.get("status")
    if status not in JOB_STATUSES:
        status = read.bad("status", f"{shown(status)}, not one of {', '.join(JOB_STATUSES)}")
    fields: dict[str, Any] = dict(
        id=read.ident(doc.get("_id"), "_id", required=True),
        profile_id=read.ident(doc.get("profileId"), "profileId"),
        status=status,
        attempts=read.count(doc.get("attempts"), "attempts"),
        failed_attempts=read.count(doc.get(FAILED_ATTEMPTS), FAILED_ATTEMPTS),
        lease=_lease(doc.get("lease"), read),
        progress=_progress(doc.get("progress"), read),
        error=_error(doc.get("error"), read),
        history=_history(doc.get("history"), read),
        cancel_requested=read.flag(doc.get("cancelRequested"), "cancelRequested", default=False),
        created_at=read.time(doc.get("createdAt"), "createdAt"),
        started_at=read.time(doc.get("startedAt"), "startedAt"),
        completed_at=read.time(doc.get("completedAt"), "completedAt"),
        heartbeat_at=read.time(doc.get("heartbeatAt"), "heartbeatAt"),
        earlier_gpu_seconds=read.seconds(doc.get(EARLIER_GPU_SECONDS), EARLIER_GPU_SECONDS),
        earlier_wasted_gpu_seconds=read.seconds(doc.get(EARLIER_WASTED_GPU_SECONDS), EARLIER_WASTED_GPU_SECONDS),
    )
    read.unwritable_times(doc)
    return JobView(problems=tuple(read.problems), **fields)


def _lease(value: object, read: _Reader) -> LeaseView | None:
    lease = read.document(value, "lease")
    if lease is None:
        return None
    return LeaseView(owner=read.text(lease.get("owner"), "lease.owner"),
                     token=read.text(lease.get("token"), "lease.token"),
                     expires_at=read.time(lease.get("expiresAt"), "lease.expiresAt", required=True),
                     message_id=read.text(lease.get("messageId"), "lease.messageId"))


def _progress(value: object, read: _Reader) -> ProgressView | None:
    progress = read.document(value, "progress")
    if progress is None:
        return None
    return ProgressView(stage=read.text(progress.get("stage"), "progress.stage", required=True),
                        percent=read.percent(progress.get("percent"), "progress.percent"),
                        updated_at=read.time(progress.get("updatedAt"), "progress.updatedAt", required=True))


def _error(value: object, read: _Reader) -> ErrorView | None:
    error = read.document(value, "error")
    if error is None:
        return None
    return ErrorView(type=read.text(error.get("type"), "error.type", required=True),
                     message=read.text(error.get("message"), "error.message"),
                     # Absent: unknown (shown as ?), and not permanent to the handler, as it has always read it.
                     retryable=read.flag(error.get("retryable"), "error.retryable", default=None),
                     at=read.time(error.get("at"), "error.at"),
                     message_id=read.text(error.get("messageId"), "error.messageId"),
                     dead_lettered="deadLetter" in error)


def _history(value: object, read: _Reader) -> tuple[AttemptView | None, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        read.bad("history", f"{shown(value)}, not a list")
        return ()
    entries: list[AttemptView | None] = []
    for number, item in enumerate(value):
        name = f"history[{number}]"
        entry = read.document(item, name)
        if entry is None:
            if item is None:
                read.bad(name, "null, not a document")
            entries.append(None)
            continue
        entries.append(AttemptView(worker=read.text(entry.get("worker"), f"{name}.worker"),
                                   start=read.time(entry.get("start"), f"{name}.start"),
                                   end=read.time(entry.get("end"), f"{name}.end"),
                                   outcome=read.text(entry.get("outcome"), f"{name}.outcome"),
                                   gpu_seconds=read.seconds(entry.get(GPU_SECONDS), f"{name}.{GPU_SECONDS}",
                                                            default=None),
                                   notes=_notes(entry.get(NOTES), f"{name}.{NOTES}", read)))
    return tuple(entries)


def _notes(value: object, name: str, read: _Reader) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        read.bad(name, f"{shown(value)}, not a list")
        return ()
    notes = []
    for number, item in enumerate(value):
        note = read.document(item, f"{name}[{number}]")
        if note is not None:
            notes.append((read.text(note.get("stage"), f"{name}[{number}].stage") or "?",
                          read.text(note.get("text"), f"{name}[{number}].text") or "?"))
    return tuple(notes)


def _profile(doc: object, read: _Reader) -> ProfileView:
    if not isinstance(doc, dict):
        read.bad(RECORD, f"{shown(doc)}, not a document")
        return ProfileView(problems=tuple(read.problems))
    status = doc.get("status")
    if status not in PROFILE_STATUSES:
        status = read.bad("status", f"{shown(status)}, not one of {', '.join(PROFILE_STATUSES)}")
    fields: dict[str, Any] = dict(
        id=read.ident(doc.get("_id"), "_id", required=True), status=status,
        job_id=read.ident(doc.get("jobId"), "jobId"),
        model_paths=read.paths(doc.get("modelPaths"), "modelPaths"),
        s3_paths=read.paths(doc.get("s3Paths"), "s3Paths"),
        updated_at=read.time(doc.get("updatedAt"), "updatedAt"))
    read.unwritable_times(doc)
    return ProfileView(problems=tuple(read.problems), **fields)


class _Reader:
    """Reads one field at a time: its value when valid, else None and one more ``problems`` entry."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def bad(self, name: str, what: str, *, unwritable: bool = False) -> Any:
        """Note the problem; None, the value of a field that is not valid."""
        self.problems.append(Problem(name, what, unwritable))
        return None

    def document(self, value: object, name: str) -> dict | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            return self.bad(name, f"{shown(value)}, not a document")
        return value

    def text(self, value: object, name: str, *, required: bool = False) -> str | None:
        if value is None:
            return self.bad(name, "missing") if required else None
        if not isinstance(value, str):
            return self.bad(name, f"{shown(value)}, not text")
        return value

    def ident(self, value: object, name: str, *, required: bool = False) -> str | None:
        # A whole number is a usable id too (another writer's choice), never a flag or a fraction.
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**64:
            return str(value)
        return self.text(value, name, required=required)

    def count(self, value: object, name: str) -> int | None:
        # Absent or null on records made before the field: none yet, as the rules read it.
        if value is None:
            return 0
        # A whole float is what a JavaScript writer's number can come back as.
        if (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < _MAX_COUNT
                and float(value).is_integer()):
            return int(value)
        return self.bad(name, f"{shown(value)}, not a count (a whole number from 0)")

    def seconds(self, value: object, name: str, *, default: float | None = 0.0) -> float | None:
        if value is None:
            return default
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < _MAX_SECONDS:
            return float(value)
        return self.bad(name, f"{shown(value)}, not a number of seconds")

    def percent(self, value: object, name: str) -> float | None:
        if value is None:
            return self.bad(name, "missing")
        # NaN fails the comparison, so it is refused with the rest.
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 100:
            return float(value)
        return self.bad(name, f"{shown(value)}, not a percentage (0-100)")

    def flag(self, value: object, name: str, *, default: bool | None, required: bool = False) -> bool | None:
        if value is None:
            return self.bad(name, "missing") if required else default
        if not isinstance(value, bool):
            # "false" as text would read as true: not guessed at.
            return self.bad(name, f"{shown(value)}, not true or false")
        return value

    def time(self, value: object, name: str, *, required: bool = False) -> datetime | None:
        if value is None:
            return self.bad(name, "missing") if required else None
        if not isinstance(value, datetime):
            return self.bad(name, f"{shown(value)}, not a time")
        return in_utc(value) or self.bad(name, f"{shown(value)}, outside the years 1-9999 in UTC", unwritable=True)

    def paths(self, value: object, name: str) -> dict[str, str]:
        paths = self.document(value, name) or {}
        kept = {}
        for key, path in paths.items():
            if isinstance(key, str) and isinstance(path, str):
                kept[key] = path
            elif path is not None:
                self.bad(f"{name}.{key}", f"{shown(path)}, not a path")
        return kept

    def unwritable_times(self, doc: dict) -> None:
        """Report every time anywhere in ``doc`` that no store could write back, once."""
        reported = {p.field for p in self.problems}
        for name, moment in _times(doc, "", 0):
            if name not in reported and in_utc(moment) is None:
                self.bad(name, f"{shown(moment)}, outside the years 1-9999 in UTC", unwritable=True)


def _times(value: object, path: str, depth: int):
    """(path, datetime) of each time inside ``value``, down to _MAX_DEPTH."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(value, datetime):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _times(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(value, list | tuple):
        for number, item in enumerate(value):
            yield from _times(item, f"{path}[{number}]", depth + 1)


def in_utc(moment: datetime) -> datetime | None:
    """``moment`` as aware UTC (a naive one is UTC already, as BSON means it), or None when it has
    no UTC form: year 1 at +05:00 is year 0 in UTC."""
    try:
        if moment.utcoffset() is None:
            return moment.replace(tzinfo=UTC)
        return moment.astimezone(UTC)
    except Exception:  # noqa: BLE001 - OverflowError for year 0, and whatever an odd tzinfo raises
        return None


def shown(value: object) -> str:
    """A short, safe account of a stored value for a problem's text: its kind, and the value when short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a flag ({str(value).lower()})"
    if isinstance(value, str):
        cut = value[:_SHOWN_CHARS]
        return f"text ({cut!r}{'…' if len(value) > _SHOWN_CHARS else ''})"
    if isinstance(value, int):
        # Python refuses to print an integer of more than 4,300 digits: only its size then.
        return f"a number ({value})" if value.bit_length() <= 64 else f"a number of {value.bit_length()} bits"
    if isinstance(value, float):
        return f"a number ({value!r})"
    if isinstance(value, datetime):
        return f"a time ({value.isoformat()})"
    if isinstance(value, dict):
        return f"a document of {len(value)} field(s)"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    return f"a {type(value).__name__}"
