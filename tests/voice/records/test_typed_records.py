"""The typed records at the store boundary: what every store's reads hand the worker, on SQLite, mongomock
and a real MongoDB server."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import ARTIFACT_KEY, REQUIRED_ARTIFACTS
from tests.voice.conftest import message_body
from tests.voice.records.conftest import JOB_ID, MODEL_PATHS, PROFILE_ID, S3_PATHS, claim, commit, submit
from worker.core.names import is_sha256_hex
from worker.voice.errors import MalformedRecord
from worker.voice.job import recorded_failure, refuse_malformed
from worker.voice.message import parse_job
from worker.voice.records.models import JobRecord, ProfileRecord, read_job, read_profile
from worker.voice.records.mongo import db_id
from worker.voice.records.rules import (
    COMPLETED,
    ERROR,
    committed_artifacts,
    failed_attempts,
    is_complete,
    usage,
    vouched_mirrors,
)
from worker.voice.records.sqlite import SqliteStore

SHA = "a" * 64
TOKEN = "0123456789abcdef0123456789abcdef"


def malform(store, fields: dict, *, table: str = "jobs", record_id: str = JOB_ID) -> None:
    """Set fields on the stored document as another writer would: past every rule of the store."""
    if isinstance(store, SqliteStore):
        (text,) = store._conn.execute(f"SELECT doc FROM {table} WHERE id = ?", (record_id,)).fetchone()
        store._conn.execute(f"UPDATE {table} SET doc = ? WHERE id = ?",
                            (json.dumps({**json.loads(text), **fields}), record_id))
    else:
        collection = store._jobs if table == "jobs" else store._profiles
        collection.update_one({"_id": db_id(record_id)}, {"$set": fields})


def add_to_first_entry(store, field: str, value: object) -> None:
    """Add a field to the stored job's first history entry, as another writer would."""
    if isinstance(store, SqliteStore):
        (text,) = store._conn.execute("SELECT doc FROM jobs WHERE id = ?", (JOB_ID,)).fetchone()
        doc = json.loads(text)
        doc["history"][0][field] = value
        store._conn.execute("UPDATE jobs SET doc = ? WHERE id = ?", (json.dumps(doc), JOB_ID))
    else:
        store._jobs.update_one({"_id": db_id(JOB_ID)}, {"$set": {f"history.0.{field}": value}})


def job_message():
    return parse_job(message_body(JOB_ID, PROFILE_ID))


# ---------------------------------------------------------------- strict where the worker decides

@pytest.mark.parametrize("fields, line", [
    ({"attempts": "three"}, "job attempts: text ('three'), not a count (a whole number from 0)"),
    ({"failedAttempts": 1.5}, "job failedAttempts: a number (1.5), not a count (a whole number from 0)"),
    ({"cancelRequested": "false"}, "job cancelRequested: text ('false'), not true or false"),
    ({"lease": {"token": "t", "expiresAt": "soon"}}, "job lease.expiresAt: text ('soon'), not a time"),
    ({"history": [{"outcome": "running"}, 7]}, "job history[1]: a number (7), not a document"),
    ({"status": "error", "error": {"type": "X", "retryable": "no"}}, "job error.retryable: text ('no'), not true or false"),
])
def test_a_wrong_typed_field_is_a_malformed_record_naming_it_on_every_store(store, fields, line):
    """A field the worker decides on, stored in a type it never writes, reads as a problem and refuses the job
    before any claim as one MalformedRecord line naming that field, whatever the store."""
    submit(store)
    malform(store, fields)
    record, profile = store.get_job(JOB_ID), store.get_profile(PROFILE_ID)
    assert isinstance(record, JobRecord) and isinstance(profile, ProfileRecord)

    with pytest.raises(MalformedRecord) as raised:
        refuse_malformed(store, job_message(), record, profile)

    assert raised.value.problems == [line]
    assert store.get_job(JOB_ID)["error"]["type"] == "MalformedRecord"  # recorded before any claim


def test_a_wrong_typed_profile_path_is_a_malformed_record_on_every_store(store):
    """A profile's path that is no text is the profile's problem, named under its key."""
    submit(store)
    malform(store, {"modelPaths": {"fullModel": 42}}, table="profiles", record_id=PROFILE_ID)

    with pytest.raises(MalformedRecord) as raised:
        refuse_malformed(store, job_message(), store.get_job(JOB_ID), store.get_profile(PROFILE_ID))

    assert raised.value.problems == ["profile modelPaths.fullModel: a number (42), not a path"]


def test_a_record_as_the_worker_writes_it_reads_typed_in_utc_on_every_store(store, clock):
    """Every store hands back the same typed record: aware UTC times, counts, the lease, the history entry."""
    submit(store)
    claimed = claim(store, TOKEN)
    record = store.get_job(JOB_ID)

    assert record.problems == () and claimed.job is not None and claimed.job.problems == ()
    assert (record.id, record.profile_id, record.status, record.attempts) == (JOB_ID, PROFILE_ID, "processing", 1)
    assert record.lease is not None and record.lease.token == TOKEN
    assert record.lease.expires_at == clock.now + timedelta(seconds=300)
    assert all(moment.tzinfo == UTC for moment in (record.created_at, record.started_at, record.lease.expires_at))
    [entry] = record.history
    assert entry is not None and (entry.token, entry.attempt, entry.outcome) == (TOKEN, 1, "running")


def test_a_naive_stored_time_reads_as_utc_on_every_store(store):
    """A time another writer stored without an offset (BSON's own meaning; SQLite JSON text without one) is UTC."""
    submit(store)
    naive = datetime(2026, 12, 1, 9, 30)
    if isinstance(store, SqliteStore):
        malform(store, {"createdAt": {"$date": naive.isoformat()}})
    else:
        malform(store, {"createdAt": naive})

    assert store.get_job(JOB_ID).created_at == naive.replace(tzinfo=UTC)


# ---------------------------------------------------------------- unknown fields pass through

def test_unknown_fields_survive_a_read_modify_write_on_every_store(store):
    """Fields no model names (a job's quality and baseModel, an entry's per-metric series, a profile's own)
    are on the typed record and still stored after a claim, every fenced write and the commit."""
    submit(store, quality={"mos": 4.1}, baseModel="xtts-v2")
    malform(store, {"ownedBy": "product"}, table="profiles", record_id=PROFILE_ID)
    claim(store, TOKEN)
    add_to_first_entry(store, "series", {"loss": [0.9, 0.5]})

    record = store.get_job(JOB_ID)
    assert (record.model_extra or {})["quality"] == {"mos": 4.1} and record.model_extra["baseModel"] == "xtts-v2"
    assert (record.history[0].model_extra or {})["series"] == {"loss": [0.9, 0.5]}
    assert (store.get_profile(PROFILE_ID).model_extra or {})["ownedBy"] == "product"

    store.renew_lease(JOB_ID, TOKEN, 300.0, gpu_seconds=5.0)
    store.set_progress(JOB_ID, TOKEN, "train_full", 50.0)
    store.record_note(JOB_ID, TOKEN, "dataset", "2 clips left out")
    store.record_mirror(JOB_ID, TOKEN, "checkpoints/train_full", SHA)
    commit(store, TOKEN)

    job, profile = store.get_job(JOB_ID), store.get_profile(PROFILE_ID)
    assert (job["quality"], job["baseModel"], job["history"][0]["series"]) == (
        {"mos": 4.1}, "xtts-v2", {"loss": [0.9, 0.5]})
    assert profile["ownedBy"] == "product" and is_complete(job, profile)


# ---------------------------------------------------------------- the rules over typed records

# The decisions as the rules made them on stored dicts before the typed records: the oracle the typed
# rules are held to. Numbers stay within what the worker writes (whole counts, seconds from 0): a
# fractional count or a negative time now reads as none, as the commands always showed it.
def dict_is_complete(job: dict | None, profile: dict | None) -> bool:
    if not job or not profile or job.get("status") != COMPLETED or profile.get("status") != COMPLETED:
        return False
    keys = job.get("artifacts")
    if not (isinstance(keys, list) and keys and all(isinstance(k, str) and ARTIFACT_KEY.fullmatch(k) for k in keys)):
        keys = REQUIRED_ARTIFACTS
    for field in ("modelPaths", "s3Paths"):
        paths = profile.get(field) or {}
        if not isinstance(paths, dict) or not all(isinstance(paths.get(k), str) and paths.get(k) for k in keys):
            return False
    return True


def dict_failed_attempts(job: dict) -> int:
    count = job.get("failedAttempts")
    return int(count) if isinstance(count, int | float) and not isinstance(count, bool) and 0 <= count < 2**31 else 0


def dict_usage(job: dict) -> dict[str, float]:
    def seconds(value: object) -> float:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

    total, wasted = seconds(job.get("earlierGpuSeconds")), seconds(job.get("earlierWastedGpuSeconds"))
    for entry in job["history"] if isinstance(job.get("history"), list) else []:
        if isinstance(entry, dict):
            total += seconds(entry.get("gpuSeconds"))
            if entry.get("outcome") not in ("completed", "running"):
                wasted += seconds(entry.get("gpuSeconds"))
    return {"gpuSeconds": round(total, 3), "wastedGpuSeconds": round(wasted, 3)}


def dict_vouched(job: dict, own: str) -> list:
    found = []
    for entry in job["history"] if isinstance(job.get("history"), list) else []:
        if not isinstance(entry, dict):
            continue
        number, token, mirror = entry.get("attempt"), entry.get("token"), entry.get("mirror")
        if (type(number) is int and number >= 1 and isinstance(token, str) and token != own
                and len(token) >= 8 and all(c in "0123456789abcdef" for c in token) and isinstance(mirror, dict)):
            items = {k: v for k, v in mirror.items() if isinstance(k, str) and is_sha256_hex(v)}
            if items:
                found.append((number, token, items))
    return sorted(found, key=lambda f: f[0], reverse=True)


ODD = st.none() | st.booleans() | st.text(max_size=4) | st.lists(st.integers(0, 3), max_size=2) | st.just({})


def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` three times in four, else a value of another shape (another writer's)."""
    return st.integers(0, 3).flatmap(lambda n: ODD if n == 0 else valid)


COUNT = mostly(st.integers(0, 50) | st.integers(0, 50).map(float))
SECONDS = mostly(st.integers(0, 10**6) | st.floats(0, 1e6, allow_nan=False))
STATUS = mostly(st.sampled_from(["pending", "processing", "completed", "error", "cancelled", "queued"]))
KEYS = mostly(st.lists(st.sampled_from([*REQUIRED_ARTIFACTS, "vocoder", "bad key"]), max_size=6, unique=True))
ENTRY = st.fixed_dictionaries({
    "attempt": mostly(st.integers(-1, 5)), "token": mostly(st.sampled_from([TOKEN, "f" * 32, "../x", "t"])),
    "outcome": mostly(st.sampled_from(["running", "completed", "retry", "released"])), "gpuSeconds": SECONDS,
    "mirror": mostly(st.dictionaries(st.sampled_from(["a", "b"]), st.sampled_from([SHA, "nope"]), max_size=2))})
JOB = st.fixed_dictionaries({"_id": st.just(JOB_ID)}, optional={
    "status": STATUS, "attempts": COUNT, "failedAttempts": COUNT, "earlierGpuSeconds": SECONDS,
    "earlierWastedGpuSeconds": SECONDS, "history": mostly(st.lists(mostly(ENTRY), max_size=4)), "artifacts": KEYS})
PATHS = mostly(st.dictionaries(st.sampled_from([*REQUIRED_ARTIFACTS, "vocoder"]),
                               st.sampled_from(["/m/x", "/m/x", "", None, 3]), min_size=4))
PROFILE = st.fixed_dictionaries({"_id": st.just(PROFILE_ID)}, optional={
    "status": STATUS, "modelPaths": PATHS, "s3Paths": PATHS})


@settings(max_examples=300, deadline=None)
@given(JOB, PROFILE)
def test_the_rules_over_typed_records_decide_as_they_did_over_stored_dicts(job, profile):
    """Complete, failed attempts, GPU cost and vouched mirrors come out the same from the typed record as from
    the stored document, malformed fields included."""
    record, paths = read_job(job), read_profile(profile)
    assert is_complete(record, paths) is dict_is_complete(job, profile)
    assert failed_attempts(record) == dict_failed_attempts(job)
    assert {k: v for k, v in usage(record).items() if k != "attempts"} == dict_usage(job)
    assert vouched_mirrors(record, "f" * 32) == dict_vouched(job, "f" * 32)


def test_the_rules_over_typed_records_on_the_shapes_the_worker_writes():
    """The worker's own records: complete after the commit, the committed set, the cost, the budget, a
    permanent failure of this very message."""
    job = {"_id": JOB_ID, "status": COMPLETED, "artifacts": list(MODEL_PATHS), "attempts": 2, "failedAttempts": 1,
           "history": [{"token": TOKEN, "attempt": 1, "outcome": "retry", "gpuSeconds": 30.0,
                        "mirror": {"checkpoints/train_full": SHA}},
                       {"token": "f" * 32, "attempt": 2, "outcome": "completed", "gpuSeconds": 70.0}]}
    profile = {"_id": PROFILE_ID, "status": COMPLETED, "modelPaths": MODEL_PATHS, "s3Paths": S3_PATHS}
    record = read_job(job)
    assert is_complete(record, read_profile(profile)) and committed_artifacts(record) == tuple(MODEL_PATHS)
    assert not is_complete(record, read_profile({**profile, "status": "processing"}))
    assert usage(record) == {"attempts": 2, "gpuSeconds": 100.0, "wastedGpuSeconds": 30.0}
    assert failed_attempts(record) == 1
    assert vouched_mirrors(record, "f" * 32) == [(1, TOKEN, {"checkpoints/train_full": SHA})]

    failed = read_job({"_id": JOB_ID, "status": ERROR, "error": {"type": "BadRecording", "message": "not audio",
                                                                 "retryable": False, "messageId": "m-1"}})
    message = type("M", (), {"message_id": "m-1", "receive_count": 2})()
    assert recorded_failure(failed, message).error_type == "BadRecording"  # type: ignore[union-attr]
    assert recorded_failure(read_job({**failed.document, "error": {**failed.document["error"], "deadLetter": {}}}),
                            message) is None
