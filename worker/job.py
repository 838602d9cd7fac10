"""The voice-cloning job handler: everything between a received message and the decision to ack it.

    parse -> completion check -> claim (fenced lease) -> train -> persist in commit order -> return

Persisting, in this order, each step only after the previous one succeeded:

    1 verify the five local files        (exist, non-empty)
    2 upload all five to S3              (deterministic keys; a matching object is reused)
    3 write local and S3 paths           (fenced on our claim token)
    4 mark the profile completed         (fenced)
    5 mark the job completed             (fenced: the commit marker)

Returning tells the loop to delete the message; raising tells it to retry, dead-letter or release.
Every write after the claim carries the claim's token, so a worker whose lease was taken over can no
longer change anything: its writes match no record and raise ``StaleWrite``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from worker.artifacts import ArtifactUploader, artifact_key, verify_local
from worker.faults import NEVER, CrashPoints
from worker.errors import (
    InvalidMessage,
    JobBusy,
    LeaseLost,
    StaleWrite,
    Stopped,
    StoreError,
    TimeLimitExceeded,
    UnknownJob,
    WorkerError,
)
from worker.lease import Lease
from worker.message import Job, job_id_hint, parse_job
from worker.metrics import NULL_METRICS, STAGE_DIMENSION, STAGE_DURATION, Metrics
from worker.queue import Message
from worker.stop import StopSignal
from worker.store import ASSET_KEYS, Store, is_complete

log = structlog.get_logger(__name__)

# train(job, work_dir, stop, progress) -> {asset: local path}; the pipeline in production.
Train = Callable[[Job, Path, StopSignal, Callable[[str, float], None]], dict[str, Path]]

PROGRESS_MIN_INTERVAL_S = 2.0
OUTPUT_DIR = "output"  # the pipeline's artifact directory inside the job's work dir


def work_dir_for(work_root: Path, job: Job) -> Path:
    """``$WORK_ROOT/<environment>/<directoryName>/<jobId>``: built only from validated names."""
    root = work_root.resolve()
    path = (root / job.environment / job.directory_name / job.job_id).resolve()
    if root not in path.parents:
        raise InvalidMessage(f"work directory {path} escapes WORK_ROOT")
    return path


def reusable_paths(profile: dict | None, output_dir: Path) -> dict[str, Path] | None:
    """The profile's local model paths from an earlier attempt of this job, when all five verify on disk."""
    stored = (profile or {}).get("modelPaths") or {}
    if not all(stored.get(k) for k in ASSET_KEYS):
        return None
    paths = {k: Path(stored[k]) for k in ASSET_KEYS}
    if not all(output_dir in p.parents for p in paths.values()):
        return None
    try:
        verify_local(paths)
    except WorkerError:
        return None
    return paths


class ProgressReporter:
    """Writes the job's progress, at most every ``min_interval_s`` unless the stage changed or it finished.

    It also times each stage, from its first report to its first 100 %, as the StageDuration metric.
    """

    def __init__(self, store: Store, job_id: str, token: str, stop: StopSignal,
                 min_interval_s: float = PROGRESS_MIN_INTERVAL_S, clock=time.monotonic,
                 metrics: Metrics = NULL_METRICS):
        self._store, self._job_id, self._token, self._stop = store, job_id, token, stop
        self._min_interval_s, self._clock = min_interval_s, clock
        self._last: tuple[str, float] | None = None
        self._metrics = metrics
        self._stage_started: dict[str, float] = {}
        self._stages_timed: set[str] = set()
        self.writes = 0

    def _time_stage(self, stage: str, percent: float, now: float) -> None:
        started = self._stage_started.setdefault(stage, now)
        if percent >= 100 and stage not in self._stages_timed:
            self._stages_timed.add(stage)
            self._metrics.seconds(STAGE_DURATION, now - started, dimensions={STAGE_DIMENSION: stage},
                                  jobId=self._job_id)

    def __call__(self, stage: str, percent: float) -> None:
        now = self._clock()
        # Timed before the rate limit: a report that is not written still marks when a stage ran.
        self._time_stage(stage, percent, now)
        if self._last is not None:
            last_stage, last_at = self._last
            if stage == last_stage and percent < 100 and now - last_at < self._min_interval_s:
                return
        try:
            self._store.set_progress(self._job_id, self._token, stage, percent)
        except StaleWrite as exc:
            self._stop.set(Stopped.LEASE_LOST, "claim token replaced")
            raise LeaseLost(f"progress write refused: {exc}") from exc
        except StoreError as exc:
            log.warning("job.progress_write_failed", error=str(exc))  # progress is advisory
            return
        self._last = (stage, now)
        self.writes += 1


class StoreLease:
    """Renews the job's lease in the store on each heartbeat tick, until the attempt's final write.

    The final writes (completed, cancelled, error, released) clear the lease, after which a renewal
    would be refused and read as a lost lease. ``end()`` waits for a renewal in flight, so none can
    land after the final write.
    """

    def __init__(self, store: Store, job_id: str, token: str, lease_s: float, stop: StopSignal):
        self._store, self._job_id, self._token, self._lease_s, self._stop = store, job_id, token, lease_s, stop
        self._lock = threading.Lock()
        self._active = True

    def renew(self) -> None:
        with self._lock:
            if not self._active:
                return
            try:
                cancel_requested = self._store.renew_lease(self._job_id, self._token, self._lease_s)
            except StaleWrite as exc:
                raise LeaseLost(f"store lease renewal refused: {exc}") from exc
        if cancel_requested and self._stop.set(Stopped.CANCELLED, "cancelRequested on the job record"):
            log.info("job.cancel_noticed")

    def end(self) -> None:
        with self._lock:
            self._active = False


class VoiceJobHandler:
    def __init__(self, *, store: Store, uploader: ArtifactUploader, train: Train, work_root: Path,
                 s3_prefix: str, worker_id: str, lease_s: float, crash_points: CrashPoints = NEVER,
                 metrics: Metrics = NULL_METRICS):
        self._store = store
        self._uploader = uploader
        self._train = train
        self._work_root = Path(work_root)
        self._s3_prefix = s3_prefix
        self._worker_id = worker_id
        # The record's lease lasts as long as the message's visibility: both lapse together.
        self._lease_s = lease_s
        self._crash = crash_points.reached
        self._metrics = metrics

    def __call__(self, message: Message, lease: Lease) -> str:
        try:
            job = parse_job(message.body)
        except InvalidMessage as exc:
            hinted = job_id_hint(message.body)
            if hinted:
                self._record_error(hinted, None, exc)
            raise
        structlog.contextvars.bind_contextvars(job_id=job.job_id)
        try:
            return self._handle(job, message, lease)
        finally:
            structlog.contextvars.unbind_contextvars("job_id")

    def _handle(self, job: Job, message: Message, lease: Lease) -> str:
        store = self._store
        record, profile = store.get_job(job.job_id), store.get_profile(job.profile_id)
        if is_complete(record, profile):
            log.info("job.already_complete", note="redelivery acknowledged without work")
            return "already_complete"
        token = secrets.token_hex(16)
        claim = store.claim(job.job_id, owner=self._worker_id, token=token, lease_s=self._lease_s,
                            message_id=message.message_id)
        if claim.outcome == "missing":
            raise UnknownJob(f"no job record {job.job_id} (yet)")
        if claim.outcome in ("completed", "cancelled"):
            log.info("job.nothing_to_do", status=claim.outcome)
            return claim.outcome
        if claim.outcome == "held":
            return self._held(claim.job or {}, message)
        log.info("job.claimed", attempt=(claim.job or {}).get("attempts"))
        store_lease = StoreLease(store, job.job_id, token, self._lease_s, lease.stop)
        lease.on_renew(store_lease.renew)
        if claim.cancel_requested:
            store_lease.end()
            store.mark_cancelled(job.job_id, token)
            log.info("job.cancelled", when="at claim")
            return "cancelled"
        try:
            paths = self._artifacts(job, profile, lease.stop, token)
            self._persist(job, token, paths, lease.stop, store_lease)
        except Stopped as exc:
            store_lease.end()
            return self._stopped(job, token, exc)
        except (LeaseLost, StaleWrite):
            raise  # not ours any more: write nothing
        except WorkerError as exc:
            store_lease.end()
            self._record_error(job.job_id, token, exc)
            raise
        log.info("job.completed")
        return "completed"

    # --- steps
    @staticmethod
    def _held(record: dict, message: Message) -> str:
        """Another worker holds a live lease on the job: is this delivery a duplicate, or its own message?"""
        holder = record.get("lease") or {}
        if holder.get("messageId") == message.message_id:
            # The holder's SQS lease on this very message lapsed, so SQS handed it to us. Deleting it
            # would leave the job with no message if the holder (which will stop) commits nothing.
            raise JobBusy(f"message is held by {holder.get('owner')} under an expired SQS lease; "
                          "retrying once its record lease ends")
        log.warning("job.duplicate_delivery", holder=holder.get("owner"),
                    note="another message for this job is being worked on; acknowledged without work")
        return "duplicate"

    def _artifacts(self, job: Job, profile: dict | None, stop: StopSignal, token: str) -> dict[str, Path]:
        work_dir = work_dir_for(self._work_root, job)
        reused = reusable_paths(profile, work_dir / OUTPUT_DIR)
        if reused is not None:
            log.info("job.reusing_verified_artifacts")
            return reused
        progress = ProgressReporter(self._store, job.job_id, token, stop, metrics=self._metrics)
        return self._train(job, work_dir, stop, progress)

    def _persist(self, job: Job, token: str, paths: dict[str, Path], stop: StopSignal,
                 store_lease: StoreLease) -> None:
        # Past this point only a lost lease stops us: a cancel or shutdown now would strand half a commit.
        stop.raise_if_set()
        verify_local(paths)                                                      # 1
        output_dir = work_dir_for(self._work_root, job) / OUTPUT_DIR
        keys = {
            name: artifact_key(self._s3_prefix, job.environment, job.profile_id, job.job_id,
                               path.relative_to(output_dir).as_posix())
            for name, path in paths.items()
        }
        s3_paths = self._uploader.upload_all(paths, keys)                         # 2
        self._crash("after_upload")
        self._check_lease(stop)
        model_paths = {name: str(path) for name, path in paths.items()}
        self._store.write_paths(job.profile_id, token, model_paths, s3_paths)    # 3
        self._crash("after_paths")
        self._check_lease(stop)
        self._store.mark_profile_completed(job.profile_id, token)                # 4
        self._crash("after_profile_completed")
        self._check_lease(stop)
        store_lease.end()
        self._store.mark_job_completed(job.job_id, token)                        # 5 commit marker
        self._crash("after_job_completed")

    @staticmethod
    def _check_lease(stop: StopSignal) -> None:
        if stop.reason == Stopped.LEASE_LOST:
            stop.raise_if_set()

    def _stopped(self, job: Job, token: str, exc: Stopped) -> str:
        if exc.reason == Stopped.CANCELLED:
            self._store.mark_cancelled(job.job_id, token)
            log.info("job.cancelled", when="during work")
            return "cancelled"
        if exc.reason == Stopped.SHUTDOWN:
            try:
                self._store.release_lease(job.job_id, token)
            except WorkerError as release_exc:  # the lease lapses on its own; the message is still released
                log.error("job.release_failed", error=str(release_exc))
            raise exc
        if exc.reason == Stopped.TIME_LIMIT:
            limit = TimeLimitExceeded(f"job ran past its time limit ({exc})")
            self._record_error(job.job_id, token, limit)
            raise limit from exc
        # Lease lost: no commit. Clearing our store lease (fenced: only if still ours) lets the next
        # delivery claim at once instead of waiting for it to expire.
        try:
            self._store.release_lease(job.job_id, token)
        except WorkerError as release_exc:
            log.warning("job.release_failed", error=str(release_exc))
        raise exc

    def _record_error(self, job_id: str, token: str | None, exc: WorkerError) -> None:
        """Record the failure on the job; a failure to record never hides the original error."""
        try:
            self._store.record_error(job_id, token=token, error_type=exc.error_type, message=str(exc)[:2000],
                                     retryable=exc.retryable)
        except WorkerError as record_exc:
            log.error("job.record_error_failed", error=str(record_exc), original=str(exc))

