"""MongoDB-only behaviour: the connect check, ownership of the client, ids, indexes and races (mongomock and a real server)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import mongomock
import pymongo
import pytest
from bson import ObjectId
from pymongo.errors import ConfigurationError, ConnectionFailure, OperationFailure, ServerSelectionTimeoutError
from structlog.testing import capture_logs

from tests.voice.records.conftest import (
    JOB_ID,
    LEASE_S,
    MODEL_PATHS,
    PROFILE_ID,
    S3_PATHS,
    race_after_first_read,
    submit,
)
from worker.core.errors import ConfigError
from worker.voice.records.errors import StaleWrite, StoreError
from worker.voice.records.mongo import (
    _CAS_ATTEMPTS,
    _REV,
    MongoStore,
    ServerClock,
    cas_backoff_s,
    connect_mongo,
    server_local_time,
)
from worker.voice.records.rules import is_complete


class FakeClient:
    """A client whose ping fails a set number of times; records pings and closes."""

    def __init__(self, ping_failures: int, close_error: Exception | None = None):
        self.ping_failures = ping_failures
        self.close_error = close_error
        self.failures: list[Exception] = []
        self.pings = 0
        self.closed = False
        self.admin = self

    def command(self, name: str) -> dict:
        assert name == "ping"
        self.pings += 1
        if self.pings <= self.ping_failures:
            self.failures.append(ConnectionFailure(f"attempt {self.pings} refused"))
            raise self.failures[-1]
        return {"ok": 1.0}

    def close(self) -> None:
        self.closed = True
        if self.close_error is not None:
            raise self.close_error


class Factory:
    def __init__(self, client):
        self.client = client
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, uri: str, **kwargs):
        self.calls.append((uri, kwargs))
        return self.client


@pytest.fixture(params=["mongomock", "mongo"])
def mongo(request, clock):
    """A store and its database, on mongomock and on the real server (tests/mongo_server.py)."""
    if request.param == "mongo":
        db, client = request.getfixturevalue("mongo_db"), None
    else:
        client = mongomock.MongoClient()
        db = client["voice"]
    store = MongoStore(db, clock=clock, client=client)
    store.ensure_indexes()
    yield store, db
    store.close()


# ---------------------------------------------------------------- connect

@pytest.mark.parametrize("succeeding_attempt", [1, 3, 7])
def test_connect_succeeds_on_attempt_k_with_linear_delays(succeeding_attempt):
    """A ping that succeeds on attempt k returns the client after k-1 sleeps growing linearly."""
    client, sleeps = FakeClient(succeeding_attempt - 1), []
    factory = Factory(client)
    got = connect_mongo("mongodb://db:27017", retry_delay_s=0.5, client_factory=factory,
                        sleep=sleeps.append)
    assert got is client and not client.closed
    assert client.pings == succeeding_attempt
    assert sleeps == [0.5 * n for n in range(1, succeeding_attempt)]
    assert len(factory.calls) == 1 and factory.calls[0][1]["tz_aware"] is True


def test_connect_gives_up_after_seven_attempts():
    """Seven failed pings raise StoreError chained to the last failure, log each attempt and close the client."""
    client, sleeps = FakeClient(ping_failures=100), []
    with capture_logs() as logs, pytest.raises(StoreError) as caught:
        connect_mongo("mongodb://db:27017", client_factory=Factory(client), sleep=sleeps.append)
    assert caught.value.__cause__ is client.failures[-1]
    assert client.pings == 7 and client.closed
    assert sleeps == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    failed = [entry for entry in logs if entry["event"] == "store.mongo_ping_failed"]
    assert [entry["attempt"] for entry in failed] == [1, 2, 3, 4, 5, 6, 7]


def test_connect_close_failure_is_logged_not_raised():
    """When closing the unreachable client fails too, the close is logged and the connect error still wins."""
    client = FakeClient(ping_failures=100, close_error=RuntimeError("socket already gone"))
    with capture_logs() as logs, pytest.raises(StoreError) as caught:
        connect_mongo("mongodb://db:27017", max_attempts=2, client_factory=Factory(client),
                      sleep=lambda _s: None)
    assert caught.value.__cause__ is client.failures[-1]
    assert any(entry["event"] == "store.close_failed" for entry in logs)


def test_unusable_uri_is_a_config_error_without_the_secret():
    """A malformed URI fails at once as ConfigError, and the password in it is not repeated."""
    sleeps: list[float] = []
    with pytest.raises(ConfigError) as caught:
        connect_mongo("mongodb://user:hunter2@db:notaport", client_factory=pymongo.MongoClient,
                      sleep=sleeps.append)
    assert "hunter2" not in str(caught.value) and sleeps == []
    assert isinstance(caught.value.__cause__, (ConfigurationError, ValueError))


def test_store_close_closes_its_client_and_logs_failures(clock):
    """close() closes the client the store owns; a failing close is logged, not raised."""
    client = FakeClient(0, close_error=RuntimeError("boom"))
    store = MongoStore(mongomock.MongoClient()["voice"], clock=clock, client=client)
    with capture_logs() as logs:
        store.close()
        store.close()
    assert client.closed
    assert [entry["event"] for entry in logs] == ["store.close_failed"]


# ---------------------------------------------------------------- storage details

def test_hex_ids_are_object_ids_and_others_strings(mongo):
    """24-hex ids are stored as ObjectIds, other ids as strings; both come back as str."""
    store, db = mongo
    submit(store)
    submit(store, "job-1", "profile-1")
    assert db["voiceclonings"].find_one({"_id": ObjectId(JOB_ID)}) is not None
    assert db["useraudioprofiles"].find_one({"_id": ObjectId(PROFILE_ID)}) is not None
    assert db["voiceclonings"].find_one({"_id": "job-1"}) is not None
    assert store.get_job(JOB_ID)["_id"] == JOB_ID and store.get_job("job-1")["_id"] == "job-1"


def test_collections_use_majority_write_concern():
    """Both record collections are written with majority write concern; presence, advisory, with one."""
    seen: dict[str, object] = {}

    class RecordingCollection:
        def __init__(self, name):
            self.name = name

        def with_options(self, **kwargs):
            seen[self.name] = kwargs["write_concern"].document
            return self

    class RecordingDb(dict):
        def __missing__(self, name):
            return RecordingCollection(name)

    MongoStore(RecordingDb(), jobs_collection="jobs", profiles_collection="profiles")
    assert seen == {"jobs": {"w": "majority"}, "profiles": {"w": "majority"}, "voiceworkers": {"w": 1}}


def test_idempotency_key_has_a_unique_partial_index(mongo):
    """ensure_indexes creates a unique index on idempotencyKey that ignores key-less jobs."""
    _store, db = mongo
    index = db["voiceclonings"].index_information()["idempotencyKey_unique"]
    assert index["unique"] is True and index["key"] == [("idempotencyKey", 1)]


def test_the_jobs_listing_has_an_index_for_each_of_its_shapes(mongo):
    """ensure_indexes serves `jobs` newest first, with and without a status, in list_jobs' sort order."""
    _store, db = mongo
    indexes = db["voiceclonings"].index_information()
    assert indexes["createdAt_id"]["key"] == [("createdAt", -1), ("_id", -1)]
    assert indexes["status_createdAt_id"]["key"] == [("status", 1), ("createdAt", -1), ("_id", -1)]


def test_submit_losing_the_race_at_the_unique_index(mongo, monkeypatch):
    """A submit whose key appears between its lookup and its insert returns the winner and creates nothing."""
    store, db = mongo
    submit(store, "a" * 24, "b" * 24, key="race")
    lookups = iter([None])
    real_lookup = store._job_id_for_key
    monkeypatch.setattr(store, "_job_id_for_key", lambda key: next(lookups, real_lookup(key)))
    assert submit(store, key="race") == ("a" * 24, False)
    assert store.get_job(JOB_ID) is None and store.get_profile(PROFILE_ID) is None


def test_claim_of_an_app_created_job_creates_its_profile(mongo, clock):
    """A bare job written by the app (ObjectId refs, no bookkeeping fields, no profile) is claimed and committed."""
    store, db = mongo
    db["voiceclonings"].insert_one(
        {"_id": ObjectId(JOB_ID), "profileId": ObjectId(PROFILE_ID), "status": "pending"})
    result = store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    assert result.outcome == "claimed" and result.job["attempts"] == 1
    assert result.job["profileId"] == PROFILE_ID
    profile = store.get_profile(PROFILE_ID)
    assert profile["status"] == "processing" and profile["claims"] == [{"jobId": JOB_ID, "token": "t1", "epoch": 1}]
    assert profile["modelPaths"] == {} and profile["s3Paths"] == {}
    store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    store.mark_profile_completed(PROFILE_ID, "t1", job_id=JOB_ID)
    store.mark_job_completed(JOB_ID, "t1")
    assert is_complete(store.get_job(JOB_ID), store.get_profile(PROFILE_ID))


def test_claim_racing_another_writer_recomputes_history(mongo, clock):
    """A claim whose read went stale (another worker claimed and released meanwhile) decides again from fresh data."""
    store, db = mongo
    submit(store)
    rival = MongoStore(db, clock=clock)
    race_after_first_read(store, lambda: (rival.claim(JOB_ID, owner="w2", token="t2", lease_s=LEASE_S),
                                          rival.release_lease(JOB_ID, "t2")))
    assert store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S).outcome == "claimed"
    job = store.get_job(JOB_ID)
    assert job["attempts"] == 2
    assert [(e["token"], e["outcome"]) for e in job["history"]] == [("t2", "released"), ("t1", "running")]


# ---------------------------------------------------------------- failures

class DownCollection:
    """Every call fails the way pymongo does when no server can be selected."""

    def with_options(self, **_kwargs):
        return self

    def __getattr__(self, _name):
        def fail(*_args, **_kwargs):
            raise ServerSelectionTimeoutError("db-0.internal:27017: timed out")
        return fail


class DownDatabase(dict):
    """A database whose collections and server (the clock's ``hello``) all fail as ``DownCollection``."""

    def __init__(self):
        super().__init__(voiceclonings=DownCollection(), useraudioprofiles=DownCollection(),
                         voiceworkers=DownCollection())
        self.client = type("DownClient", (), {"admin": DownCollection()})()


@pytest.mark.parametrize("call", [
    lambda s: s.now(),
    lambda s: s.get_job(JOB_ID),
    lambda s: s.get_profile(PROFILE_ID),
    lambda s: s.claim(JOB_ID, owner="w", token="t", lease_s=LEASE_S),
    lambda s: s.renew_lease(JOB_ID, "t", LEASE_S),
    lambda s: s.set_progress(JOB_ID, "t", "x", 1),
    lambda s: s.record_error(JOB_ID, token=None, error_type="X", message="m", retryable=True),
    lambda s: s.write_paths(PROFILE_ID, "t", {}, {}, job_id=JOB_ID),
    lambda s: s.mark_profile_completed(PROFILE_ID, "t", job_id=JOB_ID),
    lambda s: s.mark_job_completed(JOB_ID, "t"),
    lambda s: s.mark_cancelled(JOB_ID, "t"),
    lambda s: s.release_lease(JOB_ID, "t"),
    lambda s: s.request_cancel(JOB_ID),
    lambda s: s.submit({"_id": JOB_ID}, {"_id": PROFILE_ID}),
    lambda s: s.find_stale(),
    lambda s: s.ensure_indexes(),
    lambda s: s.upsert_worker({"workerId": "w"}),
    lambda s: s.list_workers(),
    lambda s: s.remove_worker("w"),
])
def test_pymongo_errors_become_store_error(call):
    """Every operation turns a pymongo failure into StoreError with the cause chained."""
    with pytest.raises(StoreError) as caught:
        call(MongoStore(DownDatabase()))
    assert isinstance(caught.value.__cause__, ServerSelectionTimeoutError)


def test_claim_racing_a_renewal_does_not_steal_the_lease(mongo, clock):
    """A claim that read an expired lease loses if the holder renews before the write lands."""
    store, db = mongo
    submit(store)
    holder = MongoStore(db, clock=clock)
    holder.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    clock.advance(LEASE_S + 1)
    race_after_first_read(store, lambda: holder.renew_lease(JOB_ID, "t1", LEASE_S))
    assert store.claim(JOB_ID, owner="w2", token="t2", lease_s=LEASE_S).outcome == "held"
    job = store.get_job(JOB_ID)
    assert job["lease"]["token"] == "t1" and job["attempts"] == 1


# ---------------------------------------------------------------- the profile's per-job claims

OTHER_JOB = "665f1c2e9b1e8a0012ab34cf"


def _rival_acts_after_profile_read(store, act):
    """Make the store's next profile read run ``act`` right after it, as a racing writer would."""
    race_after_first_read(store, act, collection="_profiles")


def test_profile_stamp_racing_another_jobs_claim_keeps_both_claims(mongo, clock):
    """A claim of another job landing between our profile read and write is kept: both jobs can write."""
    store, db = mongo
    third = "665f1c2e9b1e8a0012ab34d0"
    for job_id in (JOB_ID, OTHER_JOB, third):
        submit(store, job_id)
    rival = MongoStore(db, clock=clock)
    # The profile is already processing, so only the claims list tells our read is stale.
    rival.claim(third, owner="w3", token="t3", lease_s=LEASE_S)
    _rival_acts_after_profile_read(
        store, lambda: rival.claim(OTHER_JOB, owner="w2", token="t2", lease_s=LEASE_S))
    assert store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S).outcome == "claimed"
    claims = store.get_profile(PROFILE_ID)["claims"]
    assert [entry["jobId"] for entry in claims] == [third, OTHER_JOB, JOB_ID]
    store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    store.write_paths(PROFILE_ID, "t2", MODEL_PATHS, S3_PATHS, job_id=OTHER_JOB)


def test_profile_completed_during_the_stamp_stays_completed(mongo, clock):
    """A profile another job completes between our read and write keeps its completed status."""
    store, db = mongo
    submit(store)
    submit(store, OTHER_JOB)
    rival = MongoStore(db, clock=clock)
    rival.claim(OTHER_JOB, owner="w2", token="t2", lease_s=LEASE_S)
    _rival_acts_after_profile_read(
        store, lambda: rival.mark_profile_completed(PROFILE_ID, "t2", job_id=OTHER_JOB))
    store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    profile = store.get_profile(PROFILE_ID)
    assert profile["status"] == "completed"
    assert [entry["jobId"] for entry in profile["claims"]] == [OTHER_JOB, JOB_ID]


def test_profile_of_an_app_created_job_appearing_during_the_stamp_is_stamped(mongo, clock):
    """A profile the app inserts between our read (none) and our insert is stamped, not duplicated or lost."""
    store, db = mongo
    db["voiceclonings"].insert_one({"_id": ObjectId(JOB_ID), "profileId": ObjectId(PROFILE_ID),
                                    "status": "pending"})
    _rival_acts_after_profile_read(store, lambda: db["useraudioprofiles"].insert_one(
        {"_id": ObjectId(PROFILE_ID), "status": "pending", "name": "voice-1"}))
    store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    profile = store.get_profile(PROFILE_ID)
    assert profile["name"] == "voice-1" and profile["status"] == "processing"
    assert profile["claims"] == [{"jobId": JOB_ID, "token": "t1", "epoch": 1}]


def test_legacy_profile_with_a_claim_token_is_migrated_on_claim(mongo):
    """A profile written by the old fence (claimToken, no claims) gets a claims entry and loses claimToken."""
    store, db = mongo
    submit(store)
    db["useraudioprofiles"].update_one({"_id": ObjectId(PROFILE_ID)},
                                       {"$set": {"claimToken": "old"}, "$unset": {"claims": ""}})
    store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    raw = db["useraudioprofiles"].find_one({"_id": ObjectId(PROFILE_ID)})
    assert "claimToken" not in raw and raw["claims"] == [{"jobId": JOB_ID, "token": "t1", "epoch": 1}]
    store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)


def test_profile_that_keeps_changing_is_store_error(mongo, clock):
    """A stamp that loses every compare-and-swap gives up with StoreError instead of looping forever."""
    store, db = mongo
    submit(store)
    real_find_one, profiles = store._profiles.find_one, db["useraudioprofiles"]

    def find_one_then_someone_writes(*args, **kwargs):
        doc = real_find_one(*args, **kwargs)
        profiles.update_one({"_id": ObjectId(PROFILE_ID)},
                            {"$push": {"claims": {"jobId": "noise", "token": "n"}}})
        return doc

    store._profiles.find_one = find_one_then_someone_writes
    waits: list[float] = []
    store._sleep = waits.append
    with pytest.raises(StoreError):
        store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    assert len(waits) == _CAS_ATTEMPTS - 1


def test_a_swap_that_lost_to_other_writers_waits_a_growing_random_while_before_each_new_read(mongo, clock):
    """Each lost swap is followed by a jittered wait within a doubling, capped span; then the swap lands."""
    store, db = mongo
    submit(store)
    jobs, waits = store._jobs, []
    real_swap, losses = jobs.find_one_and_update, iter(range(3))

    def a_rival_writes_then_swap(*args, **kwargs):
        if next(losses, None) is not None:  # another writer's change lands between the read and the swap
            jobs.update_one({"_id": ObjectId(JOB_ID)}, {"$inc": {_REV: 1}})
        return real_swap(*args, **kwargs)

    jobs.find_one_and_update = a_rival_writes_then_swap
    store._sleep = waits.append
    assert store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S).outcome == "claimed"
    assert len(waits) == 3
    assert all(0 <= wait <= 0.001 * 2 ** n for n, wait in enumerate(waits))


def test_the_wait_after_a_lost_swap_doubles_up_to_its_cap_and_is_drawn_below_it():
    """The span after the k-th loss is 1 ms doubled k-1 times, capped at 50 ms; the wait is drawn from [0, span]."""
    spans = [cas_backoff_s(lost, rng=lambda low, high: high) for lost in range(1, 10)]
    assert spans == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05]
    assert cas_backoff_s(3, rng=lambda low, high: low) == 0.0


def test_fields_the_worker_does_not_change_are_left_as_the_backend_wrote_them(mongo, clock):
    """A profile field the product's backend sets between the worker's read and write survives the write."""
    store, db = mongo
    submit(store)
    store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    profiles = db["useraudioprofiles"]
    race_after_first_read(store, lambda: profiles.update_one(
        {"_id": ObjectId(PROFILE_ID)}, {"$set": {"displayName": "Ada's voice"}}), "_profiles")
    store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    raw = profiles.find_one({"_id": ObjectId(PROFILE_ID)})
    assert raw["displayName"] == "Ada's voice" and raw["modelPaths"] == MODEL_PATHS


def test_a_fence_field_changed_by_a_writer_that_skips_the_revision_refuses_the_write(mongo, clock):
    """Claims emptied behind the worker's back (no _rev bump) between its read and its write make write_paths StaleWrite."""
    store, db = mongo
    submit(store)
    store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    profiles = db["useraudioprofiles"]
    race_after_first_read(store, lambda: profiles.update_one(
        {"_id": ObjectId(PROFILE_ID)}, {"$set": {"claims": []}}), "_profiles")
    with pytest.raises(StaleWrite):
        store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    assert profiles.find_one({"_id": ObjectId(PROFILE_ID)}).get("modelPaths") in (None, {})


def test_a_job_cancelled_behind_the_revision_is_not_claimed(mongo, clock):
    """A released job (still processing) set to cancelled without a _rev bump between the claim's read and write is not claimed."""
    store, db = mongo
    submit(store)
    store.claim(JOB_ID, owner="w0", token="t0", lease_s=LEASE_S)
    assert store.release_lease(JOB_ID, "t0")  # status stays processing: the claim will not change it
    jobs = db["voiceclonings"]
    race_after_first_read(store, lambda: jobs.update_one(
        {"_id": ObjectId(JOB_ID)}, {"$set": {"status": "cancelled"}}))
    claim = store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    assert claim.outcome != "claimed" and claim.attempt is None
    assert jobs.find_one({"_id": ObjectId(JOB_ID)})["lease"] is None


# ---------------------------------------------------------------- the store's clock is the server's

SERVER_NOW = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)


class FakeServerTime:
    """The server's clock as ``hello`` reports it, on a monotonic clock the test moves by hand.

    Each sample takes ``round_trip_s`` of monotonic time and reports the server time at its middle.
    """

    def __init__(self, round_trip_s: float = 0.2):
        self.mono_s, self.round_trip_s = 100.0, round_trip_s
        self.samples, self.failing = 0, False

    def monotonic(self) -> float:
        return self.mono_s

    def server_now(self) -> datetime:
        return SERVER_NOW + timedelta(seconds=self.mono_s - 100.0)

    def sample(self) -> datetime | None:
        self.samples += 1
        if self.failing:
            raise ConnectionFailure("server went away")
        self.mono_s += self.round_trip_s / 2
        reported = self.server_now()
        self.mono_s += self.round_trip_s / 2
        return reported

    def clock(self, **kwargs) -> ServerClock:
        return ServerClock(self.sample, monotonic=self.monotonic, **kwargs)


def test_the_server_clock_is_corrected_by_half_the_round_trip_and_advanced_monotonically():
    """A sample taken over a round trip reads the server's time at its end, then advances with monotonic time."""
    server = FakeServerTime(round_trip_s=0.4)
    clock = server.clock(fallback=lambda: SERVER_NOW - timedelta(days=1))
    assert clock() == server.server_now()
    server.mono_s += 59
    assert clock() == server.server_now() and server.samples == 1


def test_the_server_clock_is_sampled_again_each_period_and_keeps_the_last_sample_on_failure():
    """After the resample period the server is asked again; a failed ask keeps the last sample going."""
    server = FakeServerTime()
    clock = server.clock(resample_s=60)
    clock()
    server.mono_s += 60
    clock()
    assert server.samples == 2
    server.failing, server.mono_s = True, server.mono_s + 60
    with capture_logs() as logs:
        assert clock() == server.server_now()
    assert server.samples == 3 and [e["event"] for e in logs] == ["store.server_clock_resample_failed"]


def test_a_server_clock_never_sampled_raises_the_failure():
    """With no sample at all there is no server time to fall back on: the failure propagates."""
    server = FakeServerTime()
    server.failing = True
    with pytest.raises(ConnectionFailure):
        server.clock()()


def test_a_server_without_local_time_falls_back_to_this_hosts_clock_with_one_warning():
    """mongomock answers no hello: the store's clock is this host's, said once in the log."""
    db = mongomock.MongoClient()["voice"]
    assert server_local_time(db) is None
    host = SERVER_NOW - timedelta(hours=1)
    clock = ServerClock(lambda: server_local_time(db), fallback=lambda: host)
    with capture_logs() as logs:
        assert clock() == host and clock() == host
    assert [e["event"] for e in logs] == ["store.server_clock_unavailable"]


class HelloClient:
    """A client whose ``hello`` (or, on an old server, ``isMaster``) reports the server's localTime."""

    def __init__(self, knows_hello: bool = True):
        self.admin, self.knows_hello, self.asked = self, knows_hello, []

    def command(self, name: str) -> dict:
        self.asked.append(name)
        if name == "hello" and not self.knows_hello:
            raise OperationFailure("no such command: 'hello'")
        return {"ok": 1.0, "localTime": SERVER_NOW.replace(tzinfo=None, microsecond=123_456)}


@pytest.mark.parametrize("knows_hello, asked", [(True, ["hello"]), (False, ["hello", "isMaster"])])
def test_the_servers_local_time_comes_from_hello_or_is_master(knows_hello, asked):
    """localTime is read from hello, or from isMaster on a server before 4.4.2, as aware UTC in milliseconds."""
    client = HelloClient(knows_hello)
    db = type("Db", (), {"client": client})()
    assert server_local_time(db) == SERVER_NOW.replace(microsecond=123_000)
    assert client.asked == asked


@pytest.mark.parametrize("skew_s", [30, 300])
def test_on_server_time_a_skewed_worker_is_held_and_a_dead_lease_ends_on_time(monkeypatch, skew_s):
    """With the server's clock injected, a worker clock off by the skew neither steals nor prolongs a lease."""
    from worker.voice.records import rules

    server = FakeServerTime()
    client = mongomock.MongoClient()
    holder = MongoStore(client["voice"], clock=server.clock(), client=client)
    skewed = MongoStore(client["voice"], clock=server.clock())
    submit(holder)
    monkeypatch.setattr(rules, "utc_now", lambda: server.server_now() + timedelta(seconds=skew_s))
    assert skewed.claim(JOB_ID, owner="w1", token="t1", lease_s=10).outcome == "claimed"
    server.mono_s += 1
    assert holder.claim(JOB_ID, owner="w2", token="t2", lease_s=10).outcome == "held"
    server.mono_s += 9  # the skewed holder died: its lease ends 10 s of server time after its claim
    assert holder.claim(JOB_ID, owner="w2", token="t2", lease_s=10).outcome == "claimed"
    assert holder.clock_offset_s() == pytest.approx(-skew_s, abs=0.001)


# ---------------------------------------------------------------- what only a real server judges

def test_ensure_indexes_again_over_jobs_without_a_key_succeeds_on_the_server(mongo_db, clock):
    """A restart's ensure_indexes over key-less jobs keeps the partial unique index (mongomock raises E11000 here)."""
    store = MongoStore(mongo_db, clock=clock)
    store.ensure_indexes()
    submit(store)
    submit(store, OTHER_JOB)
    MongoStore(mongo_db, clock=clock).ensure_indexes()
    index = mongo_db["voiceclonings"].index_information()["idempotencyKey_unique"]
    assert index["unique"] is True and index["partialFilterExpression"] == {"idempotencyKey": {"$type": "string"}}
    assert submit(store, "c" * 24, key="k") == ("c" * 24, True)
    assert submit(store, "d" * 24, key="k") == ("c" * 24, False)


def test_a_fence_field_another_writer_stored_in_another_field_order_still_matches(mongo, clock):
    """The swap's filter is what was read, in the stored field order: a reordered lease (a real server compares the order) still renews."""
    store, db = mongo
    submit(store)
    store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    jobs = db["voiceclonings"]
    lease = jobs.find_one({"_id": ObjectId(JOB_ID)})["lease"]
    jobs.update_one({"_id": ObjectId(JOB_ID)}, {"$set": {"lease": dict(reversed(list(lease.items())))}})
    clock.advance(10)
    store.renew_lease(JOB_ID, "t1", LEASE_S)  # StaleWrite if its filter missed the reordered lease
    renewed = store.get_job(JOB_ID)["lease"]
    assert renewed["token"] == "t1" and renewed["expiresAt"] == clock.now + timedelta(seconds=LEASE_S)


def test_on_the_server_the_stores_clock_is_the_servers(mongo_db):
    """The real server answers hello with its localTime, so a store without a clock uses it, without the fallback warning."""
    reported = server_local_time(mongo_db)
    assert reported is not None and reported.tzinfo is not None and reported.microsecond % 1000 == 0
    with capture_logs() as logs:
        MongoStore(mongo_db).now()
    assert [entry for entry in logs if entry["event"] == "store.server_clock_unavailable"] == []
