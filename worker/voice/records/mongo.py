"""The production records store: MongoDB through pymongo (tested with mongomock and a real server).

It supplies the two swap primitives of ``worker.voice.records.transitions`` (which holds every rule) as
compare-and-swap on a revision field, ``_rev``: read the record, decide with the shared pure rule,
and write only the fields that changed with a filter on the revision read; a lost race re-reads and
decides again (up to a few times, then ``StoreError``). Fields the worker did not change are never
written, so a profile's other fields stay as the product's backend left them.
Datetimes are written as naive UTC (what BSON means by a datetime) and returned aware.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pymongo
import structlog
from bson import ObjectId
from pymongo import ReadPreference, ReturnDocument, WriteConcern
from pymongo.errors import ConfigurationError, DuplicateKeyError, OperationFailure, PyMongoError

from worker.core.errors import ConfigError
from worker.voice.records import recovery, rules
from worker.voice.records.errors import StoreError
from worker.voice.records.models import JobRecord, ProfileRecord, read_job, read_profile
from worker.voice.records.presence import LAST_SEEN, PRESENCE_KEPT_S, WORKER_ID, presence_record
from worker.voice.records.store import Clock
from worker.voice.records.store_config import MongoConfig
from worker.voice.records.transitions import TransitionStore

log = structlog.get_logger(__name__)

# Where presence records live, beside the product's collections (no setting: the worker owns it).
WORKERS_COLLECTION = "voiceworkers"
_OBJECT_ID = re.compile(r"[0-9a-fA-F]{24}")
_REV = "_rev"
# Each lost swap follows another writer's successful change. Writers that lose together would read
# and lose together again (on a real server, 8 threads incrementing one record exhausted 8 immediate
# attempts in 151 of 1,600 swaps; 16 attempts with these waits, in 2), so a loser waits a random
# while, growing with its losses, before it reads again.
_CAS_ATTEMPTS = 16
_CAS_BACKOFF_BASE_S = 0.001
_CAS_BACKOFF_CAP_S = 0.05


def db_id(record_id: str) -> ObjectId | str:
    """24-hex ids are ObjectIds in MongoDB; anything else is kept as a string."""
    record_id = str(record_id)
    return ObjectId(record_id) if _OBJECT_ID.fullmatch(record_id) else record_id


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


# What the rules' fences read: a job's status and lease, a profile's status and claims (a field a
# record does not have is compared as missing).
_FENCE_FIELDS = ("status", "lease", "claims")


def _cas(raw: dict, before: dict, after: dict) -> tuple[dict, dict]:
    """The filter and update that turn ``before`` (read as ``raw``) into ``after``, or match nothing.

    The filter holds the revision read, the fields every fence decides on (``_FENCE_FIELDS``, changed
    or not), and the stored value of every field the update touches: a writer that bypasses the
    revision (the product's backend, an older worker during a rollout) still makes the swap fail
    rather than be overwritten or be written past. Other fields are neither compared nor written.
    """
    changed = [key for key, value in after.items() if key != "_id" and (key not in before or before[key] != value)]
    dropped = [key for key in before if key not in after and key != "_id"]
    compared = dict.fromkeys([*_FENCE_FIELDS, *changed, *dropped])
    condition = {"_id": raw["_id"], _REV: raw.get(_REV), **{key: raw.get(key) for key in compared}}
    update: dict = {"$set": {**to_bson({key: after[key] for key in changed}), _REV: int(raw.get(_REV) or 0) + 1}}
    if dropped:
        update["$unset"] = {key: "" for key in dropped}
    return condition, update


def cas_backoff_s(lost: int, *, rng: Callable[[float, float], float] = random.uniform) -> float:
    """How long a writer waits after its ``lost``-th lost swap: full jitter over a doubling, capped span."""
    return rng(0.0, min(_CAS_BACKOFF_CAP_S, _CAS_BACKOFF_BASE_S * 2 ** (lost - 1)))


@contextmanager
def translated(op: str) -> Iterator[None]:
    try:
        yield
    except PyMongoError as exc:
        # The type names the failure; its text may carry hosts and topology, so it stays in the cause.
        raise StoreError(f"mongo {op} failed: {type(exc).__name__}") from exc


# How long a sample of the server's clock is advanced on the monotonic clock before it is taken again.
SERVER_CLOCK_RESAMPLE_S = 60.0


def server_local_time(db: Any) -> datetime | None:
    """The server's clock from ``hello`` (``isMaster`` before MongoDB 4.4.2), or None if it has none.

    mongomock implements neither command: None, and the store falls back to this host's clock.
    """
    client = db.client
    for command in ("hello", "isMaster"):
        try:
            reply = client.admin.command(command)
        except NotImplementedError:
            return None
        except OperationFailure:
            continue  # an old server that does not know "hello"
        moment = reply.get("localTime")
        return rules.to_ms(moment) if isinstance(moment, datetime) else None
    return None


class ServerClock:
    """The MongoDB server's clock: sampled, corrected by half the round trip, advanced monotonically.

    A lease is stamped and judged on this clock by every worker alike, so a worker whose own wall
    clock is off neither steals a live lease nor keeps a dead one looking alive. A failed re-sample
    keeps the last one (monotonic time stays true); with no sample at all the failure propagates.
    """

    def __init__(self, sample: Callable[[], datetime | None], *, fallback: Clock = rules.utc_now,
                 monotonic: Callable[[], float] = time.monotonic,
                 resample_s: float = SERVER_CLOCK_RESAMPLE_S):
        self._sample, self._fallback, self._monotonic = sample, fallback, monotonic
        self._resample_s = resample_s
        self._lock = threading.Lock()
        self._base: tuple[datetime, float] | None = None  # (server time, monotonic s) of the last sample
        self._next_sample_s: float | None = None
        self._warned = False

    def __call__(self) -> datetime:
        with self._lock:
            if self._next_sample_s is None or self._monotonic() >= self._next_sample_s:
                self._take_sample()
            if self._base is None:
                return self._fallback()
            server, at_s = self._base
            return server + timedelta(seconds=self._monotonic() - at_s)

    def _take_sample(self) -> None:
        sent_s = self._monotonic()
        try:
            server = self._sample()
        except Exception as exc:
            if self._base is None:
                raise
            # The last sample advanced on the monotonic clock stays good for another period.
            self._next_sample_s = self._monotonic() + self._resample_s
            log.warning("store.server_clock_resample_failed", error_type=type(exc).__name__)
            return
        received_s = self._monotonic()
        self._next_sample_s = received_s + self._resample_s
        if server is None:
            if not self._warned:
                self._warned = True
                log.warning("store.server_clock_unavailable",
                            note="the server reports no localTime: leases use this host's clock")
            return
        self._base = (server + timedelta(seconds=(received_s - sent_s) / 2), received_s)


class MongoStore(TransitionStore):
    def __init__(self, db: Any, *, jobs_collection: str = "voiceclonings",
                 profiles_collection: str = "useraudioprofiles", clock: Clock | None = None,
                 client: Any = None, sleep: Callable[[float], None] = time.sleep,
                 workers_collection: str = WORKERS_COLLECTION):
        """``client``, when given, is owned by this store and closed by ``close()``.

        ``clock`` is the store's clock; by default the server's (``ServerClock`` over ``hello``).
        ``sleep`` waits between the attempts of a swap that lost to another writer."""
        majority = WriteConcern("majority")
        # Reads from the primary: a swap decides on what it read, and a lagging secondary would turn
        # into false StaleWrites (lost leases) or retries until StoreError.
        self._jobs = db[jobs_collection].with_options(write_concern=majority,
                                                      read_preference=ReadPreference.PRIMARY)
        self._profiles = db[profiles_collection].with_options(write_concern=majority,
                                                              read_preference=ReadPreference.PRIMARY)
        # Presence records: plain upserts, no revision; a lost write is the next tick's to repeat, so
        # one acknowledgement is enough (a majority wait would only slow the tick).
        self._workers = db[workers_collection].with_options(write_concern=WriteConcern(w=1),
                                                            read_preference=ReadPreference.PRIMARY)
        self._clock = clock or ServerClock(lambda: server_local_time(db))
        self._client = client
        self._sleep = sleep

    def ensure_indexes(self) -> None:
        with translated("ensure_indexes"):
            # Partial, not sparse: jobs without a key store idempotencyKey null, and nulls must not collide.
            self._jobs.create_index(
                [("idempotencyKey", pymongo.ASCENDING)], name="idempotencyKey_unique", unique=True,
                partialFilterExpression={"idempotencyKey": {"$type": "string"}})
            self._jobs.create_index(
                [("status", pymongo.ASCENDING), ("lease.expiresAt", pymongo.ASCENDING)],
                name="status_lease")
            # `jobs` (list_jobs): newest first, with or without a status; without them a listing of a
            # large collection scans and sorts all of it, or all of one status.
            self._jobs.create_index([("createdAt", pymongo.DESCENDING), ("_id", pymongo.DESCENDING)],
                                    name="createdAt_id")
            self._jobs.create_index(
                [("status", pymongo.ASCENDING), ("createdAt", pymongo.DESCENDING), ("_id", pymongo.DESCENDING)],
                name="status_createdAt_id")
            # The pruning of presence records a day unseen (upsert_worker).
            self._workers.create_index([(LAST_SEEN, pymongo.ASCENDING)], name="lastSeen")

    # ------------------------------------------------------------ plumbing

    def _now(self) -> datetime:
        with translated("clock"):
            return rules.to_ms(self._clock())

    def _swap_job(self, op: str, job_id: str, allowed, change) -> tuple[dict | None, bool]:
        """Compare-and-swap on ``_rev``: a job changed since the read is read again and decided again."""
        with translated(op):
            for attempt in range(_CAS_ATTEMPTS):
                if attempt:
                    self._sleep(cas_backoff_s(attempt))
                now = self._now()
                raw = self._jobs.find_one({"_id": db_id(job_id)})
                if raw is None:
                    return None, False
                job = from_bson(raw)
                if not allowed(job, now):
                    return job, False
                after = self._jobs.find_one_and_update(*_cas(raw, job, change(job, now)),
                                                       return_document=ReturnDocument.AFTER)
                if after is not None:
                    return from_bson(after), True
        raise StoreError(f"mongo {op} failed: job {job_id} kept changing under concurrent writers")

    def _swap_profile(self, op: str, profile_id: str, allowed, change) -> tuple[dict | None, bool]:
        """The same on a profile; a missing one is inserted (a claim may stamp a profile not yet there).

        Profiles written before revisions existed have no ``_rev``: the filter's ``None`` matches the
        missing field, and the first write adds it."""
        with translated(op):
            for attempt in range(_CAS_ATTEMPTS):
                if attempt:
                    self._sleep(cas_backoff_s(attempt))
                now = self._now()
                raw = self._profiles.find_one({"_id": db_id(profile_id)})
                profile = None if raw is None else from_bson(raw)
                if not allowed(profile, now):
                    return profile, False
                new = change(profile, now)
                if raw is None:
                    try:
                        self._profiles.insert_one(to_bson({**new, "_id": db_id(profile_id), _REV: 1}))
                        return new, True
                    except DuplicateKeyError:
                        continue  # created meanwhile: decide again on that record
                assert profile is not None  # decoded from ``raw`` above
                after = self._profiles.find_one_and_update(*_cas(raw, profile, new),
                                                           return_document=ReturnDocument.AFTER)
                if after is not None:
                    return from_bson(after), True
        raise StoreError(f"mongo {op} failed: profile {profile_id} kept changing under concurrent writers")

    # ------------------------------------------------------------ reads

    def get_job(self, job_id: str) -> JobRecord | None:
        with translated("get_job"):
            raw = self._jobs.find_one({"_id": db_id(job_id)})
        return None if raw is None else read_job(from_bson(raw))

    def get_profile(self, profile_id: str) -> ProfileRecord | None:
        with translated("get_profile"):
            raw = self._profiles.find_one({"_id": db_id(profile_id)})
        return None if raw is None else read_profile(from_bson(raw))

    def list_jobs(self, status: str | None = None, since: datetime | None = None,
                  limit: int = 50) -> list[dict]:
        # An equality on status first, then a range and the sort on createdAt: the shapes the
        # status_createdAt_id and createdAt_id indexes serve (ensure_indexes).
        query: dict[str, Any] = {}
        if status is not None:
            query["status"] = status
        if since is not None:
            query["createdAt"] = {"$gte": to_bson(since)}
        with translated("list_jobs"):
            raws = list(self._jobs.find(query).sort([("createdAt", pymongo.DESCENDING), ("_id", pymongo.DESCENDING)])
                        .limit(int(limit)))
        return [from_bson(raw) for raw in raws]

    def find_stale(self, limit: int = 100) -> list[dict]:
        query = {"status": rules.PROCESSING,
                 "$or": [{"lease": None}, {"lease.expiresAt": {"$lte": to_bson(self._now())}}]}
        with translated("find_stale"):
            raws = list(self._jobs.find(query).sort("heartbeatAt", pymongo.ASCENDING).limit(int(limit)))
        return [from_bson(raw) for raw in raws]

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

    def find_unenqueued(self, older_than_s: float, limit: int = 100) -> list[dict]:
        query = {"status": rules.PENDING, recovery.ENQUEUED: None, recovery.REENQUEUED: None,
                 "createdAt": {"$lte": to_bson(recovery.cutoff(self._now(), older_than_s))}}
        with translated("find_unenqueued"):
            raws = list(self._jobs.find(query).sort("createdAt", pymongo.ASCENDING).limit(int(limit)))
        return [from_bson(raw) for raw in raws]

    # ------------------------------------------------------------ presence

    def upsert_worker(self, presence: Mapping[str, object]) -> None:
        now = self._now()
        record = presence_record(presence, now)
        with translated("upsert_worker"):
            self._workers.replace_one({"_id": record[WORKER_ID]}, to_bson(record), upsert=True)
            # On the store's clock, as SQLite does (not a TTL index: that one judges on the server's
            # clock alone, which a test's store clock is not).
            self._workers.delete_many({LAST_SEEN: {"$lt": to_bson(recovery.cutoff(now, PRESENCE_KEPT_S))}})

    def remove_worker(self, worker_id: str) -> None:
        with translated("remove_worker"):
            self._workers.delete_one({"_id": str(worker_id)})

    def list_workers(self) -> list[dict]:
        with translated("list_workers"):
            raws = list(self._workers.find({}, {"_id": 0}).sort(WORKER_ID, pymongo.ASCENDING))
        return [from_bson(raw) for raw in raws]

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            close_quietly(client)


def close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception as exc:  # noqa: BLE001 - a close failure must never mask what the caller is doing
        log.warning("store.close_failed", store="mongo", error=str(exc))


# ---------------------------------------------------------------- connecting: a bounded ping check, then the store


CLIENT_DATETIME_CONVERSION = "DATETIME_AUTO"


def connect_mongo(uri: str, *, max_attempts: int = 7, retry_delay_s: float = 1.0,
                  client_factory: Callable[..., Any] = pymongo.MongoClient,
                  sleep: Callable[[float], None] = time.sleep) -> Any:
    """A client whose server answered ``ping``, or StoreError chained to the last failure.

    The delay grows linearly: after failed attempt n it waits ``retry_delay_s * n`` (1, 2, 3 … s by
    default, 21 s in all before the 7th and last attempt), which rides out a replica set election.
    """
    try:
        # DATETIME_AUTO: a date the product's backend stored outside what datetime holds (year 1 at
        # +05:00 is year 0 in UTC) decodes as DatetimeMS instead of failing the whole read, so the
        # typed view shows that one field as unreadable (worker.voice.records.view) and every other
        # job still lists.
        client = client_factory(uri, tz_aware=True, datetime_conversion=CLIENT_DATETIME_CONVERSION,
                                serverSelectionTimeoutMS=5000, socketTimeoutMS=30_000, connectTimeoutMS=5000)
    except (ConfigurationError, ValueError) as exc:
        # An unusable URI (pymongo raises ValueError for some, e.g. a bad port) will not heal by
        # retrying; its text may hold credentials, so only the type is said.
        raise ConfigError(f"MONGO_URI is not a usable MongoDB URI ({type(exc).__name__})") from exc
    except PyMongoError as exc:
        raise StoreError(f"mongo client could not be created: {type(exc).__name__}") from exc
    last_exc: BaseException | None = None
    for attempt in range(1, max_attempts + 1):
        try:
            client.admin.command("ping")
            return client
        except PyMongoError as exc:
            last_exc = exc
            delay_s = retry_delay_s * attempt if attempt < max_attempts else 0.0
            log.warning("store.mongo_ping_failed", attempt=attempt, max_attempts=max_attempts,
                        error_type=type(exc).__name__, retry_in_s=delay_s)
            if delay_s > 0:
                sleep(delay_s)
    close_quietly(client)
    raise StoreError(f"MongoDB did not answer after {max_attempts} attempts: "
                     f"{type(last_exc).__name__}") from last_exc


def open_mongo_store(config: MongoConfig, *, client_factory: Callable[..., Any] | None = None,
                     sleep: Callable[[float], None] | None = None) -> MongoStore:
    client = connect_mongo(config.uri, max_attempts=config.connect_max_attempts,
                           retry_delay_s=config.connect_retry_delay_s,
                           client_factory=client_factory or pymongo.MongoClient,
                           sleep=sleep or time.sleep)
    try:
        with translated("open"):
            db = client.get_default_database(config.database)
        store = MongoStore(db, jobs_collection=config.jobs_collection,
                           profiles_collection=config.profiles_collection, client=client)
        store.ensure_indexes()
    except BaseException:
        close_quietly(client)
        raise
    return store
