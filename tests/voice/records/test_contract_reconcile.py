"""The Store contract, part three: the reconciler's operations, against SQLite and MongoDB (mongomock and a real server)."""

from __future__ import annotations

from datetime import UTC, timedelta

import mongomock
import pytest

from tests.voice.records.conftest import JOB_ID, LEASE_S, PROFILE_ID, claim, commit, race_after_first_read, submit
from worker.voice.records.mongo import MongoStore

STALE_S = 3600.0
OTHER = "f" * 24
DEAD_LETTER = {"messageId": "m-1", "receiveCount": 5, "errorType": "BadRecording",
               "errorMessage": "recording 0 is not audio", "sourceQueue": "https://sqs/q/jobs"}


# ---------------------------------------------------------------- enqueue stamps

def test_mark_enqueued_stamps_once(store, clock):
    """The first stamp writes enqueuedAt at the store's clock; a second one changes nothing."""
    submit(store)
    assert store.mark_enqueued(JOB_ID) is True
    clock.advance(5)
    assert store.mark_enqueued(JOB_ID) is False
    assert store.get_job(JOB_ID)["enqueuedAt"] == clock.now - timedelta(seconds=5)


def test_mark_enqueued_again_is_a_separate_stamp(store, clock):
    """again=True stamps reenqueuedAt once and leaves enqueuedAt alone."""
    submit(store)
    assert store.mark_enqueued(JOB_ID, again=True) is True
    assert store.mark_enqueued(JOB_ID, again=True) is False
    job = store.get_job(JOB_ID)
    assert job["reenqueuedAt"] == clock.now and job.get("enqueuedAt") is None


def test_mark_enqueued_on_a_missing_job_writes_nothing(store):
    """A stamp for a job that does not exist reports no write."""
    assert store.mark_enqueued(JOB_ID) is False
    assert store.get_job(JOB_ID) is None


def test_find_unenqueued_lists_old_pending_jobs_without_a_stamp(store, clock):
    """Only pending jobs past the age with neither stamp are listed, oldest first, up to the limit."""
    ids = [f"{n:024x}" for n in range(6)]
    for job_id in ids:
        submit(store, job_id, job_id[::-1])
        clock.advance(10)
    store.mark_enqueued(ids[1])
    store.mark_enqueued(ids[2], again=True)
    claim(store, "t", job_id=ids[3])
    clock.advance(80)  # ids[n] is now 140 - 10n s old: ids[4] exactly 100 s, ids[5] 90 s
    assert [j["_id"] for j in store.find_unenqueued(100)] == [ids[0], ids[4]]
    assert [j["_id"] for j in store.find_unenqueued(100, limit=1)] == [ids[0]]
    assert store.find_unenqueued(10_000) == []


# ---------------------------------------------------------------- worker lost

def test_mark_worker_lost_errors_a_long_expired_lease(store, clock):
    """Past the lease plus the stale age the job becomes a retryable WorkerLost error with one new history entry."""
    submit(store)
    claim(store, "t1", owner="w1")
    clock.advance(LEASE_S + STALE_S)
    assert store.mark_worker_lost(JOB_ID, stale_after_s=STALE_S, worker="reconciler") is True
    job = store.get_job(JOB_ID)
    assert job["status"] == "error" and job["lease"] is None
    assert job["error"]["type"] == "WorkerLost" and job["error"]["retryable"] is True
    assert "worker lost" in job["error"]["message"] and "w1" in job["error"]["message"]
    assert job["error"]["at"] == clock.now
    assert [h["outcome"] for h in job["history"]] == ["abandoned", "worker_lost"]
    assert job["history"][-1] == {"worker": "reconciler", "token": None, "start": clock.now,
                                  "end": clock.now, "outcome": "worker_lost"}


def test_mark_worker_lost_twice_writes_once(store, clock):
    """A second call finds nothing to do and leaves the record exactly as the first left it."""
    submit(store)
    claim(store, "t1")
    clock.advance(LEASE_S + STALE_S)
    store.mark_worker_lost(JOB_ID, stale_after_s=STALE_S, worker="r")
    after_first = store.get_job(JOB_ID)
    clock.advance(60)
    assert store.mark_worker_lost(JOB_ID, stale_after_s=STALE_S, worker="r") is False
    assert store.get_job(JOB_ID) == after_first


@pytest.mark.parametrize("setup", ["live", "recently_expired", "completed", "cancelled", "pending",
                                   "released_recently"])
def test_mark_worker_lost_leaves_jobs_that_are_not_lost(store, clock, setup):
    """Live or recently expired leases, final jobs, pending jobs and fresh releases are not touched."""
    submit(store)
    if setup != "pending":
        claim(store, "t1")
    if setup == "live":
        clock.advance(LEASE_S - 1)
    elif setup == "recently_expired":
        clock.advance(LEASE_S + STALE_S - 1)
    elif setup == "completed":
        commit(store, "t1")
    elif setup == "cancelled":
        store.mark_cancelled(JOB_ID, "t1")
    elif setup == "released_recently":
        clock.advance(STALE_S - 1)
        store.release_lease(JOB_ID, "t1")
    if setup in ("completed", "cancelled", "pending"):
        clock.advance(LEASE_S + STALE_S + 1)
    before, profile = store.get_job(JOB_ID), store.get_profile(PROFILE_ID)
    assert store.mark_worker_lost(JOB_ID, stale_after_s=STALE_S, worker="r") is False
    assert store.get_job(JOB_ID) == before and store.get_profile(PROFILE_ID) == profile


def test_mark_worker_lost_takes_a_release_nobody_picked_up(store, clock):
    """A released job (no lease) whose last heartbeat is older than the stale age is lost too."""
    submit(store)
    claim(store, "t1")
    store.release_lease(JOB_ID, "t1")
    clock.advance(STALE_S)
    assert store.mark_worker_lost(JOB_ID, stale_after_s=STALE_S, worker="r") is True
    assert [h["outcome"] for h in store.get_job(JOB_ID)["history"]] == ["released", "worker_lost"]


def test_mark_worker_lost_keeps_the_profile(store, clock):
    """The reconciler writes only the job: the profile (and its paths) stays as the worker left it."""
    submit(store)
    claim(store, "t1")
    profile = store.get_profile(PROFILE_ID)
    clock.advance(LEASE_S + STALE_S)
    store.mark_worker_lost(JOB_ID, stale_after_s=STALE_S, worker="r")
    assert store.get_profile(PROFILE_ID) == profile


@pytest.mark.parametrize("kind", ["mongomock", "mongo"])
def test_mongo_mark_worker_lost_racing_a_renewal_leaves_the_holder(request, clock, kind):
    """A lost-worker write that read an old lease loses if the holder renews before the write lands."""
    db = request.getfixturevalue("mongo_db") if kind == "mongo" else mongomock.MongoClient()["voice"]
    store, holder = (MongoStore(db, clock=clock) for _ in range(2))
    submit(store)
    holder.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    clock.advance(LEASE_S + STALE_S)
    race_after_first_read(store, lambda: holder.renew_lease(JOB_ID, "t1", LEASE_S))
    assert store.mark_worker_lost(JOB_ID, stale_after_s=STALE_S, worker="r") is False
    assert store.get_job(JOB_ID)["status"] == "processing"


# ---------------------------------------------------------------- dead letters

def test_record_dead_letter_errors_the_job_with_the_dlq_reason(store, clock):
    """A dead-lettered job becomes a permanent error naming the receives and the DLQ's error attributes."""
    submit(store)
    claim(store, "t1")
    clock.advance(LEASE_S)
    assert store.record_dead_letter(JOB_ID, dead_letter=DEAD_LETTER, worker="reconciler") is True
    job = store.get_job(JOB_ID)
    assert job["status"] == "error" and job["lease"] is None
    assert job["error"]["type"] == "BadRecording" and job["error"]["retryable"] is False
    assert job["error"]["message"] == "dead-lettered after 5 receives: BadRecording: recording 0 is not audio"
    assert job["error"]["deadLetter"] == DEAD_LETTER
    assert job["deadLetters"] == ["m-1"]
    assert [h["outcome"] for h in job["history"]] == ["abandoned", "dead_lettered"]


def test_record_dead_letter_applies_each_message_once(store, clock):
    """The same DLQ message never writes twice; another message for the job is a new transition."""
    submit(store)
    assert store.record_dead_letter(JOB_ID, dead_letter=DEAD_LETTER, worker="r") is True
    first = store.get_job(JOB_ID)
    clock.advance(60)
    assert store.record_dead_letter(JOB_ID, dead_letter=DEAD_LETTER, worker="r") is False
    assert store.get_job(JOB_ID) == first
    assert store.record_dead_letter(JOB_ID, dead_letter={**DEAD_LETTER, "messageId": "m-2"}, worker="r")
    assert store.get_job(JOB_ID)["deadLetters"] == ["m-1", "m-2"]


def test_record_dead_letter_without_error_attributes_says_dead_lettered(store):
    """A message SQS's own redrive moved carries no error attributes: the type says DeadLettered."""
    submit(store)
    store.record_dead_letter(JOB_ID, dead_letter={"messageId": "m-9", "receiveCount": 5}, worker="r")
    error = store.get_job(JOB_ID)["error"]
    assert error["type"] == "DeadLettered" and error["message"] == "dead-lettered after 5 receives"


@pytest.mark.parametrize("setup", ["live", "completed", "cancelled", "missing"])
def test_record_dead_letter_leaves_leased_and_final_jobs(store, clock, setup):
    """A job under a live lease, completed, cancelled or missing is not changed."""
    if setup != "missing":
        submit(store)
        claim(store, "t1")
    if setup == "completed":
        commit(store, "t1")
    elif setup == "cancelled":
        store.mark_cancelled(JOB_ID, "t1")
    before = store.get_job(JOB_ID)
    assert store.record_dead_letter(JOB_ID, dead_letter=DEAD_LETTER, worker="r") is False
    assert store.get_job(JOB_ID) == before


def test_history_stays_bounded_through_reconciler_entries(store, clock):
    """Reconciler entries count towards the history limit like attempts do."""
    from worker.voice.records.rules import HISTORY_LIMIT

    submit(store)
    for n in range(HISTORY_LIMIT + 3):
        store.record_dead_letter(JOB_ID, dead_letter={**DEAD_LETTER, "messageId": f"m-{n}"}, worker="r")
    job = store.get_job(JOB_ID)
    assert len(job["history"]) == HISTORY_LIMIT
    assert job["deadLetters"][-1] == f"m-{HISTORY_LIMIT + 2}"


# ---------------------------------------------------------------- the pure rules both stores decide with

def test_worker_lost_rule_needs_processing_and_an_end_older_than_the_stale_age():
    """Only a processing job whose lease (or, released, heartbeat) ended at least stale_after_s ago is lost."""
    from datetime import datetime

    from worker.voice.records.recovery import worker_lost

    now = datetime(2024, 5, 1, 12, tzinfo=UTC)
    ended = now - timedelta(seconds=STALE_S)
    leased = {"status": "processing", "lease": {"expiresAt": ended}}
    assert worker_lost(leased, now, STALE_S)
    assert not worker_lost({**leased, "lease": {"expiresAt": ended + timedelta(milliseconds=1)}}, now, STALE_S)
    assert not worker_lost({**leased, "status": "error"}, now, STALE_S)
    assert worker_lost({"status": "processing", "lease": None, "heartbeatAt": ended}, now, STALE_S)
    assert not worker_lost({"status": "processing", "lease": None, "heartbeatAt": now}, now, STALE_S)


def test_dead_letter_rule_refuses_final_leased_and_already_applied():
    """A dead letter applies to a job that is not final, not leased, and has not seen that message."""
    from datetime import datetime

    from worker.voice.records.recovery import may_record_dead_letter

    now = datetime(2024, 5, 1, 12, tzinfo=UTC)
    job = {"status": "processing", "lease": {"expiresAt": now}}
    assert may_record_dead_letter(job, "m-1", now)
    assert not may_record_dead_letter({**job, "lease": {"expiresAt": now + timedelta(seconds=1)}}, "m-1", now)
    assert not may_record_dead_letter({**job, "status": "completed"}, "m-1", now)
    assert not may_record_dead_letter({**job, "status": "cancelled"}, "m-1", now)
    assert not may_record_dead_letter({**job, "deadLetters": ["m-1"]}, "m-1", now)


def test_awaiting_enqueue_rule_needs_pending_old_and_unstamped():
    """Pending, created at least older_than_s ago, and neither stamp set."""
    from datetime import datetime

    from worker.voice.records.recovery import awaiting_enqueue

    now = datetime(2024, 5, 1, 12, tzinfo=UTC)
    job = {"status": "pending", "createdAt": now - timedelta(seconds=100)}
    assert awaiting_enqueue(job, now, 100)
    assert not awaiting_enqueue(job, now, 101)
    assert not awaiting_enqueue({**job, "enqueuedAt": now}, now, 100)
    assert not awaiting_enqueue({**job, "reenqueuedAt": now}, now, 100)
    assert not awaiting_enqueue({**job, "status": "processing"}, now, 100)
    assert not awaiting_enqueue({"status": "pending"}, now, 100)
