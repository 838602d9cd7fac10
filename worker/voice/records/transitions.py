"""Every write the stores make, written once over three backend primitives: a read and two swaps.

A backend (SQLite, MongoDB) supplies only those, its clock, its queries and ``submit``:

    get_job / get_profile       read one record (typed: ``models.read_job`` / ``read_profile``)
    _now                        the store's clock
    _swap_job(op, id, allowed, change)
    _swap_profile(op, id, allowed, change)
                                atomically: read the record (None when missing); if
                                ``allowed(record, now)``, replace it by ``change(record, now)``;
                                return (the record now, whether it changed). ``now`` is the
                                store's clock, never the worker's (``_now``)

plus its queries (``find_stale``, ``find_unenqueued``), ``submit`` and ``close``. Each rule below is
the pure decision from ``worker.voice.records.rules`` (who may write, what the record becomes) bound to one of
the swaps, so the two stores cannot drift apart on a rule: the fence of every write after a claim
is checked in ``allowed`` on the very version that ``change`` replaces.

A swap on a missing record gets ``None``; only the profile stamp of a claim creates a record that
way (a job's profile may not exist yet). ``_swap_job`` never creates a job: jobs come from ``submit``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import structlog

from worker.voice.records import recovery, rules
from worker.voice.records.attempt import Attempt
from worker.voice.records.errors import StaleWrite, StoreError
from worker.voice.records.models import read_job
from worker.voice.records.store import Claim, Store

log = structlog.get_logger(__name__)

Allowed = Callable[[dict, datetime], bool]
Change = Callable[[dict, datetime], dict]


class TransitionStore(Store):
    """The Store interface's writes over ``_swap_job`` and ``_swap_profile``; see the module docstring."""

    # ------------------------------------------------------------ the backend's primitives

    @abstractmethod
    def _now(self) -> datetime:
        """The store's clock (see ``Store.now``), at millisecond precision."""

    def now(self) -> datetime:
        return self._now()

    @abstractmethod
    def _swap_job(self, op: str, job_id: str, allowed: Allowed, change: Change) -> tuple[dict | None, bool]:
        """Read the job; if allowed, replace it by ``change(job, now)`` atomically. Never creates one."""

    @abstractmethod
    def _swap_profile(self, op: str, profile_id: str, allowed: Callable[[dict | None, datetime], bool],
                      change: Callable[[dict | None, datetime], dict]) -> tuple[dict | None, bool]:
        """Read the profile (None when missing); if allowed, write ``change(profile, now)`` atomically."""

    # ------------------------------------------------------------ fences

    def _fenced_job(self, op: str, job_id: str, token: str, change: Change) -> dict:
        job, changed = self._swap_job(op, job_id, lambda j, _now: rules.holds_lease(j, token), change)
        if not changed or job is None:
            raise StaleWrite(f"{op}: job {job_id} is not held by this token any more")
        return job

    def _fenced_profile(self, op: str, profile_id: str, job_id: str, token: str, fields: dict) -> None:
        _profile, changed = self._swap_profile(
            op, profile_id, lambda p, _now: rules.holds_profile_claim(p, job_id, token),
            # Changed only when it holds the claim, so it exists: ``or {}`` is for the type checker.
            lambda p, now: {**(p or {}), **fields, "updatedAt": now})
        if not changed:
            raise StaleWrite(f"{op}: profile {profile_id} holds no claim of job {job_id} by this token")

    # ------------------------------------------------------------ the attempt's life

    def claim(self, job_id: str, *, owner: str, token: str, lease_s: float,
              message_id: str | None = None) -> Claim:
        decided_at: list[datetime] = []

        def claimable(job: dict, now: datetime) -> bool:
            decided_at.append(now)  # the store's clock at the decision, for a refusal's retry hint
            return rules.claim_refusal(job, now) is None

        try:
            job, changed = self._swap_job(
                "claim", job_id, claimable,
                lambda j, now: rules.claimed(j, owner=owner, token=token, lease_s=lease_s, now=now,
                                             message_id=message_id))
        except StoreError:
            # The swap may have landed before the failure (a reply lost on the way back): let go of
            # it, fenced on our token (a no-op if it did not land), so no redelivery sees it busy.
            self._release_quietly(job_id, token)
            raise
        if job is None:
            return Claim(rules.ClaimOutcome.MISSING, None)
        cancel = bool(job.get("cancelRequested"))
        now = decided_at[-1]
        if not changed:
            return Claim(rules.claim_refusal(job, now) or rules.ClaimOutcome.HELD, read_job(job), cancel, now=now)
        profile_id = str(job["profileId"]) if job.get("profileId") else None
        if profile_id is not None:
            self._stamp_profile(job_id, profile_id, token, epoch=int(job["attempts"]))
        return Claim(rules.ClaimOutcome.CLAIMED, read_job(job), cancel,
                     Attempt(self, job_id, profile_id, token, lease_s), now=now)

    def _stamp_profile(self, job_id: str, profile_id: str, token: str, *, epoch: int) -> None:
        """Set this claim's entry on the profile, unless a newer claim of the job (higher epoch) is there."""
        try:
            _profile, changed = self._swap_profile(
                "claim", profile_id, lambda p, _now: rules.may_stamp_claim(p, str(job_id), token, epoch),
                lambda p, now: rules.stamped_profile(p, profile_id, str(job_id), token, now, epoch))
            if not changed:
                raise StaleWrite(f"claim: profile {profile_id} already holds a newer claim of job {job_id}")
        except BaseException:
            # Whatever failed (the store, a newer claim, a rule on odd profile data), a claimed job
            # whose profile is not stamped must not sit leased until its lease runs out: let go of
            # it, fenced on our token (a no-op once a newer claim replaced it), and report the failure.
            self._release_quietly(job_id, token)
            raise

    def _release_quietly(self, job_id: str, token: str) -> None:
        try:
            self.release_lease(job_id, token)
        except Exception as exc:  # noqa: BLE001 - the claim's own failure is the one to report
            log.warning("store.claim_release_failed", job_id=job_id, error=f"{type(exc).__name__}: {exc}")

    def renew_lease(self, job_id: str, token: str, lease_s: float, gpu_seconds: float | None = None) -> bool:
        job = self._fenced_job("renew_lease", job_id, token,
                               lambda j, now: rules.renewed(j, lease_s, now, token=token, gpu_seconds=gpu_seconds))
        return bool(job.get("cancelRequested"))

    def set_progress(self, job_id: str, token: str, stage: str, percent: float,
                     gpu_seconds: float | None = None, *, detail: Mapping[str, Any] | None = None,
                     series: Mapping[str, list] | None = None) -> None:
        self._fenced_job("set_progress", job_id, token,
                         lambda j, now: rules.with_progress(j, stage, percent, now, token=token,
                                                            gpu_seconds=gpu_seconds, detail=detail, series=series))

    def record_note(self, job_id: str, token: str, stage: str, text: str) -> None:
        self._fenced_job("record_note", job_id, token, lambda j, _now: rules.with_note(j, token, stage, text))

    def record_mirror(self, job_id: str, token: str, item: str, sha256_hex: str) -> None:
        self._fenced_job("record_mirror", job_id, token,
                         lambda j, _now: rules.with_mirror(j, token, item, sha256_hex))

    def record_quality(self, job_id: str, token: str, quality: dict) -> None:
        self._fenced_job("record_quality", job_id, token, lambda j, _now: rules.with_quality(j, quality))

    def record_dataset(self, job_id: str, token: str, dataset: dict) -> None:
        self._fenced_job("record_dataset", job_id, token, lambda j, _now: rules.with_dataset(j, dataset))

    def mark_refused(self, job_id: str, token: str, *, error_type: str, message: str, failed: Sequence[str],
                     quality: dict | None = None, gpu_seconds: float | None = None) -> None:
        self._fenced_job("mark_refused", job_id, token,
                         lambda j, now: rules.refused(_with_time(j, token, gpu_seconds), token, now,
                                                      error_type=error_type, message=message, failed=failed,
                                                      quality=quality))

    def record_base_model(self, job_id: str, token: str, base_model: dict) -> None:
        self._fenced_job("record_base_model", job_id, token,
                         lambda j, _now: {**j, rules.BASE_MODEL: dict(base_model)})

    def write_profile_base_model(self, profile_id: str, token: str, base_model: dict, *, job_id: str) -> None:
        self._fenced_profile("write_profile_base_model", profile_id, job_id, token,
                             {rules.BASE_MODEL: dict(base_model)})

    def write_profile_quality(self, profile_id: str, token: str, quality: dict, *, job_id: str) -> None:
        self._fenced_profile("write_profile_quality", profile_id, job_id, token, {rules.QUALITY: dict(quality)})

    def record_error(self, job_id: str, *, token: str | None, error_type: str, message: str,
                     retryable: bool, gpu_seconds: float | None = None, retries_spent: bool = False) -> bool:
        return self._swap_job(
            "record_error", job_id,
            lambda j, now: rules.may_record_error(j, token, now),
            lambda j, now: rules.errored(_with_time(j, token, gpu_seconds), token=token, error_type=error_type,
                                         message=message, retryable=retryable, now=now,
                                         retries_spent=retries_spent))[1]

    def write_paths(self, profile_id: str, token: str, model_paths: dict, s3_paths: dict, *,
                    job_id: str) -> None:
        self._fenced_profile("write_paths", profile_id, job_id, token,
                             {"modelPaths": dict(model_paths), "s3Paths": dict(s3_paths)})

    def mark_profile_completed(self, profile_id: str, token: str, *, job_id: str) -> None:
        self._fenced_profile("mark_profile_completed", profile_id, job_id, token, {"status": rules.COMPLETED})

    def mark_job_completed(self, job_id: str, token: str, gpu_seconds: float | None = None,
                           artifacts: Sequence[str] | None = None) -> None:
        self._fenced_job("mark_job_completed", job_id, token,
                         lambda j, now: rules.completed(j, token, now, gpu_seconds, artifacts))

    def mark_cancelled(self, job_id: str, token: str, gpu_seconds: float | None = None) -> None:
        self._fenced_job("mark_cancelled", job_id, token,
                         lambda j, now: rules.cancelled(_with_time(j, token, gpu_seconds), token, now))

    def release_lease(self, job_id: str, token: str, gpu_seconds: float | None = None) -> bool:
        return self._swap_job("release_lease", job_id, lambda j, _now: rules.holds_lease(j, token),
                              lambda j, now: rules.released(_with_time(j, token, gpu_seconds), token, now))[1]

    def release_for_host_fault(self, job_id: str, token: str, reason: str, gpu_seconds: float | None = None) -> bool:
        return self._swap_job("release_for_host_fault", job_id, lambda j, _now: rules.holds_lease(j, token),
                              lambda j, now: rules.released_for_host_fault(_with_time(j, token, gpu_seconds),
                                                                           token, now, reason))[1]

    def request_cancel(self, job_id: str) -> bool:
        return self._swap_job("request_cancel", job_id, lambda j, now: rules.may_request_cancel(j, now),
                              lambda j, _now: rules.cancel_requested(j))[1]

    # ------------------------------------------------------------ the reconciler's operations

    def mark_enqueued(self, job_id: str, *, again: bool = False) -> bool:
        field = recovery.REENQUEUED if again else recovery.ENQUEUED
        return self._swap_job("mark_enqueued", job_id, lambda j, _now: j.get(field) is None,
                              lambda j, now: recovery.stamped(j, field, now))[1]

    def mark_worker_lost(self, job_id: str, *, stale_after_s: float, worker: str) -> bool:
        return self._swap_job("mark_worker_lost", job_id,
                              lambda j, now: recovery.worker_lost(j, now, stale_after_s),
                              lambda j, now: recovery.lost(j, worker=worker, now=now))[1]

    def record_dead_letter(self, job_id: str, *, dead_letter: dict, worker: str) -> bool:
        message_id = dead_letter["messageId"]
        return self._swap_job(
            "record_dead_letter", job_id, lambda j, now: recovery.may_record_dead_letter(j, message_id, now),
            lambda j, now: recovery.dead_lettered(j, dead_letter, worker=worker, now=now))[1]


def _with_time(job: dict, token: str | None, gpu_seconds: float | None) -> dict:
    """The attempt's final trainer time on its history entry, before a final write closes the entry."""
    return job if token is None else rules.with_gpu_seconds(job, token, gpu_seconds)
