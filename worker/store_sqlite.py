"""The embedded records store: one SQLite file, safe for several worker processes at once.

Every conditional operation runs inside ``BEGIN IMMEDIATE``: the write lock is taken before the
record is read, so the decision (made by the shared pure rules in ``worker.store``) and the write see
the same row, and two processes cannot both claim a job. The ``UPDATE … WHERE`` repeats the
condition on indexed columns, so a row that somehow changed is not overwritten. Each record is kept
whole as a JSON document; the columns beside it exist only for those conditions.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime

import structlog

from worker import store as rules
from worker import store_recovery as recovery
from worker.errors import ConfigError, StaleWrite, StoreError
from worker.store import Claim, Clock, Store

log = structlog.get_logger(__name__)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS jobs (
        id TEXT PRIMARY KEY,
        doc TEXT NOT NULL,
        status TEXT NOT NULL,
        lease_token TEXT,
        lease_expires_ms INTEGER,
        heartbeat_ms INTEGER,
        idempotency_key TEXT UNIQUE
    )""",
    "CREATE INDEX IF NOT EXISTS jobs_status_lease ON jobs (status, lease_expires_ms)",
    # Files made before profile claims were per job also have a claim_token column: it is left unused.
    """CREATE TABLE IF NOT EXISTS profiles (
        id TEXT PRIMARY KEY,
        doc TEXT NOT NULL,
        status TEXT NOT NULL
    )""",
)

# The same conditions the pure rules decide with, restated for the UPDATE's WHERE.
_CLAIMABLE = "status NOT IN ('completed', 'cancelled') AND (lease_token IS NULL OR lease_expires_ms <= ?)"
_HELD = "status = 'processing' AND lease_token = ?"
_NOT_FINAL = "status NOT IN ('completed', 'cancelled')"
# rules.holds_profile_claim, restated on the JSON document (the claims list has no column).
_PROFILE_CLAIMED = ("EXISTS (SELECT 1 FROM json_each(profiles.doc, '$.claims') "
                    "WHERE json_extract(value, '$.jobId') = ? AND json_extract(value, '$.token') = ?)")
_LOST = ("status = 'processing' AND ((lease_token IS NOT NULL AND lease_expires_ms <= ?) "
         "OR (lease_token IS NULL AND heartbeat_ms <= ?))")


def _epoch_ms(moment: datetime | None) -> int | None:
    return None if moment is None else round(moment.timestamp() * 1000)


def _default(value: object) -> object:
    if isinstance(value, datetime):
        return {"$date": rules.to_ms(value).isoformat()}
    raise TypeError(f"cannot store a {type(value).__name__} in a record")


def _decode_hook(obj: dict) -> object:
    if len(obj) == 1 and "$date" in obj:
        return datetime.fromisoformat(obj["$date"])
    return obj


def _encode(doc: dict) -> str:
    return json.dumps(doc, default=_default, separators=(",", ":"))


def _decode(text: str) -> dict:
    return json.loads(text, object_hook=_decode_hook)


# SQLite URI modes: create a missing file, write to an existing one, or only read. Only CREATE makes files.
CREATE, EXISTING, READ_ONLY = "rwc", "rw", "ro"


class SqliteStore(Store):
    def __init__(self, path: str, *, clock: Clock = rules.utc_now, busy_timeout_s: float = 10.0,
                 mode: str = CREATE):
        if mode not in (CREATE, EXISTING, READ_ONLY):
            raise ValueError(f"unknown sqlite open mode {mode!r}")
        self._clock = clock
        # The heartbeat thread renews while the main thread works: one connection, one lock.
        self._lock = threading.RLock()
        self._closed = False
        uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode={mode}"
        try:
            self._conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout_s, isolation_level=None,
                                         check_same_thread=False)
        except sqlite3.Error as exc:
            # The URI mode is the guard (no check-then-create race); the check only picks the words.
            if mode != CREATE and not os.path.exists(path):
                shown = path if os.path.isabs(path) else f"{path} ({os.path.abspath(path)})"
                raise ConfigError(f"STORE_URL names {shown}, which does not exist") from None
            raise StoreError(f"sqlite open failed: {type(exc).__name__}: {exc}") from exc
        try:
            with self._guarded("open") as conn:
                conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
                if mode != READ_ONLY:
                    conn.execute("PRAGMA journal_mode = WAL")
            if mode != READ_ONLY:
                with self._transaction("init") as conn:
                    for statement in _SCHEMA:
                        conn.execute(statement)
        except BaseException:
            self._conn.close()
            raise

    # ------------------------------------------------------------ plumbing

    def _now(self) -> datetime:
        return rules.to_ms(self._clock())

    @contextmanager
    def _guarded(self, op: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._conn
            except sqlite3.Error as exc:
                # "database is locked" past the busy timeout, disk I/O, a closed store: all transient
                # or operational from the caller's view, and the message holds no secrets.
                raise StoreError(f"sqlite {op} failed: {type(exc).__name__}: {exc}") from exc

    @contextmanager
    def _transaction(self, op: str) -> Iterator[sqlite3.Connection]:
        with self._guarded(op) as conn:
            # IMMEDIATE takes the write lock before the read, so decide-then-write is atomic across processes.
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                # A transaction left open would make every later BEGIN on this connection fail.
                if conn.in_transaction:
                    try:
                        conn.execute("ROLLBACK")
                    except sqlite3.Error as exc:
                        log.warning("store.rollback_failed", store="sqlite", error=str(exc))
                raise

    @staticmethod
    def _read(conn: sqlite3.Connection, table: str, record_id: str) -> dict | None:
        row = conn.execute(f"SELECT doc FROM {table} WHERE id = ?", (str(record_id),)).fetchone()
        return None if row is None else _decode(row[0])

    @staticmethod
    def _job_columns(job: dict) -> tuple:
        lease = job.get("lease") or None
        return (
            _encode(job),
            job["status"],
            lease["token"] if lease else None,
            _epoch_ms(lease["expiresAt"]) if lease else None,
            _epoch_ms(job.get("heartbeatAt")),
        )

    @staticmethod
    def _put_profile(conn: sqlite3.Connection, profile: dict) -> None:
        conn.execute(
            "INSERT INTO profiles (id, doc, status) VALUES (?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET doc = excluded.doc, status = excluded.status",
            (profile["_id"], _encode(profile), profile["status"]),
        )

    def _change_job(self, op: str, job_id: str,
                    allowed: Callable[[dict, datetime], bool],
                    change: Callable[[dict, datetime], dict],
                    where: str, where_args: Callable[[datetime], tuple],
                    after: Callable[[sqlite3.Connection, dict, datetime], None] | None = None,
                    ) -> tuple[dict | None, bool]:
        """Read, decide, write in one IMMEDIATE transaction; returns (record now, whether it changed)."""
        with self._transaction(op) as conn:
            # Read the clock once the write lock is held: waiting for it must not shorten a new lease.
            now = self._now()
            job = self._read(conn, "jobs", job_id)
            if job is None or not allowed(job, now):
                return job, False
            new = change(job, now)
            cursor = conn.execute(
                "UPDATE jobs SET doc = ?, status = ?, lease_token = ?, lease_expires_ms = ?, "
                f"heartbeat_ms = ? WHERE id = ? AND {where}",
                (*self._job_columns(new), str(job_id), *where_args(now)),
            )
            if cursor.rowcount != 1:
                return job, False
            if after is not None:
                after(conn, new, now)
            return new, True

    def _fenced_job(self, op: str, job_id: str, token: str,
                    change: Callable[[dict, datetime], dict]) -> dict:
        job, changed = self._change_job(
            op, job_id, lambda j, _now: rules.holds_lease(j, token), change, _HELD, lambda _now: (token,))
        if not changed:
            raise StaleWrite(f"{op}: job {job_id} is not held by this token any more")
        return job

    def _fenced_profile(self, op: str, profile_id: str, job_id: str, token: str,
                        change: Callable[[dict, datetime], dict]) -> None:
        with self._transaction(op) as conn:
            now = self._now()
            profile = self._read(conn, "profiles", profile_id)
            if rules.holds_profile_claim(profile, job_id, token):
                new = change(profile, now)
                cursor = conn.execute(
                    f"UPDATE profiles SET doc = ?, status = ? WHERE id = ? AND {_PROFILE_CLAIMED}",
                    (_encode(new), new["status"], str(profile_id), str(job_id), token))
                if cursor.rowcount == 1:
                    return
        raise StaleWrite(f"{op}: profile {profile_id} holds no claim of job {job_id} by this token")

    # ------------------------------------------------------------ reads

    def get_job(self, job_id: str) -> dict | None:
        with self._guarded("get_job") as conn:
            return self._read(conn, "jobs", job_id)

    def get_profile(self, profile_id: str) -> dict | None:
        with self._guarded("get_profile") as conn:
            return self._read(conn, "profiles", profile_id)

    def find_stale(self, limit: int = 100) -> list[dict]:
        now_ms = _epoch_ms(self._now())
        with self._guarded("find_stale") as conn:
            rows = conn.execute(
                "SELECT doc FROM jobs WHERE status = 'processing' "
                "AND (lease_token IS NULL OR lease_expires_ms <= ?) "
                "ORDER BY heartbeat_ms IS NOT NULL, heartbeat_ms LIMIT ?",
                (now_ms, int(limit))).fetchall()
        return [_decode(row[0]) for row in rows]

    # ------------------------------------------------------------ the attempt's life

    def _claim(self, job_id: str, *, owner: str, token: str, lease_s: float,
               message_id: str | None = None) -> Claim:
        def stamp_profile(conn: sqlite3.Connection, job: dict, now: datetime) -> None:
            if not job.get("profileId"):
                return
            profile_id = str(job["profileId"])
            profile = self._read(conn, "profiles", profile_id)
            self._put_profile(conn, rules.stamped_profile(profile, profile_id, str(job_id), token, now))

        job, changed = self._change_job(
            "claim", job_id,
            lambda j, now: rules.claim_refusal(j, now) is None,
            lambda j, now: rules.claimed(j, owner=owner, token=token, lease_s=lease_s, now=now,
                                         message_id=message_id),
            _CLAIMABLE, lambda now: (_epoch_ms(now),),
            after=stamp_profile,
        )
        if job is None:
            return Claim("missing", None)
        outcome = "claimed" if changed else (rules.claim_refusal(job, self._now()) or "held")
        return Claim(outcome, job, bool(job.get("cancelRequested")))

    def renew_lease(self, job_id: str, token: str, lease_s: float) -> bool:
        job = self._fenced_job("renew_lease", job_id, token,
                               lambda j, now: rules.renewed(j, lease_s, now))
        return bool(job.get("cancelRequested"))

    def set_progress(self, job_id: str, token: str, stage: str, percent: float) -> None:
        self._fenced_job("set_progress", job_id, token,
                         lambda j, now: rules.with_progress(j, stage, percent, now))

    def record_error(self, job_id: str, *, token: str | None, error_type: str, message: str,
                     retryable: bool) -> bool:
        where, args = (_HELD, lambda _now: (token,)) if token is not None else (
            _CLAIMABLE, lambda now: (_epoch_ms(now),))
        _job, changed = self._change_job(
            "record_error", job_id,
            lambda j, now: rules.may_record_error(j, token, now),
            lambda j, now: rules.errored(j, token=token, error_type=error_type, message=message,
                                         retryable=retryable, now=now),
            where, args,
        )
        return changed

    def write_paths(self, profile_id: str, token: str, model_paths: dict, s3_paths: dict, *,
                    job_id: str) -> None:
        self._fenced_profile("write_paths", profile_id, job_id, token, lambda p, now: {
            **p, "modelPaths": dict(model_paths), "s3Paths": dict(s3_paths), "updatedAt": now})

    def mark_profile_completed(self, profile_id: str, token: str, *, job_id: str) -> None:
        self._fenced_profile("mark_profile_completed", profile_id, job_id, token, lambda p, now: {
            **p, "status": rules.COMPLETED, "updatedAt": now})

    def mark_job_completed(self, job_id: str, token: str) -> None:
        self._fenced_job("mark_job_completed", job_id, token,
                         lambda j, now: rules.completed(j, token, now))

    def mark_cancelled(self, job_id: str, token: str) -> None:
        self._fenced_job("mark_cancelled", job_id, token,
                         lambda j, now: rules.cancelled(j, token, now))

    def release_lease(self, job_id: str, token: str) -> bool:
        _job, changed = self._change_job(
            "release_lease", job_id, lambda j, _now: rules.holds_lease(j, token),
            lambda j, now: rules.released(j, token, now), _HELD, lambda _now: (token,))
        return changed

    def request_cancel(self, job_id: str) -> bool:
        _job, changed = self._change_job(
            "request_cancel", job_id, lambda j, _now: rules.may_request_cancel(j),
            lambda j, _now: rules.cancel_requested(j), _NOT_FINAL, lambda _now: ())
        return changed

    # ------------------------------------------------------------ creation

    def submit(self, job: dict, profile: dict, idempotency_key: str | None = None) -> tuple[str, bool]:
        job, profile = rules.submission(job, profile)
        job_id = str(job["_id"])
        with self._transaction("submit") as conn:
            now = self._now()
            # Under the write lock, so a concurrent submit with the same key waits and then sees ours.
            if idempotency_key is not None:
                row = conn.execute("SELECT id FROM jobs WHERE idempotency_key = ?",
                                   (idempotency_key,)).fetchone()
                if row is not None:
                    return row[0], False
            if conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is not None:
                return job_id, False
            record = rules.new_job_record(job, idempotency_key, now)
            conn.execute(
                "INSERT INTO jobs (doc, status, lease_token, lease_expires_ms, heartbeat_ms, id, "
                "idempotency_key) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (*self._job_columns(record), job_id, idempotency_key))
            if self._read(conn, "profiles", str(profile["_id"])) is None:
                self._put_profile(conn, rules.new_profile_record(profile, job_id, now))
            return job_id, True

    # ------------------------------------------------------------ the reconciler's operations

    def mark_enqueued(self, job_id: str, *, again: bool = False) -> bool:
        field = recovery.REENQUEUED if again else recovery.ENQUEUED
        _job, changed = self._change_job(
            "mark_enqueued", job_id, lambda j, _now: j.get(field) is None,
            lambda j, now: recovery.stamped(j, field, now), "1 = 1", lambda _now: ())
        return changed

    def find_unenqueued(self, older_than_s: float, limit: int = 100) -> list[dict]:
        now = self._now()
        with self._guarded("find_unenqueued") as conn:
            rows = conn.execute("SELECT doc FROM jobs WHERE status = 'pending'").fetchall()
        # The stamps live only in the JSON document: pending jobs are few, so filter them here.
        jobs = [job for job in map(_decode, (row[0] for row in rows))
                if recovery.awaiting_enqueue(job, now, older_than_s)]
        return sorted(jobs, key=lambda job: job["createdAt"])[:int(limit)]

    def mark_worker_lost(self, job_id: str, *, stale_after_s: float, worker: str) -> bool:
        def args(now: datetime) -> tuple:
            cutoff_ms = _epoch_ms(recovery.cutoff(now, stale_after_s))
            return cutoff_ms, cutoff_ms

        _job, changed = self._change_job(
            "mark_worker_lost", job_id, lambda j, now: recovery.worker_lost(j, now, stale_after_s),
            lambda j, now: recovery.lost(j, worker=worker, now=now), _LOST, args)
        return changed

    def record_dead_letter(self, job_id: str, *, dead_letter: dict, worker: str) -> bool:
        message_id = dead_letter["messageId"]
        _job, changed = self._change_job(
            "record_dead_letter", job_id,
            lambda j, now: recovery.may_record_dead_letter(j, message_id, now),
            lambda j, now: recovery.dead_lettered(j, dead_letter, worker=worker, now=now),
            _CLAIMABLE, lambda now: (_epoch_ms(now),))
        return changed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._conn.close()
            except sqlite3.Error as exc:
                log.warning("store.close_failed", store="sqlite", error=str(exc))
