"""The records store's one narrow interface: domain operations, each fenced, on the store's clock.

Reads of one record hand back the typed records of ``worker.voice.records.models`` (read tolerantly:
never an error for what a field holds, its problems on the record); writes take plain values and
documents, and change only the fields they name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from worker.voice.records import rules
from worker.voice.records.attempt import Attempt
from worker.voice.records.models import JobRecord, ProfileRecord

Clock = Callable[[], datetime]


@dataclass(frozen=True)
class Claim:
    outcome: rules.ClaimOutcome
    job: JobRecord | None
    cancel_requested: bool = False
    attempt: Attempt | None = None  # set when the outcome is CLAIMED
    # The store's clock when it decided: a HELD job's lease end is judged on it, never on ours.
    now: datetime | None = None




class Store(ABC):
    """Job and profile records. Fenced writes raise ``StaleWrite``; an unreachable store ``StoreError``.

    Every lease is stamped and judged on the store's clock (``now()``), never on a worker's own.
    """

    @abstractmethod
    def now(self) -> datetime:
        """The store's clock: what every lease stamp and every lease decision uses."""

    def clock_offset_s(self, local: Clock | None = None) -> float:
        """How far ``local`` (default: this host's clock) is behind the store's clock, in seconds."""
        return (self.now() - (local or rules.utc_now)()).total_seconds()

    @abstractmethod
    def get_job(self, job_id: str) -> JobRecord | None:
        """The job's record, read tolerantly (``models.read_job``); None when there is none."""

    @abstractmethod
    def get_profile(self, profile_id: str) -> ProfileRecord | None:
        """The profile's record, read tolerantly (``models.read_profile``); None when there is none."""

    @abstractmethod
    def claim(self, job_id: str, *, owner: str, token: str, lease_s: float,
              message_id: str | None = None) -> Claim:
        """Claim the job under ``token``; a CLAIMED outcome carries the ``Attempt`` to write with."""

    @abstractmethod
    def renew_lease(self, job_id: str, token: str, lease_s: float, gpu_seconds: float | None = None) -> bool:
        """Extend our lease (and note the attempt's trainer time so far); returns cancelRequested."""

    @abstractmethod
    def set_progress(self, job_id: str, token: str, stage: str, percent: float,
                     gpu_seconds: float | None = None, *, detail: Mapping[str, Any] | None = None,
                     series: Mapping[str, list] | None = None) -> None:
        """The job's progress (``rules.with_progress``): with ``detail`` (step, stage k of n, overall
        percent, ETA, latest metrics, device) and the stage's metric ``series``, in one fenced write."""

    @abstractmethod
    def record_note(self, job_id: str, token: str, stage: str, text: str) -> None:
        """Keep a stage's note on the attempt's own history entry (``rules.with_note``)."""

    @abstractmethod
    def record_mirror(self, job_id: str, token: str, item: str, sha256_hex: str) -> None:
        """Vouch, on the attempt's own history entry, for what it mirrored to S3 (``rules.with_mirror``)."""

    @abstractmethod
    def record_quality(self, job_id: str, token: str, quality: dict) -> None:
        """Keep the attempt's evaluation figures on the job (``rules.with_quality``), fenced on the token."""

    @abstractmethod
    def record_dataset(self, job_id: str, token: str, dataset: dict) -> None:
        """Keep what data preparation kept and left out on the job (``rules.with_dataset``), fenced."""

    @abstractmethod
    def mark_refused(self, job_id: str, token: str, *, error_type: str, message: str, failed: Sequence[str],
                     quality: dict | None = None, gpu_seconds: float | None = None) -> None:
        """The job ends ``refused`` (``rules.refused``: final, nothing committed), fenced on the token."""

    @abstractmethod
    def record_base_model(self, job_id: str, token: str, base_model: dict) -> None:
        """Name on the job the base model its stages start from (``BASE_MODEL``), fenced on the token."""

    @abstractmethod
    def write_profile_base_model(self, profile_id: str, token: str, base_model: dict, *, job_id: str) -> None:
        """Name on the profile the base its committed models were derived from; fenced as ``write_paths``."""

    @abstractmethod
    def write_profile_quality(self, profile_id: str, token: str, quality: dict, *, job_id: str) -> None:
        """Set the profile's ``quality`` (the committed models' figures); fenced as ``write_paths``."""

    @abstractmethod
    def record_error(self, job_id: str, *, token: str | None, error_type: str, message: str,
                     retryable: bool, gpu_seconds: float | None = None, retries_spent: bool = False) -> bool:
        """The job ``error`` (``rules.errored``); fenced on ``token`` when given. ``retries_spent``: the
        failure spent the last retry and the message is being dead-lettered (recorded as such at once)."""

    @abstractmethod
    def write_paths(self, profile_id: str, token: str, model_paths: dict, s3_paths: dict, *,
                    job_id: str) -> None:
        """Set the profile's paths; fenced on ``job_id``'s claim on the profile being ``token``."""

    @abstractmethod
    def mark_profile_completed(self, profile_id: str, token: str, *, job_id: str) -> None:
        """Set the profile completed; fenced as ``write_paths``."""

    @abstractmethod
    def mark_job_completed(self, job_id: str, token: str, gpu_seconds: float | None = None,
                           artifacts: Sequence[str] | None = None) -> None:
        """The commit marker (with the attempt's final trainer time, and the artifact keys the commit
        wrote to the profile: what ``rules.is_complete`` judges the job against)."""

    @abstractmethod
    def mark_cancelled(self, job_id: str, token: str, gpu_seconds: float | None = None) -> None: ...

    @abstractmethod
    def release_lease(self, job_id: str, token: str, gpu_seconds: float | None = None) -> bool: ...

    @abstractmethod
    def release_for_host_fault(self, job_id: str, token: str, reason: str, gpu_seconds: float | None = None) -> bool:
        """Release the lease as ``release_lease`` does, the attempt's history entry ending ``host_fault``
        with ``reason``, and the job's ``hostFaults`` count one up; False when the lease is not ours."""

    @abstractmethod
    def request_cancel(self, job_id: str) -> bool: ...

    @abstractmethod
    def submit(self, job: dict, profile: dict, idempotency_key: str | None = None) -> tuple[str, bool]: ...

    @abstractmethod
    def list_jobs(self, status: str | None = None, since: datetime | None = None,
                  limit: int = 50) -> list[dict]:
        """Up to ``limit`` jobs, newest first by ``createdAt``: only ``status`` ones when given, only
        those created at or after ``since`` when given (a job without ``createdAt`` then is not listed)."""

    @abstractmethod
    def find_stale(self, limit: int = 100) -> list[dict]:
        """Jobs left processing with no live lease (their worker died or let go), oldest first."""

    # --- the reconciler's operations (rules in worker.voice.records.recovery); each returns whether it wrote

    @abstractmethod
    def mark_enqueued(self, job_id: str, *, again: bool = False) -> bool:
        """Stamp ``enqueuedAt`` (``reenqueuedAt`` when ``again``) once a message for the job was sent."""

    @abstractmethod
    def find_unenqueued(self, older_than_s: float, limit: int = 100) -> list[dict]:
        """Pending jobs older than ``older_than_s`` with no message recorded as sent, oldest first."""

    @abstractmethod
    def mark_worker_lost(self, job_id: str, *, stale_after_s: float, worker: str) -> bool:
        """Processing job whose lease ended over ``stale_after_s`` ago -> error WorkerLost (retryable)."""

    @abstractmethod
    def record_dead_letter(self, job_id: str, *, dead_letter: dict, worker: str) -> bool:
        """Job not final and not leased, this DLQ message not yet applied -> error "dead-lettered …"."""

    # --- fleet presence (worker.core.presence; rules in worker.voice.records.presence)

    @abstractmethod
    def upsert_worker(self, presence: Mapping[str, object]) -> None:
        """Write the worker's presence record (``presence.presence_record``: lastSeen on the store's
        clock), replacing its earlier one, and drop records not seen for ``PRESENCE_KEPT_S``."""

    @abstractmethod
    def remove_worker(self, worker_id: str) -> None:
        """Delete the worker's presence record (a clean exit); none there is no error."""

    @abstractmethod
    def list_workers(self) -> list[dict]:
        """Every presence record, by workerId."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()
