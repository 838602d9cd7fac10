"""Fixtures for the records-store tests: a movable wall clock and one store per implementation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import mongomock
import pytest

from tests.support import ARTIFACT_KEYS
from worker.voice.records.mongo import MongoStore
from worker.voice.records.sqlite import SqliteStore

JOB_ID = "665f1c2e9b1e8a0012ab34cd"
PROFILE_ID = "665f1c2e9b1e8a0012ab34ce"
LEASE_S = 300.0
ASSETS = ARTIFACT_KEYS  # the shipped pipeline config's artifact keys
MODEL_PATHS = {key: f"/work/production/voice-1/{JOB_ID}/output/{key}" for key in ASSETS}
S3_PATHS = {key: f"s3://voices/production/{JOB_ID}/{key}" for key in ASSETS}


class WallClock:
    """The store's clock, moved by hand: aware UTC datetimes from a fixed instant with millisecond precision.

    Not worker.core.testing.FakeClock: that one is monotonic seconds for the heartbeat, this one is the
    wall time the records hold and compare (lease expiries, history stamps), which may be skewed.
    """

    def __init__(self) -> None:
        self.now = datetime(2024, 5, 1, 12, 0, 0, 250_000, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> WallClock:
    return WallClock()


# Every store the contract runs on: SQLite, MongoDB as mongomock (in process, fast) and MongoDB as a real
# server (tests/mongo_server.py), which judges what mongomock cannot: concurrency, matching, indexes.
STORE_KINDS = ["sqlite", "mongomock", "mongo"]


def make_store(kind: str, tmp_path, clock, request: pytest.FixtureRequest | None = None):
    """A store of ``kind``; a real server's (``"mongo"``) needs the test's ``request`` for its database."""
    if kind == "sqlite":
        return SqliteStore(str(tmp_path / "records.db"), clock=clock)
    if kind == "mongo":
        if request is None:
            raise TypeError("a store on the real MongoDB server needs the test's request")
        # The session's client is shared by the worker's tests: the store does not own (close) it.
        store = MongoStore(request.getfixturevalue("mongo_db"), clock=clock)
    else:
        client = mongomock.MongoClient()
        store = MongoStore(client["voice"], clock=clock, client=client)
    store.ensure_indexes()
    return store


@pytest.fixture(params=STORE_KINDS)
def store(request, tmp_path, clock):
    store = make_store(request.param, tmp_path, clock, request)
    yield store
    store.close()


def submit(store, job_id: str = JOB_ID, profile_id: str = PROFILE_ID, key: str | None = None,
           **extra) -> tuple[str, bool]:
    job = {"_id": job_id, "profileId": profile_id, "environment": "production", **extra}
    return store.submit(job, {"_id": profile_id}, idempotency_key=key)


def claim(store, token: str, owner: str = "w1", job_id: str = JOB_ID):
    return store.claim(job_id, owner=owner, token=token, lease_s=LEASE_S)


def commit(store, token: str, job_id: str = JOB_ID, model_paths: dict = MODEL_PATHS,
           s3_paths: dict = S3_PATHS) -> None:
    store.write_paths(PROFILE_ID, token, model_paths, s3_paths, job_id=job_id)
    store.mark_profile_completed(PROFILE_ID, token, job_id=job_id)
    store.mark_job_completed(job_id, token)


def race_after_first_read(store, action, collection: str = "_jobs") -> None:
    """Make ``action()`` (another writer) run right after the MongoDB store's next read, once."""
    target = getattr(store, collection)
    real_find_one, raced = target.find_one, []

    def find_one_then_race(*args, **kwargs):
        doc = real_find_one(*args, **kwargs)
        if not raced:
            raced.append(True)
            action()
        return doc

    target.find_one = find_one_then_race
