"""One claimed attempt at a job: its fenced writes (``Attempt``, what ``Store.claim`` hands back), and
what it keeps up in the store while it works: its record lease and its progress."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from worker.core.errors import LeaseLost, StaleWrite, Stopped, StoreError
from worker.core.metrics import NULL_METRICS, STAGE_DIMENSION, STAGE_DURATION, Metrics
from worker.core.stop import StopSignal

if TYPE_CHECKING:
    from worker.voice.records.store import Store

log = structlog.get_logger(__name__)

PROGRESS_MIN_INTERVAL_S = 2.0


@dataclass(frozen=True)
class Attempt:
    """One claimed attempt at a job: every write it may make, each fenced on its claim's token.

    Each raises ``StaleWrite`` once the token is no longer the job's (or the profile's) and
    ``StoreError`` when the store cannot be reached; ``renew``, ``release`` and ``fail`` return
    False or the cancel flag as the store methods they stand for.
    """

    store: Store
    job_id: str
    profile_id: str | None
    token: str
    lease_s: float

    def renew(self) -> bool:
        """Extend the record lease; returns the job's cancelRequested flag."""
        return self.store.renew_lease(self.job_id, self.token, self.lease_s)

    def progress(self, stage: str, percent: float) -> None:
        self.store.set_progress(self.job_id, self.token, stage, percent)

    def write_paths(self, model_paths: dict, s3_paths: dict) -> None:
        self.store.write_paths(self._profile(), self.token, model_paths, s3_paths, job_id=self.job_id)

    def complete_profile(self) -> None:
        self.store.mark_profile_completed(self._profile(), self.token, job_id=self.job_id)

    def complete(self) -> None:
        """The commit marker: the job record says completed."""
        self.store.mark_job_completed(self.job_id, self.token)

    def cancel(self) -> None:
        self.store.mark_cancelled(self.job_id, self.token)

    def release(self) -> bool:
        return self.store.release_lease(self.job_id, self.token)

    def fail(self, error_type: str, message: str, *, retryable: bool) -> bool:
        return self.store.record_error(self.job_id, token=self.token, error_type=error_type,
                                       message=message, retryable=retryable)

    def _profile(self) -> str:
        if not self.profile_id:
            raise StaleWrite(f"job {self.job_id} names no profile: there is no profile to write")
        return self.profile_id


class ProgressReporter:
    """Writes the job's progress, at most every ``min_interval_s`` unless the stage changed or it finished.

    It also times each stage, from its first report to its first 100 %, as the StageDuration metric.
    """

    def __init__(self, attempt: Attempt, stop: StopSignal,
                 min_interval_s: float = PROGRESS_MIN_INTERVAL_S, clock=time.monotonic,
                 metrics: Metrics = NULL_METRICS):
        self._attempt, self._job_id, self._stop = attempt, attempt.job_id, stop
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
            self._attempt.progress(stage, percent)
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

    def __init__(self, attempt: Attempt, stop: StopSignal, *, margin_s: float = 0.0, clock=time.monotonic,
                 claim_sent_s: float | None = None, honour_cancel: bool = True):
        self._attempt, self._lease_s, self._stop = attempt, attempt.lease_s, stop
        self._margin_s, self._clock = margin_s, clock
        # Counted from when the claim was sent (``claim_sent_s``, on ``clock``), so never later than the
        # store's own expiry even when the claim's second swap took a while; else from now.
        self._expires_at_s = (clock() if claim_sent_s is None else claim_sent_s) + self._lease_s
        # False once an earlier attempt began the commit: a cancel is then too late (see the handler).
        self._honour_cancel = honour_cancel
        self._lock = threading.Lock()
        self._active = True

    def renew(self) -> None:
        """One renewal. Refused, or failing until the record lease is about to lapse: lease lost."""
        with self._lock:
            if not self._active:
                return
            sent_at_s = self._clock()
            try:
                cancel_requested = self._attempt.renew()
            except StaleWrite as exc:
                raise LeaseLost(f"store lease renewal refused: {exc}") from exc
            except StoreError as exc:
                # Another worker may claim the job once the record lease lapses; the margin (one
                # heartbeat) makes sure we stop before that, not a tick after.
                if self._clock() + self._margin_s >= self._expires_at_s:
                    raise LeaseLost(f"record lease lapsing without a successful renewal: {exc}") from exc
                raise
            self._expires_at_s = sent_at_s + self._lease_s
        if cancel_requested and self._honour_cancel and self._stop.set(Stopped.CANCELLED,
                                                                        "cancelRequested on the job record"):
            log.info("job.cancel_noticed")

    def ensure_live(self) -> None:
        """Raise ``LeaseLost`` once the record lease may be about to lapse, judged on the local clock
        from the last successful renewal (with the margin): a check cheap enough for every upload part."""
        # Capped at half the lease: a margin as long as the lease (a misconfigured test) would stop
        # every upload, although a renewal has just succeeded.
        if self._clock() + min(self._margin_s, self._lease_s / 2) >= self._expires_at_s:
            raise LeaseLost("record lease past its local deadline without a successful renewal")

    def end(self) -> None:
        with self._lock:
            self._active = False
