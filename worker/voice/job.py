"""The voice-cloning job handler: everything between a received message and the decision to ack it.

    parse -> completion check -> claim (fenced lease) -> train -> commit -> return

The commit (persist in commit order, then the clean-up after it) is ``worker.voice.commit``'s; where
the job's files go is ``pipeline.workdir``'s. Returning tells the loop to delete the message; raising
tells it to retry, dead-letter or release. Every write after the claim carries the claim's token, so
a worker whose lease was taken over can no longer change anything: its writes match no record and
raise ``StaleWrite``.

The rules around that path:

* Each attempt works in a directory of its own, ``<job dir>/attempts/<attempt id>/`` (the attempt
  number and the start of the claim token), so a stale attempt never writes the new one's files; a
  retry copies what earlier attempts verified (``pipeline.reuse``). The logs are the job's.
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
* With a ``[quality]`` table the evaluation report is read after the stages and its figures kept on
  the record (``worker.voice.quality``); a model below a bar of the gate ends the job ``refused``
  before the commit's first step (nothing uploaded, published or written to the profile), and the
  message is acknowledged: a business outcome, like a cancellation, not a failure. A redelivery of a
  refused job is acknowledged without work, as a completed one's is.
* A pipeline that is the reference stand-in refuses staging and production jobs (``StandInRefused``,
  permanent) after the claim and before any download, unless ALLOW_STAND_IN_TRAINER allows them.
* A host fault (a stage's exit 70: its GPU gone; the work file system full, over quota, read-only,
  failing or gone, also when only found after a stage failed: ``pipeline.host_faults``) releases the
  job as a shutdown does: no failure recorded, no retry spent, the attempt's history entry ending
  ``host_fault``, the record's ``hostFaults`` one up; the loop then takes no other message and the
  daemon exits 7. A job already released HOST_FAULT_MAX_RELEASES times is presumed to cause the fault
  itself (recordings larger than the disk): the next one is its own retryable failure, the host stays.
* A message that does not parse or validate changes no record: its jobId is only a claim, and
  another message (the job's own) must not inherit its failure. It is dead-lettered with its own
  reason. So is a valid message whose profileId is not the job record's.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import structlog

from pipeline.config import QualityConfig
from pipeline.host_faults import (
    DEFAULT_MAX_RELEASES,
    Verdict,
    host_fault_of,
    host_fault_verdict,
    host_faults_of,
    work_fs_fault,
)
from pipeline.remote_work import Ledger, shared_file_system
from pipeline.run import OWN_STEPS
from pipeline.workdir import (
    WorkRoot,
    attempt_dir_for,
    default_models_root,
    prune_work_root,
    work_dir_for,
    work_layout,
)
from worker.core import tracing
from worker.core.core_config import DEFAULT_MAX_FAILED_ATTEMPTS
from worker.core.errors import (
    HostFault,
    InvalidMessage,
    LeaseLost,
    PermanentError,
    RetryableError,
    Stopped,
    TimeLimitExceeded,
    UnexpectedError,
    WorkerError,
)
from worker.core.events import CANCELLED, COMPLETED, DEAD_LETTERED, FAILED, Events, NoEvents
from worker.core.faults import NEVER, CrashPoints
from worker.core.lease import Lease
from worker.core.loop import spend_retry
from worker.core.metrics import COUNT, NULL_METRICS, SECONDS, Metrics
from worker.core.queue import Message
from worker.core.redact import redact_text
from worker.core.stop import StopSignal
from worker.voice import prep_report
from worker.voice import quality as evaluation
from worker.voice.artifacts import ArtifactUploader
from worker.voice.commit import Commit, Committed
from worker.voice.errors import (
    AlreadyFailed,
    BadPrepReport,
    JobBusy,
    MalformedRecord,
    QualityBelowBar,
    StandInRefused,
    TooLittleSpeech,
    UnknownJob,
)
from worker.voice.input_policy import InputPolicy
from worker.voice.message import Job, job_id_hint, parse_job
from worker.voice.metrics import JOB_ATTEMPTS, JOB_GPU_SECONDS, JOB_WASTED_GPU_SECONDS, WASTED_GPU_SECONDS
from worker.voice.mirror_ledger import RecordLedger
from worker.voice.records import ClaimOutcome, Store
from worker.voice.records.attempt import PROGRESS_LOG_INTERVAL_S, Attempt, ProgressReporter, StoreLease
from worker.voice.records.errors import StaleWrite, StoreError
from worker.voice.records.models import JobRecord, ProfileRecord
from worker.voice.records.rules import (
    ERROR,
    ERROR_MESSAGE_MAX_CHARS,
    FINAL_STATUSES,
    METRICS,
    QUALITY,
    REQUIRED_ARTIFACTS,
    failed_attempts,
    is_complete,
    usage,
    utc_now,
)
from worker.voice.records.training import PlannedStage
from worker.voice.records.view import unworkable

if TYPE_CHECKING:
    from pipeline.run import Progress

log = structlog.get_logger(__name__)

# Frozen, so one shared default is safe: the policy a handler gets when none is configured.
DEFAULT_POLICY = InputPolicy()


class Trainer(Protocol):
    """What turns a claimed job into its artifacts (a path for every configured key, ``HandlerConfig.
    artifacts``): ``pipeline.run.PipelineTrainer`` in production.

    A fake is anything with this call shape. ``progress(step, percent)`` writes the record's
    progress; ``stop`` is the attempt's own stop signal, to be honoured by every step; ``ledger`` is
    what the job record vouches for of the job's S3 mirror, and where the attempt vouches for its own
    (``worker.voice.mirror_ledger``).
    """

    def __call__(self, job: Job, work_dir: Path, stop: StopSignal, progress: Progress, ledger: Ledger,
                 /) -> dict[str, Path]: ...


@dataclass(frozen=True)
class HandlerConfig:
    """What every job of one handler shares, read once at start (``worker.app`` builds it from settings)."""

    work_root: Path
    s3_prefix: str
    worker_id: str
    # The record's lease lasts as long as the message's visibility: both lapse together.
    lease_s: float
    # Where the artifacts are published; None: <work_root>/.models (pipeline.workdir).
    models_root: Path | None = None
    keep_work_files: bool = False
    # Recorded retryable failures after which the job's message is dead-lettered (MAX_FAILED_ATTEMPTS).
    max_failed_attempts: int = DEFAULT_MAX_FAILED_ATTEMPTS
    # The default policy refuses every s3:// recording: a handler is never more open than asked.
    policy: InputPolicy = DEFAULT_POLICY
    # The artifact keys every commit writes: the pipeline config's ``artifact_keys`` (its [artifacts]).
    artifacts: tuple[str, ...] = REQUIRED_ARTIFACTS
    # The pipeline config's [quality]: where the evaluation report lies, and the gate (None: no report).
    quality: QualityConfig | None = None
    # The environments whose jobs this worker refuses (StandInRefused) before any download: staging and
    # production when the pipeline is the reference stand-in and ALLOW_STAND_IN_TRAINER is false.
    refused_environments: frozenset[str] = frozenset()
    # The pipeline's pinned base model ({name, digest, licence}), named on every job and on the profile
    # its models are committed to, so a product team knows what each voice was derived from.
    base_model: Mapping[str, str] | None = None
    # The job's steps in order with their weights (``training.plan_of``): stage k of n, overall percent, ETA.
    stage_plan: tuple[PlannedStage, ...] = ()
    # How often a running trainer stage logs `stage.progress` (PROGRESS_LOG_INTERVAL_SECONDS).
    progress_log_interval_s: float = PROGRESS_LOG_INTERVAL_S
    # Below this much free space after a failed step the work file system is the host's fault
    # (WORK_MIN_FREE_BYTES, the start-up check's bar); 0: only a read-only or gone one is.
    work_min_free_bytes: int = 0
    # Releases for host faults after which a job's next fault is its own failure (HOST_FAULT_MAX_RELEASES).
    max_host_fault_releases: int = DEFAULT_MAX_RELEASES
    # What ended jobs leave under WORK_ROOT (their logs/) is pruned past this age and beyond this total
    # (STAGE_LOGS_MAX_AGE_DAYS, STAGE_LOGS_MAX_BYTES; 0: no bound of that kind), at most every
    # ``prune_interval_s``, after a message is handled (pipeline.workdir.prune_work_root).
    stage_logs_max_age_s: float = 14 * 86_400.0
    stage_logs_max_bytes: int = 1024**3
    prune_interval_s: float = 300.0


class Acknowledged(StrEnum):
    """What the handler returns to acknowledge: logged by the loop, which counts COMPLETED and
    CANCELLED under their own metrics and the rest as skipped."""

    COMPLETED = "completed"
    CANCELLED = "cancelled"
    ALREADY_COMPLETE = "already_complete"
    DUPLICATE = "duplicate"
    # Below the quality gate: the job ends refused (final, nothing committed); and its redelivery.
    REFUSED = "refused"


@dataclass(frozen=True)
class Claimed:
    """One claimed attempt of a job: what the claim handed back, and what it decided."""

    job: Job
    attempt: Attempt
    record: JobRecord | None  # the job record as the claim wrote it
    store_lease: StoreLease
    # The profile's published paths of this job, which verify: an earlier attempt reached commit step 3,
    # so this one finishes that commit without training.
    reused: dict[str, Path] | None
    # The attempt's evaluation figures once read (worker.voice.quality.figures): its events carry them.
    quality: dict = field(default_factory=dict)

    @property
    def number(self) -> int:
        return (self.record.attempts if self.record is not None else None) or 0


def unexpected(exc: Exception) -> UnexpectedError:
    return UnexpectedError(f"unexpected {type(exc).__name__}: {exc}"[:ERROR_MESSAGE_MAX_CHARS])


class VoiceJobHandler:
    """The loop's handler for voice jobs: ``handler(message, lease) -> str``, raising to not acknowledge."""

    def __init__(self, config: HandlerConfig, *, store: Store, uploader: ArtifactUploader, train: Trainer,
                 crash_points: CrashPoints = NEVER, metrics: Metrics = NULL_METRICS, events: Events | None = None,
                 forget_remote_work: Callable[[Path], None] | None = None):
        """``forget_remote_work(job_dir)``: after the commit, drop the job's mirror in S3 (when attempts
        mirror their work, ``pipeline.run.PipelineTrainer.forget_remote_work``)."""
        self.config = config
        self._store = store
        self._train = train
        self._metrics = metrics
        self._work_root = WorkRoot(config.work_root)
        self._commit = Commit(store, uploader, s3_prefix=config.s3_prefix, work_root=config.work_root,
                              models_root=config.models_root or default_models_root(config.work_root),
                              keep_work_files=config.keep_work_files, forget_remote_work=forget_remote_work,
                              crash_points=crash_points, artifacts=config.artifacts)
        self._settle = Settlement(events or NoEvents(), metrics, config.max_failed_attempts,
                                  config.max_host_fault_releases)
        self._pruned_at_s: float | None = None

    def __call__(self, message: Message, lease: Lease) -> str:
        try:
            job = parse_job(message.body, self.config.policy)
        except InvalidMessage:
            # The body's jobId is only a claim: writing this failure on that job would make the job's
            # own valid message look already failed. The DLQ copy carries the reason; no record write.
            log.warning("job.invalid_message", named_job_id=job_id_hint(message.body),
                        note="dead-lettered with its own reason; no job record changed")
            raise
        # Bound for the job's lines, and restored after (the loop may have bound the same hint already,
        # for its own lines up to the message's delete).
        try:
            with structlog.contextvars.bound_contextvars(job_id=job.job_id):
                return self._traced(job, message, lease)
        finally:
            self._prune()

    def _prune(self) -> None:
        """Keep the host's disk bounded over months: remove what ended jobs left past its age or beyond
        the total (never fails the message: a line at most)."""
        now_s = time.monotonic()
        if self._pruned_at_s is not None and now_s - self._pruned_at_s < self.config.prune_interval_s:
            return
        self._pruned_at_s = now_s
        config = self.config
        try:
            removed, failures = prune_work_root(config.work_root, time.time(), config.stage_logs_max_age_s,
                                                config.stage_logs_max_bytes,
                                                config.models_root or default_models_root(config.work_root))
        except OSError as exc:
            log.warning("work_root.prune_failed", error=f"{type(exc).__name__}: {exc}")
            return
        if removed or failures:
            log.info("work_root.pruned", job_dirs=len(removed), left=failures[:5])

    def _traced(self, job: Job, message: Message, lease: Lease) -> str:
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

    def _handle(self, job: Job, message: Message, lease: Lease) -> str:
        """The life of a job, once its message parsed: completion check -> claim -> train -> commit."""
        record, profile = self._store.get_job(job.job_id), self._store.get_profile(job.profile_id)
        refuse_malformed(self._store, job, record, profile)
        refuse_another_profile(job, record)
        if is_complete(record, profile) and profile is not None:  # (is_complete implies the profile)
            return self._already_complete(job, profile)
        refuse_recorded_failure(record, message, self.config.max_failed_attempts)
        claimed = self._claim(job, message, lease, profile)
        if isinstance(claimed, Acknowledged):
            return claimed  # nothing to work on: the job is final, cancelled, or another message's
        committed: Committed | None = None
        try:
            # Inside the try: a work dir that escapes WORK_ROOT is this attempt's recorded failure.
            attempt_dir = attempt_dir_for(work_dir_for(self.config.work_root, job), claimed.number,
                                          claimed.attempt.token)
            self._refuse_stand_in(job)  # before any download
            if self.config.base_model is not None:
                claimed.attempt.record_base_model(dict(self.config.base_model))
            try:
                paths = self._artifacts(claimed, attempt_dir, lease.stop)
            except PermanentError as exc:
                self._refuse_too_little_speech(claimed, attempt_dir, exc)
                raise
            self._record_dataset(claimed, attempt_dir)
            self._evaluate(claimed, attempt_dir)  # the gate: below a bar, QualityBelowBar, nothing uploaded
            with tracing.span("commit"):
                committed = self._commit.persist(job, claimed.attempt, paths, attempt_dir, lease,
                                                 claimed.store_lease, quality=claimed.quality or None,
                                                 base_model=self.config.base_model)
        except Exception as exc:
            return self._ended_short(claimed, exc)
        finally:
            if committed is None:  # whatever ended the attempt short of its commit: time bought nothing
                self._settle.wasted(claimed)
        self._settle.completed(claimed, committed)
        self._commit.clean_up(job, committed.s3_paths, committed.model_paths.values())
        log.info("job.completed")
        return Acknowledged.COMPLETED

    def _ended_short(self, claimed: Claimed, exc: Exception) -> str:
        """Settle an attempt that ended short of its commit; a job that ended there (cancelled, refused,
        dead-lettered) leaves only its logs on this host."""
        try:
            acknowledged = self._settle.ended_short(claimed, exc, host_fault=self._host_fault(exc))
        except PermanentError:
            self._commit.clean_ended(claimed.job)
            raise
        except HostFault:
            # This host leaves service and the job goes elsewhere: what it holds here only keeps a full
            # disk full for the next worker on it. A shared root's files stay, for the host taking it.
            if shared_file_system(self.config.work_root) is None:
                self._commit.clean_ended(claimed.job)
            raise
        self._commit.clean_ended(claimed.job)
        return acknowledged

    def _host_fault(self, exc: Exception) -> str | None:
        """Why the host, not the job, ended the attempt, or None (``pipeline.host_faults``)."""
        if isinstance(exc, (Stopped, LeaseLost)):
            return None
        if (found := host_fault_of(exc)) is not None:
            return found
        if isinstance(exc, RetryableError) or not isinstance(exc, WorkerError):
            # A trainer that met a full disk exits with a code of its own: the disk says it afterwards.
            return work_fs_fault(self.config.work_root, self.config.work_min_free_bytes)
        return None

    def _already_complete(self, job: Job, profile: ProfileRecord) -> str:
        log.info("job.already_complete", note="redelivery acknowledged without work")
        if profile.job_id == job.job_id:
            # The paths are this job's: redo the (idempotent) clean-ups a crash after the commit skipped.
            self._commit.clean_up(job, profile.s3_paths, profile.model_paths.values())
        return Acknowledged.ALREADY_COMPLETE

    def _claim(self, job: Job, message: Message, lease: Lease,
               profile: ProfileRecord | None) -> Claimed | Acknowledged:
        """Claim the job (a fenced lease, renewed with the message's from now on), or what to acknowledge
        when there is nothing to work on."""
        # A claim that fails after its job swap (the profile stamp, a lost reply) lets go of the job itself.
        # From here on only the Attempt it hands back holds the token.
        claim_sent_s = time.monotonic()
        with tracing.span("claim"):
            claim = self._store.claim(job.job_id, owner=self.config.worker_id, token=secrets.token_hex(16),
                                      lease_s=self.config.lease_s, message_id=message.message_id)
        if claim.outcome == ClaimOutcome.MISSING:
            raise UnknownJob(f"no job record {job.job_id} (yet)")
        if claim.outcome in FINAL_STATUSES:  # the claim names the final status it found
            log.info("job.nothing_to_do", status=claim.outcome)
            return Acknowledged(claim.outcome)
        if claim.outcome == ClaimOutcome.HELD:
            return held(claim.job, message, claim.now)
        log.info("job.claimed", attempt=claim.job.attempts if claim.job is not None else None)
        if claim.attempt is None:  # Store.claim's contract: a claimed outcome carries its Attempt
            raise StoreError("the store claimed the job but handed back no attempt")
        # An earlier attempt of this job wrote its published paths (commit step 3) and died: the profile
        # may already say completed, so a cancel is too late and this attempt finishes the commit.
        reused = self._commit.reusable(job, profile)
        store_lease = StoreLease(claim.attempt, lease.stop, margin_s=lease.interval_s, claim_sent_s=claim_sent_s,
                                 honour_cancel=reused is None)
        lease.on_renew(store_lease.renew)
        claimed = Claimed(job, claim.attempt, claim.job, store_lease, reused)
        if claim.cancel_requested and reused is not None:
            log.warning("job.cancel_too_late", note="an earlier attempt began the commit: finishing it")
        elif claim.cancel_requested:
            store_lease.end()
            cancelled = self._settle.cancelled(claimed, when="at claim")
            self._commit.clean_ended(job)  # an earlier attempt's files
            return cancelled
        return claimed

    def _refuse_stand_in(self, job: Job) -> None:
        if job.environment in self.config.refused_environments:
            raise StandInRefused(
                f"environment {job.environment!r}: this worker's pipeline is the reference stand-in "
                "([pipeline] stand_in = true), which never trains a staging or production voice; point "
                "PIPELINE_CONFIG at the real trainer (ALLOW_STAND_IN_TRAINER=true only for a load test)")

    def _record_dataset(self, claimed: Claimed, attempt_dir: Path) -> None:
        """Keep on the job record what the trainers' data preparation kept and left out, and why
        (worker.voice.prep_report); nothing when the stages wrote no report, or when an earlier attempt's
        commit is finished (it recorded its own)."""
        if claimed.reused is not None:
            return
        report = prep_report.read_prep_report(work_layout(attempt_dir).output)
        if report is None:
            return
        claimed.attempt.record_dataset(prep_report.dataset_record(report))
        log.info("job.dataset", kept=report.totals.keptClips, kept_s=report.totals.keptS,
                 left_out=report.totals.leftOutClips, reasons=report.totals.leftOutByReason)

    def _refuse_too_little_speech(self, claimed: Claimed, attempt_dir: Path, exc: PermanentError) -> None:
        """A stage that failed for good after data preparation refused the data (its report's
        ``refused``): record what was kept and left out, and fail as ``TooLittleSpeech`` (typed, the
        stage's error chained) rather than a bare stage exit."""
        try:
            report = prep_report.read_prep_report(work_layout(attempt_dir).output)
        except BadPrepReport:
            return  # the stage's own failure stays the reason
        if report is None or report.refused is None:
            return
        dataset = prep_report.dataset_record(report)
        claimed.attempt.record_dataset(dataset)
        raise TooLittleSpeech(f"too little usable speech: {report.refused}; "
                              f"{prep_report.summary_line(dataset)}") from exc

    def _evaluate(self, claimed: Claimed, attempt_dir: Path) -> None:
        """Read the evaluation report the pipeline config names, keep its figures on the job record
        (fenced), emit them as metrics, and hold them to the gate: ``QualityBelowBar`` when a model is
        below a bar. Nothing to do without a [quality] table.

        A retry that finishes an earlier attempt's commit (``reused``) passed the gate then: the figures
        that attempt recorded go onto the profile."""
        config = self.config.quality
        if config is None:
            return
        if claimed.reused is not None:
            recorded = claimed.record.document.get(QUALITY) if claimed.record is not None else None
            if isinstance(recorded, dict):
                claimed.quality.update(recorded)
            return
        path = work_layout(attempt_dir).output / config.report
        report = evaluation.read_report(path, shown_as=config.report)
        failed = evaluation.gate_failures(report, config.gate)
        claimed.quality.update(evaluation.figures(report, report_path=str(path), gate=config.gate, failed=failed))
        claimed.attempt.record_quality(claimed.quality)
        evaluation.emit_metrics(self._metrics, report, job_id=claimed.job.job_id)
        log.info("job.quality", passed=not failed, failed=failed,
                 full_similarity=report.models["full"].speaker_similarity,
                 light_similarity=report.models["light"].speaker_similarity)
        if failed:
            raise QualityBelowBar(failed)

    def _artifacts(self, claimed: Claimed, attempt_dir: Path, stop: StopSignal) -> dict[str, Path]:
        """Train: the artifacts of this attempt (or the earlier attempt's it finishes the commit of)."""
        ledger = RecordLedger(claimed.attempt, claimed.record)
        self._work_root.check()
        if claimed.reused is not None:
            log.info("job.reusing_verified_artifacts")
            return claimed.reused
        progress = ProgressReporter(claimed.attempt, stop, metrics=self._metrics, own_steps=OWN_STEPS,
                                    plan=self.config.stage_plan, log_interval_s=self.config.progress_log_interval_s,
                                    earlier=claimed.record.document.get(METRICS) if claimed.record else None)
        log.info("job.attempt_dir", attempt_dir=attempt_dir.name)
        return self._train(claimed.job, attempt_dir, stop, progress, ledger)


class Settlement:
    """How a claimed attempt ends: its final record write (fenced), its state-change event, its cost."""

    def __init__(self, events: Events, metrics: Metrics, max_failed_attempts: int,
                 max_host_fault_releases: int = DEFAULT_MAX_RELEASES):
        self._events = events
        self._metrics = metrics
        self._max_failed_attempts = max_failed_attempts
        self._max_host_fault_releases = max_host_fault_releases

    def completed(self, claimed: Claimed, committed: Committed) -> None:
        self._report_cost(claimed)
        self._announce(COMPLETED, claimed, s3Paths=committed.s3_paths)

    def cancelled(self, claimed: Claimed, *, when: str) -> Acknowledged:
        claimed.attempt.cancel()
        log.info("job.cancelled", when=when)
        self._announce(CANCELLED, claimed)
        return Acknowledged.CANCELLED

    def refused(self, claimed: Claimed, below: QualityBelowBar) -> Acknowledged:
        """The gate refused the trained models: the job ends refused (final, durable before the ack),
        and a JobFailed event says why, so the product can ask its user to record again."""
        claimed.attempt.refuse(below.error_type, str(below)[:ERROR_MESSAGE_MAX_CHARS], below.failed,
                               claimed.quality or None)
        log.warning("job.refused", failed=below.failed,
                    note="below the quality gate: nothing committed; acknowledged, not retried")
        self._announce(FAILED, claimed, error=below, outcome="refused", failedBars=below.failed)
        return Acknowledged.REFUSED

    def wasted(self, claimed: Claimed) -> None:
        self._metrics.seconds(WASTED_GPU_SECONDS, claimed.attempt.trainer_clock.seconds(), jobId=claimed.job.job_id)

    def ended_short(self, claimed: Claimed, exc: Exception, *, host_fault: str | None = None) -> str:
        """Settle an attempt that ended before its commit marker: what to acknowledge (a cancel), or raise.
        ``host_fault``: why the host, not the job, ended it (see the module docstring)."""
        if isinstance(exc, LeaseLost):
            raise exc  # not ours any more: write nothing
        claimed.store_lease.end()
        if isinstance(exc, Stopped):
            return self._stopped(claimed, exc)
        if isinstance(exc, QualityBelowBar):
            try:
                return self.refused(claimed, exc)
            except StaleWrite:
                release(claimed.attempt)  # not ours any more (fenced: a no-op then); nothing refused
                raise
        if isinstance(exc, StaleWrite):
            # A fenced write refused (a profile claim replaced behind us) while the job lease may still
            # be ours: let go of it (fenced: a no-op if not ours) so the job need not wait for it to lapse.
            release(claimed.attempt)
            raise exc
        if host_fault is not None:
            self._host_fault(claimed, host_fault, exc)
        settled = self._failed(claimed, exc if isinstance(exc, WorkerError) else unexpected(exc))
        if settled is exc:
            raise exc
        raise settled from exc

    def _host_fault(self, claimed: Claimed, reason: str, exc: Exception) -> None:
        """Release the job for a host fault (raises ``HostFault``), unless the job was released for host
        faults often enough: then return, and the fault is settled as the job's own failure."""
        released_before = host_faults_of(claimed.record.document if claimed.record is not None else None)
        if host_fault_verdict(released_before, self._max_host_fault_releases) is Verdict.JOBS_OWN:
            log.warning("job.host_fault_counted_as_failure", reason=reason, host_faults=released_before,
                        note="released for host faults HOST_FAULT_MAX_RELEASES times: this one is the job's")
            return
        try:
            released = claimed.attempt.release_for_host_fault(reason)
        except WorkerError as release_exc:  # the lease lapses instead; the message is released all the same
            log.warning("job.release_failed", error=str(release_exc))
            released = False
        log.error("job.host_fault", reason=reason, host_faults=released_before + 1, recorded=released,
                  note="released to another host: no failure recorded, no retry spent")
        raise HostFault(f"host fault: {reason}") from exc

    def _stopped(self, claimed: Claimed, exc: Stopped) -> str:
        if exc.reason == Stopped.CANCELLED:
            return self.cancelled(claimed, when="during work")
        if exc.reason == Stopped.SHUTDOWN:
            release(claimed.attempt)  # on failure the lease lapses; the message is released anyway
            raise exc
        if exc.reason == Stopped.TIME_LIMIT:
            limit = TimeLimitExceeded(f"job ran past its time limit ({exc})")
            if record_error(claimed.attempt, limit):
                self._announce(DEAD_LETTERED, claimed, error=limit)
            raise limit from exc
        # Lease lost: no commit. Clearing our store lease (fenced: only if still ours) lets the next
        # delivery claim at once instead of waiting for it to expire.
        release(claimed.attempt)
        raise exc

    def _failed(self, claimed: Claimed, exc: WorkerError) -> WorkerError:
        """Record the attempt's failure; the error to end with: ``exc``, or ``RetriesExhausted`` once this
        recorded failure spent the job's last retry. An unrecorded failure spends none."""
        # The claimed record's count plus this failure: our fenced write is the only one since the claim.
        failed = failed_attempts(claimed.record) + (1 if exc.retryable else 0)
        settled = spend_retry(exc, failed, self._max_failed_attempts)
        # One write, saying at once that the message is being dead-lettered when it is (not "retryable"
        # until the reconciler applies the DLQ copy): status and jobs show it from now on.
        if not record_error(claimed.attempt, exc, retries_spent=settled is not exc):
            return exc
        if settled is not exc:
            log.warning("job.retries_exhausted", failed_attempts=failed, error_type=exc.error_type,
                        note="dead-lettered by the worker: MAX_FAILED_ATTEMPTS reached")
        self._announce(FAILED if settled.retryable else DEAD_LETTERED, claimed, error=settled, failedAttempts=failed)
        return settled

    def _report_cost(self, claimed: Claimed) -> None:
        """The job's GPU-seconds over all its attempts, and those wasted by the ones that did not commit."""
        earlier = usage(claimed.record)  # this attempt's own entry is still "running" there: counted below
        ours_s = claimed.attempt.trainer_clock.seconds()
        self._metrics.emit({JOB_GPU_SECONDS: (earlier["gpuSeconds"] + ours_s, SECONDS),
                            JOB_WASTED_GPU_SECONDS: (earlier["wastedGpuSeconds"], SECONDS),
                            JOB_ATTEMPTS: (earlier["attempts"], COUNT)}, jobId=claimed.job.job_id)
        log.info("job.cost", gpu_s=round(earlier["gpuSeconds"] + ours_s, 3),
                 wasted_gpu_s=earlier["wastedGpuSeconds"], attempts=earlier["attempts"])

    def _announce(self, event_type: str, claimed: Claimed, *, error: WorkerError | None = None,
                  **extra: object) -> None:
        """One state-change event (worker.core.events), after the record it describes was written."""
        job, cost = claimed.job, usage(claimed.record)
        detail: dict[str, object] = {
            "jobId": job.job_id, "profileId": job.profile_id, "environment": job.environment,
            "at": utc_now().isoformat(), "attempts": cost["attempts"],
            "gpuSeconds": round(cost["gpuSeconds"] + claimed.attempt.trainer_clock.seconds(), 3), **extra}
        if error is not None:
            detail["error"] = {"type": error.error_type, "retryable": error.retryable,
                               "message": redact_text(str(error))[:ERROR_MESSAGE_MAX_CHARS]}
        if claimed.quality:
            detail["quality"] = claimed.quality
        self._events.publish(event_type, detail)


# --- before the claim


def refuse_another_profile(job: Job, record: JobRecord | None) -> None:
    if record is not None and (named := another_profile(job, record)) is not None:
        # Writing this message's paths to another profile than the job's would corrupt both.
        raise InvalidMessage(f"profileId: the job record belongs to profile {named}, not {job.profile_id}")


def another_profile(job: Job, record: JobRecord) -> str | None:
    """The profile the record names when it is not the message's, as text; None when it is the same or
    names none. A profileId that does not read as an id (a list, a flag: another writer's) names some
    other profile too, as it always has: the message is refused, not the record."""
    if record.profile_id is not None:
        return record.profile_id if record.profile_id != job.profile_id else None
    stored = record.get("profileId")  # unreadable, or absent: the stored value says which
    return str(stored) if stored and str(stored) != job.profile_id else None


def refuse_recorded_failure(record: JobRecord | None, message: Message, max_failed_attempts: int) -> None:
    failed = recorded_failure(record, message, max_failed_attempts)
    if failed is not None:
        log.warning("job.already_failed", error_type=failed.error_type,
                    note="redelivery of a permanently failed message: dead-lettered again without work")
        raise failed


def recorded_failure(record: JobRecord | None, message: Message,
                     max_failed_attempts: int | None = None) -> AlreadyFailed | None:
    """The permanent failure this message already met (see the module docstring), or None.

    A retryable error that brought the job's failed attempts to ``max_failed_attempts`` counts as
    permanent: its message was dead-lettered by the attempt that recorded it.
    """
    error = record.error if record is not None else None
    if record is None or error is None or record.status != ERROR:
        return None
    spent = (error.retryable is True and max_failed_attempts is not None
             and failed_attempts(record) >= max_failed_attempts)
    if error.retryable is not False and not spent:
        return None
    if error.dead_lettered or message.receive_count < 2:
        return None
    if error.message_id != message.message_id:
        # Another message for the job (a resubmit), or an error no message met (recorded before any
        # claim): this message has not failed, so it is worked on.
        return None
    return AlreadyFailed(error.type or "PermanentError", error.message or "")


def refuse_malformed(store: Store, job: Job, record: JobRecord | None, profile: ProfileRecord | None) -> None:
    """Dead-letter, before any claim, a job whose records hold a field the worker decides on in a
    shape it never writes (``MalformedRecord``): no retry mends it, and read further in it would
    fail as an ``UnexpectedError``, retried until the DLQ.

    The reason goes into the DLQ copy and the log, and onto the job record when that takes the
    write: the error write replaces a malformed lease, history or failedAttempts, but a record
    under a live lease elsewhere, final, or holding a time no store can encode, keeps what it holds.
    """
    if record is not None and another_profile(job, record) is not None:
        return  # a message naming another profile: InvalidMessage, just below, writing nothing
    problems = unworkable(record, profile)
    if not problems:
        return
    error = MalformedRecord(job.job_id, problems)
    try:
        recorded = store.record_error(job.job_id, token=None, error_type=error.error_type,
                                      message=str(error)[:ERROR_MESSAGE_MAX_CHARS], retryable=False)
    except Exception as exc:  # noqa: BLE001 - the record may be beyond writing: the DLQ copy still says why
        log.warning("job.malformed_record_not_recorded", error=f"{type(exc).__name__}: {exc}")
        recorded = False
    log.error("job.malformed_record", problems=problems, recorded_on_job=recorded,
              note="written by something other than the worker: dead-lettered; fix the record, then redrive")
    raise error


# --- the claim and its end


def held(record: JobRecord | None, message: Message, store_now: datetime | None) -> Acknowledged:
    """Another worker holds a live lease on the job: is this delivery a duplicate, or its own message?"""
    holder = record.lease if record is not None else None
    if holder is not None and holder.message_id == message.message_id:
        # The holder's SQS lease on this very message lapsed, so SQS handed it to us. Deleting it
        # would leave the job with no message if the holder (which will stop) commits nothing.
        # Come back just after the holder's record lease ends, not after the generic backoff.
        expires_at = holder.expires_at
        # On the store's clock, which set expiresAt: this host's clock may be off.
        now = store_now or utc_now()
        wait_s = (expires_at - now).total_seconds() + 5 if expires_at else None
        raise JobBusy(f"message is held by {holder.owner} under an expired SQS lease; "
                      "retrying once its record lease ends", retry_after_s=wait_s)
    log.warning("job.duplicate_delivery", holder=holder.owner if holder is not None else None,
                note="another message for this job is being worked on; acknowledged without work")
    return Acknowledged.DUPLICATE


def release(attempt: Attempt) -> None:
    """Let go of the job lease, fenced on the attempt's token (a no-op once it is not ours)."""
    try:
        attempt.release()
    except WorkerError as release_exc:
        log.warning("job.release_failed", error=str(release_exc))


def record_error(attempt: Attempt, exc: WorkerError, *, retries_spent: bool = False) -> bool:
    """Record the failure on the job; whether it was written. A failure to record never hides the
    original error. ``retries_spent``: it spent the job's last retry (``rules.errored``)."""
    try:
        return attempt.fail(exc.error_type, str(exc)[:ERROR_MESSAGE_MAX_CHARS], retryable=exc.retryable,
                            retries_spent=retries_spent)
    except Exception as record_exc:  # noqa: BLE001 - a record another writer mangled may fail any way
        log.error("job.record_error_failed", error=f"{type(record_exc).__name__}: {record_exc}",
                  original=str(exc))
        return False
