"""One claimed attempt at a job: its fenced writes (``Attempt``, what ``Store.claim`` hands back), and
what it keeps up in the store while it works: its record lease and its progress.

An ``Attempt`` writes through ``FencedWrites``, the store methods it calls: ``Store``
(worker/voice/records/store.py) has them all, and this module never imports it (the store imports
this one, for ``Claim``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from worker.core.errors import LeaseLost, Stopped
from worker.core.metrics import NULL_METRICS, SECONDS, Metrics
from worker.core.stop import StopSignal
from worker.voice.records.errors import StaleWrite, StoreError
from worker.voice.records.training import (
    SERIES_MAX_NAMES,
    PlannedStage,
    add_point,
    eta_s,
    overall_percent,
    read_series,
)

log = structlog.get_logger(__name__)

PROGRESS_MIN_INTERVAL_S = 2.0
PROGRESS_LOG_INTERVAL_S = 60.0
# What ProgressReporter emits (worker.voice.metrics lists every metric name of the voice worker):
STAGE_DURATION = "StageDuration"  # a stage's first progress report to its first 100 %, per Stage
STAGE_DIMENSION = "Stage"
# The latest value of these METRIC names, per Stage, at each ``stage.progress`` line and at the stage's
# end: a fixed set, so that a trainer's own names never become CloudWatch metrics (each one billed).
# Each is the first of its names the stage printed: the stand-in's ``loss``, the Coqui trainer's
# generator total ``loss_gen_total`` and validation ``val_score`` (lower is better, as a loss).
TRAINING_METRICS: Mapping[str, tuple[tuple[str, ...], str]] = {
    "TrainingLoss": (("loss", "loss_gen_total"), "None"),
    "ValidationLoss": (("val_loss", "val_score"), "None"),
    "LearningRate": (("lr",), "None"),
    "StepTime": (("step_time_s",), SECONDS),
}


class TrainerClock:
    """Wall time the attempt spent in trainer stages: its GPU-seconds, the cost a job is billed in.

    Fed the attempt's progress reports: a step's first report starts it, its 100 % (or another
    step's report) ends it. The worker's own steps (downloads, dataset, commit) hold no GPU and are
    not counted. Written to the attempt's history entry with each progress write and renewal, so an
    attempt that dies unannounced has its time on record up to its last heartbeat.
    """

    # The store makes each attempt's clock; a test that needs time to pass on its own clock swaps this.
    default_clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, clock: Callable[[], float] | None = None):
        self._clock = clock or self.default_clock
        self._lock = threading.Lock()  # fed on the job's thread, read on the heartbeat's
        self._done_s = 0.0
        self._running_since: tuple[str, float] | None = None

    def observe(self, step: str, percent: float, *, trainer: bool) -> None:
        """A progress report of ``step``; ``trainer``: it is a trainer stage, not a step of the worker's own."""
        now = self._clock()
        with self._lock:
            if self._running_since is not None and (step != self._running_since[0] or percent >= 100):
                self._done_s += now - self._running_since[1]
                self._running_since = None
            if self._running_since is None and percent < 100 and trainer:
                self._running_since = (step, now)

    def seconds(self) -> float:
        with self._lock:
            running = self._running_since
            return self._done_s + (self._clock() - running[1] if running is not None else 0.0)


class FencedWrites(Protocol):
    """What an ``Attempt`` asks of the store: its writes, each fenced on the claim's token, as ``Store``
    declares them (and documents them)."""

    def renew_lease(self, job_id: str, token: str, lease_s: float, gpu_seconds: float | None = None) -> bool: ...

    def set_progress(self, job_id: str, token: str, stage: str, percent: float,
                     gpu_seconds: float | None = None, *, detail: Mapping[str, Any] | None = None,
                     series: Mapping[str, list] | None = None) -> None: ...

    def record_note(self, job_id: str, token: str, stage: str, text: str) -> None: ...

    def record_mirror(self, job_id: str, token: str, item: str, sha256_hex: str) -> None: ...

    def record_quality(self, job_id: str, token: str, quality: dict) -> None: ...

    def record_dataset(self, job_id: str, token: str, dataset: dict) -> None: ...

    def mark_refused(self, job_id: str, token: str, *, error_type: str, message: str, failed: Sequence[str],
                     quality: dict | None = None, gpu_seconds: float | None = None) -> None: ...

    def record_base_model(self, job_id: str, token: str, base_model: dict) -> None: ...

    def write_profile_base_model(self, profile_id: str, token: str, base_model: dict, *, job_id: str) -> None: ...

    def write_profile_quality(self, profile_id: str, token: str, quality: dict, *, job_id: str) -> None: ...

    def record_error(self, job_id: str, *, token: str | None, error_type: str, message: str,
                     retryable: bool, gpu_seconds: float | None = None, retries_spent: bool = False) -> bool: ...

    def write_paths(self, profile_id: str, token: str, model_paths: dict, s3_paths: dict, *,
                    job_id: str) -> None: ...

    def mark_profile_completed(self, profile_id: str, token: str, *, job_id: str) -> None: ...

    def mark_job_completed(self, job_id: str, token: str, gpu_seconds: float | None = None,
                           artifacts: Sequence[str] | None = None) -> None: ...

    def mark_cancelled(self, job_id: str, token: str, gpu_seconds: float | None = None) -> None: ...

    def release_lease(self, job_id: str, token: str, gpu_seconds: float | None = None) -> bool: ...

    def release_for_host_fault(self, job_id: str, token: str, reason: str,
                               gpu_seconds: float | None = None) -> bool: ...


@dataclass(frozen=True)
class Attempt:
    """One claimed attempt at a job: every write it may make, each fenced on its claim's token.

    Each raises ``StaleWrite`` once the token is no longer the job's (or the profile's) and
    ``StoreError`` when the store cannot be reached; ``renew``, ``release`` and ``fail`` return
    False or the cancel flag as the store methods they stand for.
    """

    store: FencedWrites
    job_id: str
    profile_id: str | None
    token: str
    lease_s: float
    trainer_clock: TrainerClock = field(default_factory=TrainerClock, compare=False, repr=False)

    def renew(self) -> bool:
        """Extend the record lease; returns the job's cancelRequested flag."""
        return self.store.renew_lease(self.job_id, self.token, self.lease_s, self.trainer_clock.seconds())

    def progress(self, stage: str, percent: float, *, detail: Mapping[str, Any] | None = None,
                 series: Mapping[str, list] | None = None) -> None:
        """Write the job's progress; ``detail`` (``rules.with_progress``) and the stage's metric
        ``series`` go in the same fenced write."""
        if detail is None and series is None:
            self.store.set_progress(self.job_id, self.token, stage, percent, self.trainer_clock.seconds())
        else:
            self.store.set_progress(self.job_id, self.token, stage, percent, self.trainer_clock.seconds(),
                                    detail=detail, series=series)

    def note(self, stage: str, text: str) -> None:
        """Keep a stage's note on the attempt's history entry (``rules.with_note``)."""
        self.store.record_note(self.job_id, self.token, stage, text)

    def vouch_mirror(self, item: str, sha256_hex: str) -> None:
        """Record on the attempt's history entry what it mirrored to S3 (see ``MirrorLedger``)."""
        self.store.record_mirror(self.job_id, self.token, item, sha256_hex)

    def record_quality(self, quality: dict) -> None:
        """Keep the attempt's evaluation figures on the job record (``rules.with_quality``)."""
        self.store.record_quality(self.job_id, self.token, quality)

    def record_dataset(self, dataset: dict) -> None:
        """Keep what data preparation kept and left out on the job record (``rules.with_dataset``)."""
        self.store.record_dataset(self.job_id, self.token, dataset)

    def refuse(self, error_type: str, message: str, failed: Sequence[str], quality: dict | None) -> None:
        """End the job ``refused`` (final; below the quality gate): nothing of it is committed."""
        self.store.mark_refused(self.job_id, self.token, error_type=error_type, message=message, failed=failed,
                                quality=quality, gpu_seconds=self.trainer_clock.seconds())

    def record_base_model(self, base_model: dict) -> None:
        """Name on the job record the base model this attempt's stages start from."""
        self.store.record_base_model(self.job_id, self.token, base_model)

    def write_profile_base_model(self, base_model: dict) -> None:
        self.store.write_profile_base_model(self._profile(), self.token, base_model, job_id=self.job_id)

    def write_profile_quality(self, quality: dict) -> None:
        self.store.write_profile_quality(self._profile(), self.token, quality, job_id=self.job_id)

    def write_paths(self, model_paths: dict, s3_paths: dict) -> None:
        self.store.write_paths(self._profile(), self.token, model_paths, s3_paths, job_id=self.job_id)

    def complete_profile(self) -> None:
        self.store.mark_profile_completed(self._profile(), self.token, job_id=self.job_id)

    def complete(self, artifacts: Sequence[str] | None = None) -> None:
        """The commit marker: the job record says completed, and which artifact keys it committed."""
        self.store.mark_job_completed(self.job_id, self.token, self.trainer_clock.seconds(), artifacts)

    def cancel(self) -> None:
        self.store.mark_cancelled(self.job_id, self.token, self.trainer_clock.seconds())

    def release(self) -> bool:
        return self.store.release_lease(self.job_id, self.token, self.trainer_clock.seconds())

    def release_for_host_fault(self, reason: str) -> bool:
        """Let go of the job because the host failed it: no failure recorded, ``hostFaults`` one up."""
        return self.store.release_for_host_fault(self.job_id, self.token, reason, self.trainer_clock.seconds())

    def fail(self, error_type: str, message: str, *, retryable: bool, retries_spent: bool = False) -> bool:
        return self.store.record_error(self.job_id, token=self.token, error_type=error_type,
                                       message=message, retryable=retryable,
                                       gpu_seconds=self.trainer_clock.seconds(), retries_spent=retries_spent)

    def _profile(self) -> str:
        if not self.profile_id:
            raise StaleWrite(f"job {self.job_id} names no profile: there is no profile to write")
        return self.profile_id


class ProgressReporter:
    """Writes the job's progress, at most every ``min_interval_s`` unless the stage changed or it finished.

    It also times each stage, from its first report to its first 100 %, as the StageDuration metric.
    With a ``plan`` (the job's steps in order, ``training.plan_of``) each write says which step of how
    many is running, the job's overall percent and an ETA from the rate observed since the stage's
    first report above 0 (a resumed stage starts high: its jump is not a rate). A stage's ``METRIC``
    lines (``metric``) become a bounded series per name on the record, written with the progress
    (fenced on the same token), and its latest values; ``earlier`` is the record's series when the
    attempt began, so a retry continues the curve. ``tick`` (the stage runner's loop calls it) writes
    what the rate limit held back, and logs ``stage.progress`` every ``log_interval_s`` of a trainer
    stage, when it also emits the latest values of ``TRAINING_METRICS``.
    """

    def __init__(self, attempt: Attempt, stop: StopSignal,
                 min_interval_s: float = PROGRESS_MIN_INTERVAL_S, clock=time.monotonic,
                 metrics: Metrics = NULL_METRICS, own_steps: Collection[str] = (), *,
                 plan: Sequence[PlannedStage] = (), log_interval_s: float = PROGRESS_LOG_INTERVAL_S,
                 earlier: object = None):
        self._attempt, self._job_id, self._stop = attempt, attempt.job_id, stop
        self._min_interval_s, self._clock = min_interval_s, clock
        self._log_interval_s = log_interval_s
        self._last: tuple[str, float] | None = None
        self._metrics = metrics
        self._stage_started: dict[str, float] = {}
        self._stages_timed: set[str] = set()
        self._stages_emitted: set[str] = set()
        self._own_steps = own_steps  # the worker's own steps (downloads, dataset): not GPU time
        self._plan = tuple(plan)
        self._index = {planned.name: number for number, planned in enumerate(self._plan)}
        self._series = read_series(earlier)
        self._stage: str | None = None
        self._percent = 0.0
        self._step: int | None = None
        self._latest: dict[str, float] = {}
        self._anchor: tuple[float, float] | None = None  # (clock, percent) of the stage's first report above 0
        self._rate: float | None = None  # percent per second since the anchor
        self._logged_at = 0.0
        self._pending = False  # something changed that is not written yet
        self.writes = 0

    def _time_stage(self, stage: str, percent: float, now: float) -> None:
        started = self._stage_started.setdefault(stage, now)
        if percent >= 100 and stage not in self._stages_timed:
            self._stages_timed.add(stage)
            self._metrics.seconds(STAGE_DURATION, now - started, dimensions={STAGE_DIMENSION: stage},
                                  jobId=self._job_id)

    def _enter(self, stage: str, now: float) -> None:
        self._stage, self._percent, self._step, self._latest = stage, 0.0, None, {}
        self._anchor, self._rate, self._logged_at = None, None, now
        self._stage_started.setdefault(stage, now)

    def __call__(self, stage: str, percent: float) -> None:
        now = self._clock()
        # Timed before the rate limit: a report that is not written still marks when a stage ran.
        self._time_stage(stage, percent, now)
        self._attempt.trainer_clock.observe(stage, percent, trainer=stage not in self._own_steps)
        if stage != self._stage:
            self._enter(stage, now)
        self._observe_rate(percent, now)
        self._percent, self._pending = percent, True
        if self._last is not None:
            last_stage, last_at = self._last
            if stage == last_stage and percent < 100 and now - last_at < self._min_interval_s:
                return
        self._write(now)
        if percent >= 100 and stage not in self._stages_emitted:
            self._stages_emitted.add(stage)
            self._emit_latest()  # the stage's final values

    def _observe_rate(self, percent: float, now: float) -> None:
        if self._anchor is None:
            if percent > 0:
                self._anchor = (now, percent)
        elif percent > self._anchor[1] and now > self._anchor[0]:
            self._rate = (percent - self._anchor[1]) / (now - self._anchor[0])

    def metric(self, stage: str, step: int, values: Mapping[str, float]) -> None:
        """A stage's ``METRIC`` line: onto each name's series, written with the next progress write."""
        if stage != self._stage:
            self._enter(stage, self._clock())
        series = self._series.setdefault(stage, {})
        for name, value in values.items():
            if name not in series and len(series) >= SERIES_MAX_NAMES:
                continue
            add_point(series.setdefault(name, []), step, value)
            self._latest[name] = value
        self._step, self._pending = step, True

    def tick(self) -> None:
        """Write what the rate limit held back once the interval has passed; log at the log interval."""
        if self._stage is None:
            return
        now = self._clock()
        if self._pending and (self._last is None or now - self._last[1] >= self._min_interval_s):
            self._write(now)
        if self._stage not in self._own_steps and now - self._logged_at >= self._log_interval_s:
            self._logged_at = now
            self._log(now)
            self._emit_latest()

    def flush(self) -> None:
        """Write what the rate limit held back, now: the stage runner calls it once a stage exited, so a
        failed stage's last metrics reach the record too."""
        if self._stage is not None and self._pending:
            self._write(self._clock())

    def detail(self, now: float | None = None) -> dict[str, Any]:
        """What the progress write says besides the stage and percent (``rules.with_progress``)."""
        now = self._clock() if now is None else now
        stage = self._stage or ""
        found: dict[str, Any] = {"stageElapsedS": round(max(0.0, now - self._stage_started.get(stage, now)), 3)}
        if self._step is not None:
            found["step"] = self._step
        if self._latest:
            found["latest"] = dict(self._latest)
        index = self._index.get(stage)
        if index is not None:
            planned = self._plan[index]
            found.update(stageIndex=index + 1, stageCount=len(self._plan),
                         overallPercent=overall_percent(self._plan, index, self._percent),
                         etaS=eta_s(self._plan, index, self._percent, self._rate))
            if planned.trainer:
                # What the stage was told to run on (a cuda stage exits 70 without one): the cost's unit.
                found["device"] = planned.device or "cpu"
        return found

    def _write(self, now: float) -> None:
        stage = self._stage or ""
        series = self._series.get(stage)
        try:
            self._attempt.progress(stage, self._percent, detail=self.detail(now),
                                   series=None if series is None else {k: [list(p) for p in v]
                                                                       for k, v in series.items()})
        except StaleWrite as exc:
            self._stop.set(Stopped.LEASE_LOST, "claim token replaced")
            raise LeaseLost(f"progress write refused: {exc}") from exc
        except StoreError as exc:
            log.warning("job.progress_write_failed", error=str(exc))  # progress is advisory
            return
        self._last = (stage, now)
        self._pending = False
        self.writes += 1

    def _log(self, now: float) -> None:
        found = self.detail(now)
        log.info("stage.progress", job_id=self._job_id, stage=self._stage, step=found.get("step"),
                 percent=round(self._percent, 2), stage_index=found.get("stageIndex"),
                 stage_count=found.get("stageCount"), overall_percent=found.get("overallPercent"),
                 eta_s=found.get("etaS"), elapsed_s=found["stageElapsedS"], latest=found.get("latest", {}))

    def _emit_latest(self) -> None:
        values = {metric: (self._latest[found], unit) for metric, (names, unit) in TRAINING_METRICS.items()
                  if (found := next((name for name in names if name in self._latest), None)) is not None}
        if values and self._stage is not None:
            self._metrics.emit(values, dimensions={STAGE_DIMENSION: self._stage}, jobId=self._job_id,
                               step=self._step)

    def note(self, stage: str, text: str) -> None:
        """A stage's note (clips it left out, say) onto the attempt's history entry: what an operator
        and the product read on the record. Advisory, as progress is: a failed write is a warning."""
        try:
            self._attempt.note(stage, text)
        except (StaleWrite, StoreError) as exc:
            log.warning("job.note_write_failed", stage=stage, error=str(exc))


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
