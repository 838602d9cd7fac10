"""The embedded records store: one SQLite file, safe for several worker processes at once.

It supplies the two swap primitives of ``worker.voice.records.transitions`` (which holds every rule): each
runs inside ``BEGIN IMMEDIATE``, so the write lock is taken before the record is read, the decision
and the write see the same row, and two processes cannot both claim a job. Each record is kept
whole as a JSON document; the columns beside it serve the queries (stale leases, statuses).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime

import structlog

from worker.core.errors import ConfigError
from worker.voice.records import recovery, rules
from worker.voice.records.errors import StoreError
from worker.voice.records.models import JobRecord, ProfileRecord, read_job, read_profile
from worker.voice.records.presence import PRESENCE_KEPT_S, WORKER_ID, presence_record
from worker.voice.records.store import Clock
from worker.voice.records.transitions import TransitionStore

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
    # Presence (worker.voice.records.presence): one row per worker; last_seen_ms serves the pruning.
    """CREATE TABLE IF NOT EXISTS workers (
        id TEXT PRIMARY KEY,
        doc TEXT NOT NULL,
        last_seen_ms INTEGER NOT NULL
    )""",
)

_SQL_NOW = "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')"


def _epoch_ms(moment: object) -> int | None:
    return round(moment.timestamp() * 1000) if isinstance(moment, datetime) and moment.tzinfo else None


def _default(value: object) -> object:
    if isinstance(value, datetime):
        return {"$date": rules.to_ms(value).isoformat()}
    raise TypeError(f"cannot store a {type(value).__name__} in a record")


def _decode_hook(obj: dict) -> object:
    if len(obj) == 1 and "$date" in obj:
        try:
            return datetime.fromisoformat(obj["$date"])
        except (TypeError, ValueError):
            return obj  # a time no datetime holds (year 0 in UTC): the typed view shows it as unreadable
    return obj


def _encode(doc: dict) -> str:
    return json.dumps(doc, default=_default, separators=(",", ":"))


def _decode(text: str) -> dict:
    return json.loads(text, object_hook=_decode_hook)


# SQLite URI modes: create a missing file, write to an existing one, or only read. Only CREATE makes files.
CREATE, EXISTING, READ_ONLY = "rwc", "rw", "ro"


class SqliteStore(TransitionStore):
    def __init__(self, path: str, *, clock: Clock | None = None, busy_timeout_s: float = 10.0,
                 mode: str = CREATE):
        """``clock`` replaces SQLite's own clock, for tests only: in production every process on the
        host reads the one clock SQLite reads, so no worker's Python-level clock can move a lease."""
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
        if self._clock is not None:
            return rules.to_ms(self._clock())
        with self._guarded("now") as conn:
            # The store's clock is SQLite's (the host's), read in the caller's transaction when in one.
            (text,) = conn.execute(_SQL_NOW).fetchone()
        return rules.to_ms(datetime.fromisoformat(text).replace(tzinfo=UTC))

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
        # The columns only index the document: a field another writer left in a shape the worker never
        # writes indexes as nothing (the document keeps it, and the typed view reports it).
        lease: dict = job["lease"] if isinstance(job.get("lease"), dict) else {}
        return (
            _encode(job),
            str(job.get("status")),
            lease.get("token") if isinstance(lease.get("token"), str) else None,
            _epoch_ms(lease.get("expiresAt")),
            _epoch_ms(job.get("heartbeatAt")),
        )

    @staticmethod
    def _put_profile(conn: sqlite3.Connection, profile: dict) -> None:
        conn.execute(
            "INSERT INTO profiles (id, doc, status) VALUES (?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET doc = excluded.doc, status = excluded.status",
            (profile["_id"], _encode(profile), profile["status"]),
        )

    def _swap_job(self, op: str, job_id: str, allowed, change) -> tuple[dict | None, bool]:
        """Read, decide, write in one IMMEDIATE transaction; returns (record now, whether it changed)."""
        with self._transaction(op) as conn:
            # Read the clock once the write lock is held: waiting for it must not shorten a new lease.
            now = self._now()
            job = self._read(conn, "jobs", job_id)
            if job is None or not allowed(job, now):
                return job, False
            new = change(job, now)
            conn.execute(
                "UPDATE jobs SET doc = ?, status = ?, lease_token = ?, lease_expires_ms = ?, "
                "heartbeat_ms = ? WHERE id = ?", (*self._job_columns(new), str(job_id)))
            return new, True

    def _swap_profile(self, op: str, profile_id: str, allowed, change) -> tuple[dict | None, bool]:
        with self._transaction(op) as conn:
            now = self._now()
            profile = self._read(conn, "profiles", profile_id)
            if not allowed(profile, now):
                return profile, False
            new = change(profile, now)
            self._put_profile(conn, new)
            return new, True

    # ------------------------------------------------------------ reads

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._guarded("get_job") as conn:
            doc = self._read(conn, "jobs", job_id)
        return None if doc is None else read_job(doc)

    def get_profile(self, profile_id: str) -> ProfileRecord | None:
        with self._guarded("get_profile") as conn:
            doc = self._read(conn, "profiles", profile_id)
        return None if doc is None else read_profile(doc)

    def list_jobs(self, status: str | None = None, since: datetime | None = None,
                  limit: int = 50) -> list[dict]:
        # ``status`` is a column (the jobs_status_lease index serves it); createdAt lives only in the
        # document, where ``_encode`` writes every time as UTC ISO text, which sorts as the time does.
        # json_valid first: one document SQLite's JSON cannot read (a NaN another writer left) must not
        # fail the listing of every job; it sorts as one without a creation time.
        created = "(CASE WHEN json_valid(doc) THEN json_extract(doc, '$.createdAt.\"$date\"') END)"
        where, params = [], []
        if status is not None:
            where.append("status = ?")
            params.append(status)
        if since is not None:
            where.append(f"{created} >= ?")
            params.append(rules.to_ms(since).isoformat())
        sql = (f"SELECT doc FROM jobs {'WHERE ' + ' AND '.join(where) if where else ''} "
               f"ORDER BY {created} IS NULL, {created} DESC, rowid DESC LIMIT ?")
        with self._guarded("list_jobs") as conn:
            rows = conn.execute(sql, (*params, int(limit))).fetchall()
        return [_decode(row[0]) for row in rows]

    def find_stale(self, limit: int = 100) -> list[dict]:
        now_ms = _epoch_ms(self._now())
        with self._guarded("find_stale") as conn:
            rows = conn.execute(
                "SELECT doc FROM jobs WHERE status = 'processing' "
                "AND (lease_token IS NULL OR lease_expires_ms <= ?) "
                "ORDER BY heartbeat_ms IS NOT NULL, heartbeat_ms LIMIT ?",
                (now_ms, int(limit))).fetchall()
        return [_decode(row[0]) for row in rows]

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

    def find_unenqueued(self, older_than_s: float, limit: int = 100) -> list[dict]:
        now = self._now()
        with self._guarded("find_unenqueued") as conn:
            rows = conn.execute("SELECT doc FROM jobs WHERE status = 'pending'").fetchall()
        # The stamps live only in the JSON document: pending jobs are few, so filter them here.
        jobs = [job for job in map(_decode, (row[0] for row in rows))
                if recovery.awaiting_enqueue(job, now, older_than_s)]
        return sorted(jobs, key=lambda job: job["createdAt"])[:int(limit)]

    # ------------------------------------------------------------ presence

    def upsert_worker(self, presence: Mapping[str, object]) -> None:
        with self._transaction("upsert_worker") as conn:
            now = self._now()
            record = presence_record(presence, now)
            now_ms = _epoch_ms(now)
            assert now_ms is not None  # the store's clock is aware
            conn.execute("INSERT INTO workers (id, doc, last_seen_ms) VALUES (?, ?, ?) "
                         "ON CONFLICT (id) DO UPDATE SET doc = excluded.doc, last_seen_ms = excluded.last_seen_ms",
                         (record[WORKER_ID], _encode(record), now_ms))
            conn.execute("DELETE FROM workers WHERE last_seen_ms < ?", (now_ms - PRESENCE_KEPT_S * 1000,))

    def remove_worker(self, worker_id: str) -> None:
        with self._transaction("remove_worker") as conn:
            conn.execute("DELETE FROM workers WHERE id = ?", (str(worker_id),))

    def list_workers(self) -> list[dict]:
        with self._guarded("list_workers") as conn:
            try:
                rows = conn.execute("SELECT doc FROM workers ORDER BY id").fetchall()
            except sqlite3.OperationalError as exc:
                # A file no worker of this release has opened for writing (read-only opens create
                # nothing): no table, so no worker has ever said it is there.
                if "no such table" in str(exc):
                    return []
                raise
        return [_decode(row[0]) for row in rows]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._conn.close()
            except sqlite3.Error as exc:
                log.warning("store.close_failed", store="sqlite", error=str(exc))
