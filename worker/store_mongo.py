"""The production records store: MongoDB through pymongo (tested with mongomock).

Every conditional operation is one ``find_one_and_update`` whose filter carries the condition, so the
server decides atomically. Operations that rewrite the history list (claim, error, complete, cancel,
release) are compare-and-swap: the new record is computed from a read by the shared pure rules and
written only if ``_rev`` is unchanged and the condition still holds; a lost race re-reads and
decides again. (A single update cannot both close the last history entry and append a new one.)
The claim's profile stamp is compare-and-swap too, on the profile's status and claims list.
Datetimes are written as naive UTC (what BSON means by a datetime) and returned aware.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pymongo
import structlog
from bson import ObjectId
from pymongo import ReturnDocument, WriteConcern
from pymongo.errors import DuplicateKeyError, PyMongoError

from worker import store as rules
from worker import store_recovery as recovery
from worker.errors import StaleWrite, StoreError
from worker.store import Claim, Clock, Store

log = structlog.get_logger(__name__)

_OBJECT_ID = re.compile(r"^[0-9a-fA-F]{24}$")
_REV = "_rev"
# Each retry follows another writer's successful change, so a few always suffice in practice.
_CAS_ATTEMPTS = 8
_FINAL = list(rules.FINAL_STATUSES)
_MISSING = object()


def db_id(record_id: str) -> ObjectId | str:
    """24-hex ids are ObjectIds in MongoDB; anything else is kept as a string."""
    record_id = str(record_id)
    return ObjectId(record_id) if _OBJECT_ID.match(record_id) else record_id


def to_bson(value: Any) -> Any:
    if isinstance(value, datetime):
        return rules.to_ms(value).replace(tzinfo=None)
    if isinstance(value, dict):
        return {key: to_bson(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_bson(item) for item in value]
    return value


def from_bson(value: Any) -> Any:
    """A stored document as the interface returns it: str ids, aware UTC datetimes, no ``_rev``."""
    if isinstance(value, datetime):
        return rules.to_ms(value)
    if isinstance(value, ObjectId):
        return str(value)
    if isinstance(value, dict):
        return {key: from_bson(item) for key, item in value.items() if key != _REV}
    if isinstance(value, list):
        return [from_bson(item) for item in value]
    return value


def _claimable(now: datetime) -> dict:
    return {"status": {"$nin": _FINAL},
            "$or": [{"lease": None}, {"lease.expiresAt": {"$lte": to_bson(now)}}]}


def _held(token: str) -> dict:
    return {"status": rules.PROCESSING, "lease.token": token}


@contextmanager
def translated(op: str) -> Iterator[None]:
    try:
        yield
    except PyMongoError as exc:
        # The type names the failure; its text may carry hosts and topology, so it stays in the cause.
        raise StoreError(f"mongo {op} failed: {type(exc).__name__}") from exc


class MongoStore(Store):
    def __init__(self, db: Any, *, jobs_collection: str = "voiceclonings",
                 profiles_collection: str = "useraudioprofiles", clock: Clock = rules.utc_now,
                 client: Any = None):
        """``client``, when given, is owned by this store and closed by ``close()``."""
        majority = WriteConcern("majority")
        self._jobs = db[jobs_collection].with_options(write_concern=majority)
        self._profiles = db[profiles_collection].with_options(write_concern=majority)
        self._clock = clock
        self._client = client

    def ensure_indexes(self) -> None:
        with translated("ensure_indexes"):
            # Partial, not sparse: jobs without a key store idempotencyKey null, and nulls must not collide.
            self._jobs.create_index(
                [("idempotencyKey", pymongo.ASCENDING)], name="idempotencyKey_unique", unique=True,
                partialFilterExpression={"idempotencyKey": {"$type": "string"}})
            self._jobs.create_index(
                [("status", pymongo.ASCENDING), ("lease.expiresAt", pymongo.ASCENDING)],
                name="status_lease")

    # ------------------------------------------------------------ plumbing

    def _now(self) -> datetime:
        return rules.to_ms(self._clock())

    def _change_job(self, op: str, job_id: str,
                    allowed: Callable[[dict, datetime], bool],
                    change: Callable[[dict, datetime], dict],
                    condition: Callable[[datetime], dict]) -> tuple[dict | None, bool]:
        """Compare-and-swap on ``_rev`` plus the condition; returns (record now, whether it changed)."""
        lost_at_rev: Any = _MISSING
        with translated(op):
            for _ in range(_CAS_ATTEMPTS):
                now = self._now()
                raw = self._jobs.find_one({"_id": db_id(job_id)})
                if raw is None:
                    return None, False
                job = from_bson(raw)
                # Same revision as the write that just failed: the condition refused it, not a race.
                if not allowed(job, now) or raw.get(_REV) == lost_at_rev:
                    return job, False
                new = change(job, now)
                changes = {key: value for key, value in new.items()
                           if key != "_id" and (key not in job or job[key] != value)}
                changes[_REV] = int(raw.get(_REV) or 0) + 1
                after = self._jobs.find_one_and_update(
                    {"_id": raw["_id"], _REV: raw.get(_REV), **condition(now)},
                    {"$set": to_bson(changes)}, return_document=ReturnDocument.AFTER)
                if after is not None:
                    return from_bson(after), True
                lost_at_rev = raw.get(_REV)
        raise StoreError(f"mongo {op} failed: job {job_id} kept changing under concurrent writers")

    def _fenced_job(self, op: str, job_id: str, token: str,
                    change: Callable[[dict, datetime], dict]) -> None:
        _job, changed = self._change_job(op, job_id, lambda j, _now: rules.holds_lease(j, token),
                                         change, lambda _now: _held(token))
        if not changed:
            raise StaleWrite(f"{op}: job {job_id} is not held by this token any more")

    def _set_if_held(self, op: str, job_id: str, token: str, fields: dict) -> dict:
        with translated(op):
            after = self._jobs.find_one_and_update(
                {"_id": db_id(job_id), **_held(token)}, {"$set": to_bson(fields)},
                return_document=ReturnDocument.AFTER)
        if after is None:
            raise StaleWrite(f"{op}: job {job_id} is not held by this token any more")
        return from_bson(after)

    def _set_if_claimed(self, op: str, profile_id: str, job_id: str, token: str, fields: dict) -> None:
        # rules.holds_profile_claim as a filter: a list of {jobId, token}, as a map keyed by job id
        # would address a dotted path and job ids may contain dots.
        claimed = {"$elemMatch": {"jobId": str(job_id), "token": token}}
        with translated(op):
            after = self._profiles.find_one_and_update(
                {"_id": db_id(profile_id), rules.CLAIMS: claimed}, {"$set": to_bson(fields)})
        if after is None:
            raise StaleWrite(f"{op}: profile {profile_id} holds no claim of job {job_id} by this token")

    def _stamp_profile(self, profile_id: str, job_id: str, token: str) -> None:
        # Compare-and-swap on the status and claims read: a profile completed meanwhile stays so, and
        # the claims of other jobs racing ours all survive.
        for _ in range(_CAS_ATTEMPTS):
            raw = self._profiles.find_one({"_id": db_id(profile_id)})
            new = rules.stamped_profile(raw and from_bson(raw), profile_id, job_id, token, self._now())
            if raw is None:
                try:
                    self._profiles.insert_one(to_bson({**new, "_id": db_id(profile_id)}))
                    return
                except DuplicateKeyError:
                    continue  # created meanwhile: stamp that record instead
            stamp = {key: new[key] for key in ("status", rules.CLAIMS, "jobId", "updatedAt")}
            result = self._profiles.update_one(
                {"_id": raw["_id"], "status": raw.get("status"), rules.CLAIMS: raw.get(rules.CLAIMS)},
                {"$set": to_bson(stamp), "$unset": {rules.LEGACY_CLAIM_TOKEN: ""}})
            if result.matched_count == 1:
                return
        raise StoreError(f"mongo claim failed: profile {profile_id} kept changing under concurrent writers")

    # ------------------------------------------------------------ reads

    def get_job(self, job_id: str) -> dict | None:
        with translated("get_job"):
            raw = self._jobs.find_one({"_id": db_id(job_id)})
        return None if raw is None else from_bson(raw)

    def get_profile(self, profile_id: str) -> dict | None:
        with translated("get_profile"):
            raw = self._profiles.find_one({"_id": db_id(profile_id)})
        return None if raw is None else from_bson(raw)

    def find_stale(self, limit: int = 100) -> list[dict]:
        query = {"status": rules.PROCESSING,
                 "$or": [{"lease": None}, {"lease.expiresAt": {"$lte": to_bson(self._now())}}]}
        with translated("find_stale"):
            raws = list(self._jobs.find(query).sort("heartbeatAt", pymongo.ASCENDING).limit(int(limit)))
        return [from_bson(raw) for raw in raws]

    # ------------------------------------------------------------ the attempt's life

    def _claim(self, job_id: str, *, owner: str, token: str, lease_s: float,
               message_id: str | None = None) -> Claim:
        job, changed = self._change_job(
            "claim", job_id,
            lambda j, now: rules.claim_refusal(j, now) is None,
            lambda j, now: rules.claimed(j, owner=owner, token=token, lease_s=lease_s, now=now,
                                         message_id=message_id),
            _claimable)
        if job is None:
            return Claim("missing", None)
        if not changed:
            outcome = rules.claim_refusal(job, self._now()) or "held"
            return Claim(outcome, job, bool(job.get("cancelRequested")))
        if job.get("profileId"):
            with translated("claim"):
                self._stamp_profile(str(job["profileId"]), str(job_id), token)
        return Claim("claimed", job, bool(job.get("cancelRequested")))

    def renew_lease(self, job_id: str, token: str, lease_s: float) -> bool:
        now = self._now()
        job = self._set_if_held("renew_lease", job_id, token, {
            "lease.expiresAt": now + timedelta(seconds=lease_s), "heartbeatAt": now})
        return bool(job.get("cancelRequested"))

    def set_progress(self, job_id: str, token: str, stage: str, percent: float) -> None:
        now = self._now()
        self._set_if_held("set_progress", job_id, token, {
            "progress": {"stage": stage, "percent": float(percent), "updatedAt": now}})

    def record_error(self, job_id: str, *, token: str | None, error_type: str, message: str,
                     retryable: bool) -> bool:
        _job, changed = self._change_job(
            "record_error", job_id,
            lambda j, now: rules.may_record_error(j, token, now),
            lambda j, now: rules.errored(j, token=token, error_type=error_type, message=message,
                                         retryable=retryable, now=now),
            (lambda _now: _held(token)) if token is not None else _claimable)
        return changed

    def write_paths(self, profile_id: str, token: str, model_paths: dict, s3_paths: dict, *,
                    job_id: str) -> None:
        self._set_if_claimed("write_paths", profile_id, job_id, token, {
            "modelPaths": dict(model_paths), "s3Paths": dict(s3_paths), "updatedAt": self._now()})

    def mark_profile_completed(self, profile_id: str, token: str, *, job_id: str) -> None:
        self._set_if_claimed("mark_profile_completed", profile_id, job_id, token, {
            "status": rules.COMPLETED, "updatedAt": self._now()})

    def mark_job_completed(self, job_id: str, token: str) -> None:
        self._fenced_job("mark_job_completed", job_id, token,
                         lambda j, now: rules.completed(j, token, now))

    def mark_cancelled(self, job_id: str, token: str) -> None:
        self._fenced_job("mark_cancelled", job_id, token,
                         lambda j, now: rules.cancelled(j, token, now))

    def release_lease(self, job_id: str, token: str) -> bool:
        _job, changed = self._change_job(
            "release_lease", job_id, lambda j, _now: rules.holds_lease(j, token),
            lambda j, now: rules.released(j, token, now), lambda _now: _held(token))
        return changed

    def request_cancel(self, job_id: str) -> bool:
        with translated("request_cancel"):
            before = self._jobs.find_one_and_update(
                {"_id": db_id(job_id), "status": {"$nin": _FINAL}},
                {"$set": {"cancelRequested": True}})
        return before is not None

    # ------------------------------------------------------------ creation

    def _job_id_for_key(self, idempotency_key: str) -> str | None:
        raw = self._jobs.find_one({"idempotencyKey": idempotency_key}, {"_id": 1})
        return None if raw is None else str(raw["_id"])

    def submit(self, job: dict, profile: dict, idempotency_key: str | None = None) -> tuple[str, bool]:
        job, profile = rules.submission(job, profile)
        job_id = str(job["_id"])
        now = self._now()
        with translated("submit"):
            if idempotency_key is not None:
                existing = self._job_id_for_key(idempotency_key)
                if existing is not None:
                    return existing, False
            record = rules.new_job_record(job, idempotency_key, now)
            try:
                # The job goes first: the unique key index is the gate, so a losing concurrent submit
                # has created nothing at all.
                self._jobs.insert_one(to_bson({**record, "_id": db_id(job_id), _REV: 0}))
            except DuplicateKeyError:
                existing = self._job_id_for_key(idempotency_key) if idempotency_key is not None else None
                return existing or job_id, False
            new_profile = rules.new_profile_record(profile, job_id, now)
            try:
                self._profiles.insert_one(to_bson({**new_profile, "_id": db_id(new_profile["_id"])}))
            except DuplicateKeyError:
                pass  # the profile already exists: keep it as it is
            return job_id, True

    # ------------------------------------------------------------ the reconciler's operations

    def mark_enqueued(self, job_id: str, *, again: bool = False) -> bool:
        field = recovery.REENQUEUED if again else recovery.ENQUEUED
        return self._change_job("mark_enqueued", job_id, lambda j, _now: j.get(field) is None,
                                lambda j, now: recovery.stamped(j, field, now),
                                lambda _now: {field: None})[1]

    def find_unenqueued(self, older_than_s: float, limit: int = 100) -> list[dict]:
        query = {"status": rules.PENDING, recovery.ENQUEUED: None, recovery.REENQUEUED: None,
                 "createdAt": {"$lte": to_bson(recovery.cutoff(self._now(), older_than_s))}}
        with translated("find_unenqueued"):
            raws = list(self._jobs.find(query).sort("createdAt", pymongo.ASCENDING).limit(int(limit)))
        return [from_bson(raw) for raw in raws]

    def mark_worker_lost(self, job_id: str, *, stale_after_s: float, worker: str) -> bool:
        def condition(now: datetime) -> dict:
            ended = to_bson(recovery.cutoff(now, stale_after_s))
            return {"status": rules.PROCESSING, "$or": [{"lease.expiresAt": {"$lte": ended}},
                                                        {"lease": None, "heartbeatAt": {"$lte": ended}}]}

        return self._change_job("mark_worker_lost", job_id,
                                lambda j, now: recovery.worker_lost(j, now, stale_after_s),
                                lambda j, now: recovery.lost(j, worker=worker, now=now), condition)[1]

    def record_dead_letter(self, job_id: str, *, dead_letter: dict, worker: str) -> bool:
        message_id = dead_letter["messageId"]
        return self._change_job(
            "record_dead_letter", job_id, lambda j, now: recovery.may_record_dead_letter(j, message_id, now),
            lambda j, now: recovery.dead_lettered(j, dead_letter, worker=worker, now=now),
            lambda now: {**_claimable(now), recovery.DEAD_LETTERS: {"$ne": message_id}})[1]

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            close_quietly(client)


def close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception as exc:  # noqa: BLE001 - a close failure must never mask what the caller is doing
        log.warning("store.close_failed", store="mongo", error=str(exc))
