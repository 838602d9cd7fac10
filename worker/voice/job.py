"""The voice-cloning job handler: everything between a received message and the decision to ack it.

    parse -> completion check -> claim (fenced lease) -> train -> persist in commit order -> return

Persisting, in this order, each step only after the previous one succeeded (first the progress
stage ``COMMITTING`` is written, after which the store refuses cancel requests):

    1 verify the five local files        (regular, non-empty, no symlink on the way)
    2 upload all five to S3              (content-addressed keys, never replacing an object; a matching
                                          object is reused; the claim proven before each object and part)
   2b publish all five under MODELS_ROOT (content-addressed, never replaced: worker.voice.publish)
    3 write local and S3 paths           (fenced on our claim token; local = the published files)
    4 mark the profile completed         (fenced)
    5 mark the job completed             (fenced: the commit marker)
    then delete the objects under the job's key prefix that the committed paths do not name

Returning tells the loop to delete the message; raising tells it to retry, dead-letter or release.
Every write after the claim carries the claim's token, so a worker whose lease was taken over can no
longer change anything: its writes match no record and raise ``StaleWrite``.

Three rules around that path:

* An attempt that learns it lost the job after uploading deletes what it wrote only once the job is
  committed and the committed paths do not name it (same bytes, same key: it may be the committed
  object). Both cleanups are best effort; a failure is logged, never a failed job.
* Each attempt works in a directory of its own, ``<job dir>/attempts/<attempt id>/`` (the attempt
  number and the start of the claim token), so a stale attempt never writes the new one's files; a
  retry copies what earlier attempts verified (``pipeline.reuse``). The logs are the job's.
* Once the commit marker is written, the job's work directory is emptied except its ``logs/``: every
  attempt's scratch goes (``keep_work_files`` keeps every file). The profile's ``modelPaths`` name
  the published copies under ``MODELS_ROOT``, which the cleanup never touches. A failed removal is
  logged, never a failed job. A crashed attempt keeps its files, so its retry still resumes from them.
* Job files are written only into the WORK_ROOT this worker's first job found (same device and
  inode): once it is gone or another directory (an unmount leaves the mount point's own directory
  on the disk below), every attempt fails retryably, until it is back or the worker restarts.
* A redelivery of the very message whose attempt failed permanently (the record says ``error``,
  not retryable, names this message id, and the message was received before) goes straight back to
  the DLQ: no claim, no work, no write. That is the message whose delete failed after it was
  dead-lettered. A new message for the job (a DLQ redrive's copy, a resubmit), or any message when
  the error names none (recorded before any claim), is worked on as before, and so is any message
  once the reconciler has recorded the job's dead letter (that record means the DLQ copy exists,
  so whatever arrives next is an operator's redrive).
* An attempt's recorded retryable failure adds one to the record's ``failedAttempts``; the one that
  brings it to ``MAX_FAILED_ATTEMPTS`` ends as ``RetriesExhausted`` (dead-lettered under its own error
  type), and a redelivery of that message counts as permanently failed (above). Releases (shutdown,
  drain, lease handover) and crashes record no failure, so they spend none of that budget.
* A message that does not parse or validate changes no record: its jobId is only a claim, and
  another message (the job's own) must not inherit its failure. It is dead-lettered with its own
  reason. So is a valid message whose profileId is not the job record's.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import structlog

from pipeline.manifest import recorded_outputs
from pipeline.remote_work import Ledger
from pipeline.run import ATTEMPTS_DIR, LOGS_DIR, OWN_STEPS, attempt_dir_name
from worker.core import tracing
from worker.core.config import DEFAULT_MAX_FAILED_ATTEMPTS
from worker.core.errors import (
    AlreadyFailed,
    InvalidMessage,
    JobBusy,
    LeaseLost,
    MalformedRecord,
    StageFailed,
    StaleWrite,
    Stopped,
    StoreError,
    TimeLimitExceeded,
    UnexpectedError,
    UnknownJob,
    WorkerError,
)
from worker.core.events import CANCELLED, COMPLETED, DEAD_LETTERED, FAILED, Events, NoEvents
from worker.core.faults import NEVER, CrashPoints
from worker.core.lease import Lease
from worker.core.loop import spend_retry
from worker.core.metrics import (
    COUNT,
    JOB_ATTEMPTS,
    JOB_GPU_SECONDS,
    JOB_WASTED_GPU_SECONDS,
    NULL_METRICS,
    SECONDS,
    WASTED_GPU_SECONDS,
    Metrics,
)
from worker.core.queue import Message
from worker.core.redact import redact_text
from worker.core.stop import StopSignal
from worker.voice.artifacts import (
    ArtifactUploader,
    artifact_key,
    job_key_prefix,
    stale_leftovers,
    unreferenced,
    verify_local,
)
from worker.voice.input_policy import InputPolicy
from worker.voice.message import Job, job_id_hint, parse_job
from worker.voice.mirror_ledger import RecordLedger
from worker.voice.publish import models_dir_for, publish_all, published_rel
from worker.voice.records import ClaimOutcome, Store
from worker.voice.records.attempt import Attempt, ProgressReporter, StoreLease
from worker.voice.records.rules import (
    ASSET_KEYS,
    COMMITTING,
    ERROR,
    ERROR_MESSAGE_MAX_CHARS,
    failed_attempts,
    is_complete,
    usage,
    utc_now,
)
from worker.voice.records.view import unworkable

if TYPE_CHECKING:
    from pipeline.run import Progress

log = structlog.get_logger(__name__)

# Frozen, so one shared default is safe: the policy a handler gets when none is configured.
DEFAULT_POLICY = InputPolicy()


class Trainer(Protocol):
    """What turns a claimed job into its five artifacts: ``pipeline.run.PipelineTrainer`` in production.

    A fake is anything with this call shape. ``progress(step, percent)`` writes the record's
    progress; ``stop`` is the attempt's own stop signal, to be honoured by every step; ``ledger`` is
    what the job record vouches for of the job's S3 mirror, and where the attempt vouches for its own
    (``worker.voice.mirror_ledger``).
    """

    def __call__(self, job: Job, work_dir: Path, stop: StopSignal, progress: Progress, ledger: Ledger,
                 /) -> dict[str, Path]: ...


OUTPUT_DIR = "output"  # the pipeline's artifact directory inside an attempt's work dir
# Below WORK_ROOT by default; a name starting with a dot is never an environment name (SAFE_NAME),
# so the models tree cannot meet a job's work directory.
DEFAULT_MODELS_DIR = ".models"


class Handled(StrEnum):
    """What the handler returns to acknowledge: logged by the loop, which counts COMPLETED and
    CANCELLED under their own metrics and the rest as skipped."""

    COMPLETED = "completed"
    CANCELLED = "cancelled"
    ALREADY_COMPLETE = "already_complete"
    DUPLICATE = "duplicate"


def unexpected(exc: Exception) -> UnexpectedError:
    return UnexpectedError(f"unexpected {type(exc).__name__}: {exc}"[:ERROR_MESSAGE_MAX_CHARS])


def work_dir_for(work_root: Path, job: Job) -> Path:
    """``$WORK_ROOT/<environment>/<directoryName>/<jobId>``: built only from validated names."""
    root = work_root.resolve()
    path = (root / job.environment / job.directory_name / job.job_id).resolve()
    if root not in path.parents:
        raise InvalidMessage(f"work directory {path} escapes WORK_ROOT")
    return path


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


def attempt_dir_for(job_dir: Path, attempt_number: int, token: str) -> Path:
    return job_dir / ATTEMPTS_DIR / attempt_dir_name(attempt_number, token)


def artifact_rels(paths: dict[str, Path], output_dir: Path, models_dir: Path) -> dict[str, str]:
    """Each artifact's path relative to the output directory, whether it lies there or is published."""
    rels = {}
    for name, path in paths.items():
        rel = published_rel(models_dir, path)
        rels[name] = rel if rel is not None else path.relative_to(output_dir).as_posix()
    return rels


def _artifacts_base(paths: dict[str, Path], output_dir: Path, models_dir: Path) -> Path:
    """The directory the five files lie in: MODELS_ROOT's job directory when all are published, else
    the attempt's output directory (where verification then finds any file that is not)."""
    if paths and all(published_rel(models_dir, Path(path)) is not None for path in paths.values()):
        return models_dir
    return output_dir


def recorded_failure(record: dict | None, message: Message,
                     max_failed_attempts: int | None = None) -> AlreadyFailed | None:
    """The permanent failure this message already met (see the module docstring), or None.

    A retryable error that brought the job's failed attempts to ``max_failed_attempts`` counts as
    permanent: its message was dead-lettered by the attempt that recorded it.
    """
    error = (record or {}).get("error") or {}
    spent = (error.get("retryable") is True and max_failed_attempts is not None
             and failed_attempts(record) >= max_failed_attempts)
    if (record or {}).get("status") != ERROR or (error.get("retryable") is not False and not spent):
        return None
    if "deadLetter" in error or message.receive_count < 2:
        return None
    if error.get("messageId") != message.message_id:
        # Another message for the job (a resubmit), or an error no message met (recorded before any
        # claim): this message has not failed, so it is worked on.
        return None
    return AlreadyFailed(str(error.get("type") or "PermanentError"), str(error.get("message") or ""))


def remove_work_files(work_dir: Path, models_root: Path | None = None) -> list[str]:
    """Delete everything in ``work_dir`` except its logs/ directory; one line per entry left behind.

    The attempts/ directory is emptied attempt by attempt, entry by entry, so one failure never
    keeps the rest. An entry inside ``models_root`` or holding it is never removed: published models
    outlive scratch.
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


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() and not directory.is_symlink() else []


def _remove_entries(entries: list[Path], *, empty_dirs_only: bool = False) -> list[str]:
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


def unpublished_leftovers(models_dir: Path, model_paths: Iterable[str]) -> list[Path]:
    """Entries of a job's models directory that no committed model path lies in: the digests a stale or
    failed attempt published (and their temp files), which nothing will ever name."""
    keep = {Path(path).relative_to(models_dir).parts[0] for path in model_paths
            if models_dir in Path(path).parents}
    return [entry for entry in _entries(models_dir) if entry.name not in keep]


def _overlaps(entry: Path, models: Path) -> bool:
    where = entry.parent.resolve() / entry.name  # the entry itself unresolved: a link is not followed
    return where == models or where in models.parents or models in where.parents


def reusable_paths(profile: dict | None, output_dir: Path) -> dict[str, Path] | None:
    """The profile's local model paths from an earlier attempt of this job, when all five verify on disk.

    ``output_dir`` is where they must lie: the job's published models directory.
    """
    stored = (profile or {}).get("modelPaths") or {}
    if not all(stored.get(k) for k in ASSET_KEYS):
        return None
    paths = {k: Path(stored[k]) for k in ASSET_KEYS}
    if not all(output_dir in p.parents for p in paths.values()):
        return None
    try:
        verify_local(output_dir, paths)
    except WorkerError:
        return None
    return paths


class VoiceJobHandler:
    def __init__(self, *, store: Store, uploader: ArtifactUploader, train: Trainer, work_root: Path,
                 s3_prefix: str, worker_id: str, lease_s: float, crash_points: CrashPoints = NEVER,
                 metrics: Metrics = NULL_METRICS, policy: InputPolicy = DEFAULT_POLICY,
                 keep_work_files: bool = False, models_root: Path | None = None,
                 max_failed_attempts: int = DEFAULT_MAX_FAILED_ATTEMPTS,
                 forget_remote_work: Callable[[Path], None] | None = None,
                 events: Events | None = None):
        self._store = store
        # Recorded retryable failures after which the job's message is dead-lettered (MAX_FAILED_ATTEMPTS).
        self._max_failed_attempts = max_failed_attempts
        # After the commit: the job's mirror in S3 (pipeline.remote_work), when attempts mirror their work.
        self._forget_remote_work = forget_remote_work
        self._events = events or NoEvents()
        # The default policy refuses every s3:// recording: a handler is never more open than asked.
        self._policy = policy
        self._keep_work_files = keep_work_files
        self._uploader = uploader
        self._train = train
        self._work_root = Path(work_root)
        self._models_root = Path(models_root) if models_root is not None else self._work_root / DEFAULT_MODELS_DIR
        self._s3_prefix = s3_prefix
        self._worker_id = worker_id
        # The record's lease lasts as long as the message's visibility: both lapse together.
        self._lease_s = lease_s
        self._crash = crash_points.reached
        self._metrics = metrics
        # WORK_ROOT's (device, inode) as the first job found it (``_check_work_root``).
        self._work_root_identity: tuple[int, int] | None = None

    def __call__(self, message: Message, lease: Lease) -> str:
        try:
            job = parse_job(message.body, self._policy)
        except InvalidMessage:
            # The body's jobId is only a claim: writing this failure on that job would make the job's
            # own valid message look already failed. The DLQ copy carries the reason; no record write.
            log.warning("job.invalid_message", named_job_id=job_id_hint(message.body),
                        note="dead-lettered with its own reason; no job record changed")
            raise
        structlog.contextvars.bind_contextvars(job_id=job.job_id)
        try:
            # The submitter's trace goes on here (worker.core.tracing; nothing while tracing is off).
            span_attributes: dict[str, str | int] = {"job.id": job.job_id, "messaging.message.id": message.message_id,
                                                     "receive_count": message.receive_count}
            with tracing.span("job", parent=tracing.extract(message.message_attributes), **span_attributes):
                return self._handle(job, message, lease)
        except WorkerError:
            raise
        except Exception as exc:
            # The adapter boundary for everything the job touches: a bug or an unforeseen library
            # error is retried (and reported), not a crash of the whole worker.
            raise unexpected(exc) from exc
        finally:
            structlog.contextvars.unbind_contextvars("job_id")

    def _handle(self, job: Job, message: Message, lease: Lease) -> str:
        store = self._store
        record, profile = store.get_job(job.job_id), store.get_profile(job.profile_id)
        self._refuse_malformed(job, record, profile)
        if record is not None and record.get("profileId") and str(record["profileId"]) != job.profile_id:
            # Writing this message's paths to another profile than the job's would corrupt both.
            raise InvalidMessage(f"profileId: the job record belongs to profile {record['profileId']}, "
                                 f"not {job.profile_id}")
        if is_complete(record, profile) and profile is not None:  # (is_complete implies the profile)
            log.info("job.already_complete", note="redelivery acknowledged without work")
            if str(profile.get("jobId")) == job.job_id:
                # The paths are this job's: redo the (idempotent) clean-ups a crash after the commit skipped.
                self._clean_up_after_commit(job, profile["s3Paths"], profile["modelPaths"].values())
            return Handled.ALREADY_COMPLETE
        failed = recorded_failure(record, message, self._max_failed_attempts)
        if failed is not None:
            log.warning("job.already_failed", error_type=failed.error_type,
                        note="redelivery of a permanently failed message: dead-lettered again without work")
            raise failed
        # A claim that fails after its job swap (the profile stamp, a lost reply) lets go of the job itself.
        # From here on only the Attempt it hands back holds the token.
        claim_sent_s = time.monotonic()
        with tracing.span("claim"):
            claim = store.claim(job.job_id, owner=self._worker_id, token=secrets.token_hex(16),
                                lease_s=self._lease_s, message_id=message.message_id)
        if claim.outcome == ClaimOutcome.MISSING:
            raise UnknownJob(f"no job record {job.job_id} (yet)")
        if claim.outcome in (ClaimOutcome.COMPLETED, ClaimOutcome.CANCELLED):
            log.info("job.nothing_to_do", status=claim.outcome)
            return Handled(claim.outcome)
        if claim.outcome == ClaimOutcome.HELD:
            return self._held(claim.job or {}, message, claim.now)
        log.info("job.claimed", attempt=(claim.job or {}).get("attempts"))
        attempt = claim.attempt
        if attempt is None:  # Store.claim's contract: a claimed outcome carries its Attempt
            raise StoreError("the store claimed the job but handed back no attempt")
        # An earlier attempt of this job wrote its published paths (commit step 3) and died: the profile
        # may already say completed, so a cancel is too late and this attempt finishes the commit.
        reused = self._published_earlier(job, profile)
        under_way = reused is not None
        store_lease = StoreLease(attempt, lease.stop, margin_s=lease.interval_s, claim_sent_s=claim_sent_s,
                                 honour_cancel=not under_way)
        lease.on_renew(store_lease.renew)
        if claim.cancel_requested and under_way:
            log.warning("job.cancel_too_late", note="an earlier attempt began the commit: finishing it")
        elif claim.cancel_requested:
            store_lease.end()
            attempt.cancel()
            log.info("job.cancelled", when="at claim")
            self._announce(CANCELLED, job, claim.job, attempt)
            return Handled.CANCELLED
        committed: tuple[dict[str, str], list[str]] | None = None
        try:
            # Inside the try: a work dir that escapes WORK_ROOT is this attempt's recorded failure.
            attempt_dir = attempt_dir_for(work_dir_for(self._work_root, job),
                                          int((claim.job or {}).get("attempts") or 0), attempt.token)
            paths = self._artifacts(job, reused, lease.stop, attempt, attempt_dir, RecordLedger(attempt, claim.job))
            with tracing.span("commit"):
                committed = self._persist(job, attempt, paths, lease, store_lease, attempt_dir)
        except Stopped as exc:
            store_lease.end()
            return self._stopped(job, claim.job, attempt, exc)
        except LeaseLost:
            raise  # not ours any more: write nothing
        except StaleWrite:
            # A fenced write refused (a profile claim replaced behind us) while the job lease may still
            # be ours: let go of it (fenced: a no-op if not ours) so the job need not wait for it to lapse.
            store_lease.end()
            self._release(attempt)
            raise
        except WorkerError as exc:
            store_lease.end()
            settled = self._failed(job, attempt, claim.job, exc)
            if settled is exc:
                raise
            raise settled from exc
        except Exception as exc:
            store_lease.end()
            raise self._failed(job, attempt, claim.job, unexpected(exc)) from exc
        finally:
            if committed is None:  # whatever ended the attempt short of its commit: time bought nothing
                self._metrics.seconds(WASTED_GPU_SECONDS, attempt.trainer_clock.seconds(), jobId=job.job_id)
        self._report_cost(claim.job, attempt, job.job_id)
        self._announce(COMPLETED, job, claim.job, attempt, s3Paths=committed[0])
        self._clean_up_after_commit(job, *committed)
        log.info("job.completed")
        return Handled.COMPLETED

    def _report_cost(self, claimed: dict | None, attempt: Attempt, job_id: str) -> None:
        """The job's GPU-seconds over all its attempts, and those wasted by the ones that did not commit."""
        earlier = usage(claimed)  # this attempt's own entry is still "running" there: counted below
        ours_s = attempt.trainer_clock.seconds()
        self._metrics.emit({JOB_GPU_SECONDS: (earlier["gpuSeconds"] + ours_s, SECONDS),
                            JOB_WASTED_GPU_SECONDS: (earlier["wastedGpuSeconds"], SECONDS),
                            JOB_ATTEMPTS: (earlier["attempts"], COUNT)}, jobId=job_id)
        log.info("job.cost", gpu_s=round(earlier["gpuSeconds"] + ours_s, 3),
                 wasted_gpu_s=earlier["wastedGpuSeconds"], attempts=earlier["attempts"])

    def _published_earlier(self, job: Job, profile: dict | None) -> dict[str, Path] | None:
        """The profile's published paths of this job when all five verify (an earlier attempt reached
        commit step 3), read once per claim: they decide both the cancel and whether to train."""
        try:
            return reusable_paths(profile, models_dir_for(self._models_root, job))
        except WorkerError:
            return None  # a models directory that escapes MODELS_ROOT fails in _persist, recorded

    # --- steps
    @staticmethod
    def _held(record: dict, message: Message, store_now: datetime | None) -> str:
        """Another worker holds a live lease on the job: is this delivery a duplicate, or its own message?"""
        holder = record.get("lease") or {}
        if holder.get("messageId") == message.message_id:
            # The holder's SQS lease on this very message lapsed, so SQS handed it to us. Deleting it
            # would leave the job with no message if the holder (which will stop) commits nothing.
            # Come back just after the holder's record lease ends, not after the generic backoff.
            expires_at = holder.get("expiresAt")
            # On the store's clock, which set expiresAt: this host's clock may be off.
            now = store_now or utc_now()
            wait_s = (expires_at - now).total_seconds() + 5 if expires_at else None
            raise JobBusy(f"message is held by {holder.get('owner')} under an expired SQS lease; "
                          "retrying once its record lease ends", retry_after_s=wait_s)
        log.warning("job.duplicate_delivery", holder=holder.get("owner"),
                    note="another message for this job is being worked on; acknowledged without work")
        return Handled.DUPLICATE

    def _artifacts(self, job: Job, reused: dict[str, Path] | None, stop: StopSignal, attempt: Attempt,
                   attempt_dir: Path, ledger: Ledger) -> dict[str, Path]:
        self._check_work_root()
        if reused is not None:
            log.info("job.reusing_verified_artifacts")
            return reused
        progress = ProgressReporter(attempt, stop, metrics=self._metrics, own_steps=OWN_STEPS)
        log.info("job.attempt_dir", attempt_dir=attempt_dir.name)
        return self._train(job, attempt_dir, stop, progress, ledger)

    def _persist(self, job: Job, attempt: Attempt, paths: dict[str, Path], lease: Lease,
                 store_lease: StoreLease, attempt_dir: Path) -> tuple[dict[str, str], list[str]]:
        """Commit steps 1-5; the committed S3 and local paths."""
        # Past this point only a lost lease stops us: a cancel or shutdown now would strand half a commit.
        lease.stop.raise_if_set()
        # Progress stage COMMITTING (a fenced write): from here on the store refuses cancel requests
        # and `cancel` says it is too late. The renewal after it reads a request that landed before,
        # so a cancel is either honoured here or refused, never accepted and then ignored.
        try:
            attempt.progress(COMMITTING, 100.0)
        except StaleWrite as exc:
            raise LeaseLost(f"committing stage refused: {exc}") from exc
        store_lease.renew()
        lease.stop.raise_if_set()
        models_dir = models_dir_for(self._models_root, job)
        # The files lie in this attempt's output directory, or, when a retry reuses what an earlier
        # attempt of this job published, all under MODELS_ROOT: each is checked inside its own base.
        base_dir = _artifacts_base(paths, attempt_dir / OUTPUT_DIR, models_dir)
        verify_local(base_dir, paths)                                            # 1
        rels = artifact_rels(paths, attempt_dir / OUTPUT_DIR, models_dir)
        written: list[str] = []
        try:
            return self._commit(job, attempt, paths, lease, store_lease, base_dir, rels, models_dir, written)
        except (LeaseLost, StaleWrite):
            self._remove_stale_uploads(job, written)
            raise
        except Stopped as exc:
            if exc.reason == Stopped.LEASE_LOST:
                self._remove_stale_uploads(job, written)
            raise

    def _commit(self, job: Job, attempt: Attempt, paths: dict[str, Path], lease: Lease,
                store_lease: StoreLease, base_dir: Path, rels: dict[str, str], models_dir: Path,
                written: list[str]) -> tuple[dict[str, str], list[str]]:
        # The uploader names each file by its path under base_dir; the key takes the artifact's own
        # relative path (a published file's path under MODELS_ROOT starts with its digest).
        sources = {name: Path(paths[name]).relative_to(base_dir).as_posix() for name in paths}
        rel_of = {sources[name]: rels[name] for name in paths}
        digest_of: dict[str, str] = {}  # path under base_dir -> the SHA-256 its object is stored under

        def key_for(sha256_hex: str, relative_path: str) -> str:
            digest_of[relative_path] = sha256_hex
            return artifact_key(self._s3_prefix, job.environment, job.profile_id, job.job_id, sha256_hex,
                                rel_of[relative_path])

        def proof() -> None:
            # S3 is outside the store's fence: before each object, renew the claim (the proof that it
            # is still ours); a store that cannot be reached leaves the local deadline to decide.
            try:
                store_lease.renew()
            except StoreError as exc:
                log.warning("job.lease_renewal_failed", error=str(exc), when="before an upload")
            part_proof()

        def part_proof() -> None:
            self._check_lease(lease)
            store_lease.ensure_live()

        # The digests the stage manifests recorded name the keys, and their files' identities spare
        # the uploader and the publisher a second read: each file is hashed once, by its manifest.
        recorded = recorded_outputs(base_dir)
        with tracing.span("upload", files=len(paths)):
            s3_paths = self._uploader.upload_all(base_dir, paths, key_for, proof=proof,      # 2
                                                 part_proof=part_proof, written=written, recorded=recorded)
        self._crash("after_upload")
        self._check_lease(lease)
        # Before the paths, so they never name a file that does not exist (see worker.voice.publish).
        # The published files must hold the bytes the objects hold: same rule, same digests.
        published = publish_all(base_dir, sources, rels,                         # 2b
                                {name: digest_of[sources[name]] for name in paths}, models_dir, recorded)
        self._check_lease(lease)
        model_paths = {name: str(path) for name, path in published.items()}
        attempt.write_paths(model_paths, s3_paths)                               # 3
        self._crash("after_paths")
        self._check_lease(lease)
        attempt.complete_profile()                                               # 4
        self._crash("after_profile_completed")
        self._check_lease(lease)
        store_lease.end()
        attempt.complete()                                                       # 5 commit marker
        self._crash("after_job_completed")
        return s3_paths, list(model_paths.values())

    def _remove_unreferenced_objects(self, job: Job, s3_paths: dict[str, str]) -> None:
        """After the commit: objects under the job's prefix that the committed paths do not name are a
        stale or failed attempt's; delete them (best effort: the job is committed whatever happens)."""
        prefix = job_key_prefix(self._s3_prefix, job.environment, job.profile_id, job.job_id)
        referenced = [self._uploader.key_of(uri) for uri in s3_paths.values()]
        try:
            doomed = unreferenced(self._uploader.list_keys(prefix), filter(None, referenced))
            for key in doomed:
                self._uploader.delete(key)
        except Exception as exc:  # noqa: BLE001 - the job is committed: nothing here may fail it
            log.warning("artifacts.cleanup_failed", error=str(exc))
            return
        if doomed:
            log.info("artifacts.unreferenced_removed", count=len(doomed), keys=doomed[:5])

    def _remove_stale_uploads(self, job: Job, written: list[str]) -> None:
        """We lost the job after writing objects: delete those the committed job does not name."""
        if not written:
            return
        try:
            record, profile = self._store.get_job(job.job_id), self._store.get_profile(job.profile_id)
            if str((profile or {}).get("jobId")) != job.job_id:
                # Another job of the profile has claimed it since: its paths say nothing about what this
                # job committed, so nothing is provably unreferenced.
                log.info("artifacts.stale_uploads_kept", written=len(written), why="the profile moved on")
                return
            committed = ((profile or {}).get("s3Paths") or {}).values()
            referenced = filter(None, (self._uploader.key_of(uri) for uri in committed))
            doomed = stale_leftovers(written, record, referenced)
            for key in doomed:
                self._uploader.delete(key)
        except Exception as exc:  # noqa: BLE001 - we are already failing with the lost lease
            log.warning("artifacts.stale_cleanup_failed", error=str(exc), written=len(written))
            return
        log.info("artifacts.stale_uploads", written=len(written), removed=len(doomed),
                 kept="referenced by the committed profile or the job is not committed yet")

    def _check_work_root(self) -> None:
        """Job files go only into the WORK_ROOT this worker first worked in.

        After an unmount the path names the directory under the mount point (or nothing, and the
        pipeline would create it): another disk, one no other host sees and none meant to fill up.
        """
        if self._work_root_identity is None:
            try:
                self._work_root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StageFailed(f"cannot create WORK_ROOT {self._work_root}: {exc.strerror or exc}") from exc
            self._work_root_identity = directory_identity(self._work_root)
            return
        problem = work_root_problem(self._work_root_identity, directory_identity(self._work_root))
        if problem is not None:
            raise StageFailed(f"WORK_ROOT {self._work_root} {problem}: no job files are written there until "
                              "it is back; a new file system there is used after a restart of the worker")

    def _clean_up_after_commit(self, job: Job, s3_paths: dict[str, str], model_paths: Iterable[str]) -> None:
        """Best effort, each step on its own: what no committed path names goes (S3 objects, published
        copies), then the job's scratch. Safe to run again: a redelivery of the committed job does."""
        self._remove_unreferenced_objects(job, s3_paths)
        self._remove_unpublished(job, model_paths)
        self._remove_work_files(job)
        if self._forget_remote_work is not None:
            try:
                self._forget_remote_work(work_dir_for(self._work_root, job))
            except Exception as exc:  # noqa: BLE001 - the job is committed: nothing here may fail it
                log.warning("job.remote_work_not_removed", error=f"{type(exc).__name__}: {exc}")

    def _remove_unpublished(self, job: Job, model_paths: Iterable[str]) -> None:
        try:
            failures = _remove_entries(unpublished_leftovers(models_dir_for(self._models_root, job), model_paths))
        except Exception as exc:  # noqa: BLE001 - the job is committed: nothing here may fail it
            failures = [f"{type(exc).__name__}: {exc}"]
        if failures:
            log.warning("job.unpublished_not_removed", failures=failures[:5], count=len(failures))

    def _remove_work_files(self, job: Job) -> None:
        """After the commit: the models are in S3 and published, so only the job's logs stay as scratch."""
        if self._keep_work_files:
            return
        try:
            failures = remove_work_files(work_dir_for(self._work_root, job), self._models_root)
        except Exception as exc:  # noqa: BLE001 - the job is committed: nothing here may fail it
            failures = [f"{type(exc).__name__}: {exc}"]
        if failures:
            log.warning("job.work_files_not_removed", failures=failures[:5], count=len(failures))

    @staticmethod
    def _check_lease(lease: Lease) -> None:
        # lease.lost, not the stop reason: a lease lost after a shutdown or cancel request still counts.
        if lease.lost:
            raise Stopped(Stopped.LEASE_LOST, lease.lost_reason or "")

    def _stopped(self, job: Job, claimed: dict | None, attempt: Attempt, exc: Stopped) -> str:
        if exc.reason == Stopped.CANCELLED:
            attempt.cancel()
            log.info("job.cancelled", when="during work")
            self._announce(CANCELLED, job, claimed, attempt)
            return Handled.CANCELLED
        if exc.reason == Stopped.SHUTDOWN:
            self._release(attempt)  # on failure the lease lapses; the message is released anyway
            raise exc
        if exc.reason == Stopped.TIME_LIMIT:
            limit = TimeLimitExceeded(f"job ran past its time limit ({exc})")
            if self._record_error(attempt, limit):
                self._announce(DEAD_LETTERED, job, claimed, attempt, error=limit)
            raise limit from exc
        # Lease lost: no commit. Clearing our store lease (fenced: only if still ours) lets the next
        # delivery claim at once instead of waiting for it to expire.
        self._release(attempt)
        raise exc

    @staticmethod
    def _release(attempt: Attempt) -> None:
        """Let go of the job lease, fenced on the attempt's token (a no-op once it is not ours)."""
        try:
            attempt.release()
        except WorkerError as release_exc:
            log.warning("job.release_failed", error=str(release_exc))

    def _failed(self, job: Job, attempt: Attempt, claimed: dict | None, exc: WorkerError) -> WorkerError:
        """Record the attempt's failure; the error to end with: ``exc``, or ``RetriesExhausted`` once this
        recorded failure spent the job's last retry. An unrecorded failure spends none."""
        if not self._record_error(attempt, exc):
            return exc
        # The claimed record's count plus this failure: our fenced write is the only one since the claim.
        failed = failed_attempts(claimed) + (1 if exc.retryable else 0)
        settled = spend_retry(exc, failed, self._max_failed_attempts)
        if settled is not exc:
            log.warning("job.retries_exhausted", failed_attempts=failed, error_type=exc.error_type,
                        note="dead-lettered by the worker: MAX_FAILED_ATTEMPTS reached")
        self._announce(FAILED if settled.retryable else DEAD_LETTERED, job, claimed, attempt, error=settled,
                       failedAttempts=failed)
        return settled

    def _announce(self, event_type: str, job: Job, claimed: dict | None, attempt: Attempt, *,
                  error: WorkerError | None = None, **extra: object) -> None:
        """One state-change event (worker.core.events), after the record it describes was written."""
        cost = usage(claimed)
        detail: dict[str, object] = {
            "jobId": job.job_id, "profileId": job.profile_id, "environment": job.environment,
            "at": utc_now().isoformat(), "attempts": cost["attempts"],
            "gpuSeconds": round(cost["gpuSeconds"] + attempt.trainer_clock.seconds(), 3), **extra}
        if error is not None:
            detail["error"] = {"type": error.error_type, "retryable": error.retryable,
                               "message": redact_text(str(error))[:ERROR_MESSAGE_MAX_CHARS]}
        self._events.publish(event_type, detail)

    @staticmethod
    def _record_error(attempt: Attempt, exc: WorkerError) -> bool:
        """Record the failure on the job; whether it was written. A failure to record never hides the
        original error."""
        try:
            return attempt.fail(exc.error_type, str(exc)[:ERROR_MESSAGE_MAX_CHARS], retryable=exc.retryable)
        except Exception as record_exc:  # noqa: BLE001 - a record another writer mangled may fail any way
            log.error("job.record_error_failed", error=f"{type(record_exc).__name__}: {record_exc}",
                      original=str(exc))
            return False

    def _refuse_malformed(self, job: Job, record: dict | None, profile: dict | None) -> None:
        """Dead-letter, before any claim, a job whose records hold a field the worker decides on in a
        shape it never writes (``MalformedRecord``): no retry mends it, and read further in it would
        fail as an ``UnexpectedError``, retried until the DLQ.

        The reason goes into the DLQ copy and the log, and onto the job record when that takes the
        write: the error write replaces a malformed lease, history or failedAttempts, but a record
        under a live lease elsewhere, final, or holding a time no store can encode, keeps what it holds.
        """
        if isinstance(record, dict) and str(record.get("profileId") or job.profile_id) != job.profile_id:
            return  # a message naming another profile: InvalidMessage, just below, writing nothing
        problems = unworkable(record, profile)
        if not problems:
            return
        error = MalformedRecord(job.job_id, problems)
        try:
            recorded = self._store.record_error(job.job_id, token=None, error_type=error.error_type,
                                                message=str(error)[:ERROR_MESSAGE_MAX_CHARS], retryable=False)
        except Exception as exc:  # noqa: BLE001 - the record may be beyond writing: the DLQ copy still says why
            log.warning("job.malformed_record_not_recorded", error=f"{type(exc).__name__}: {exc}")
            recorded = False
        log.error("job.malformed_record", problems=problems, recorded_on_job=recorded,
                  note="written by something other than the worker: dead-lettered; fix the record, then redrive")
        raise error

