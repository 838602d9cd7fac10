"""The Store contract under real concurrency: threads and processes racing swaps, claims, renewals and commits.

These run on SQLite and on the real MongoDB server only. mongomock cannot judge them: it is not safe
under threads (it loses compare-and-swap updates: 280 of 320 landed in one measured run) and cannot
be shared by processes.
"""

from __future__ import annotations

import multiprocessing
import threading
from datetime import timedelta

import pytest

from tests.voice.records.conftest import LEASE_S, MODEL_PATHS, S3_PATHS, make_store, submit
from worker.voice.records.errors import StaleWrite, StoreError
from worker.voice.records.mongo import MongoStore, connect_mongo

THREADS = 8
INCREMENTS = 40
# Sustained contention on one record may exhaust a swap's attempts (StoreError, nothing written).
CALLER_TRIES = 20
# Many rounds per run: one contested claim overlaps only briefly, so a single round could pass by
# luck even with a broken swap.
ROUNDS = 12
PROCESSES = 4


@pytest.fixture(params=["sqlite", "mongo"])
def shared_store(request, tmp_path, clock):
    store = make_store(request.param, tmp_path, clock, request)
    yield store
    store.close()


def _job_id(round_no: int) -> str:
    return f"{round_no:024x}"


def _profile_id(round_no: int) -> str:
    return _job_id(round_no)[::-1]


def _in_threads(count: int, act) -> list:
    """Run ``act(n)`` on ``count`` threads released together; their results, or the first failure raised."""
    barrier, results, errors = threading.Barrier(count), [], []

    def run(n: int) -> None:
        try:
            barrier.wait(30)
            results.append(act(n))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    assert len(results) == count
    return results


def test_concurrent_compare_and_swap_increments_are_never_lost(shared_store):
    """8 threads x 40 swaps incrementing one job's counter at once: every acknowledged swap lands exactly once."""
    submit(shared_store, _job_id(0), _profile_id(0))

    def increment(_n: int) -> int:
        landed = 0
        for _ in range(INCREMENTS):
            for _try in range(CALLER_TRIES):
                try:
                    _job, changed = shared_store._swap_job(
                        "increment", _job_id(0), lambda _job, _now: True,
                        lambda job, _now: {**job, "counter": job.get("counter", 0) + 1})
                except StoreError:
                    continue  # gave up under the contention, having written nothing: try again, as a caller would
                landed += changed
                break
            else:
                raise AssertionError(f"a swap gave up {CALLER_TRIES} times in a row")
        return landed

    assert _in_threads(THREADS, increment) == [INCREMENTS] * THREADS
    assert shared_store.get_job(_job_id(0))["counter"] == THREADS * INCREMENTS


def _claim_renew_commit(store, n: int, round_no: int) -> str:
    """Claim the round's job; the winner renews and commits, every other thread's commit must be refused."""
    token = f"t{n}"
    outcome = store.claim(_job_id(round_no), owner=f"w{n}", token=token, lease_s=LEASE_S).outcome
    if outcome != "claimed":
        try:
            store.write_paths(_profile_id(round_no), token, MODEL_PATHS, S3_PATHS, job_id=_job_id(round_no))
        except StaleWrite:
            return "refused"
        return "wrote without the claim"
    store.renew_lease(_job_id(round_no), token, LEASE_S)  # StaleWrite unless the lease is ours
    store.write_paths(_profile_id(round_no), token, MODEL_PATHS, S3_PATHS, job_id=_job_id(round_no))
    store.mark_profile_completed(_profile_id(round_no), token, job_id=_job_id(round_no))
    store.mark_job_completed(_job_id(round_no), token)
    return "committed"


def test_threads_racing_claims_renewals_and_commits_commit_each_job_once(shared_store):
    """Threads claiming each job at once: one claims, renews and commits; every other commit is refused."""
    for r in range(ROUNDS):
        submit(shared_store, _job_id(r), _profile_id(r))
    for r in range(ROUNDS):
        outcomes = _in_threads(THREADS, lambda n, r=r: _claim_renew_commit(shared_store, n, r))
        assert sorted(outcomes) == ["committed"] + ["refused"] * (THREADS - 1)
        job = shared_store.get_job(_job_id(r))
        assert job["status"] == "completed" and job["attempts"] == 1 and len(job["history"]) == 1
        assert shared_store.get_profile(_profile_id(r))["s3Paths"] == S3_PATHS


def test_a_heartbeat_thread_renewing_and_the_main_thread_reporting_progress_both_land(shared_store, clock):
    """Renewals from one thread and progress from another on one job interleave without a refused or lost write."""
    submit(shared_store, _job_id(0), _profile_id(0))
    shared_store.claim(_job_id(0), owner="w1", token="t1", lease_s=LEASE_S)
    clock.advance(1)  # so the renewals move the lease; each is a swap (a new revision) racing the progress

    def heartbeat_or_progress(n: int) -> None:
        for step in range(50):
            if n == 0:
                shared_store.renew_lease(_job_id(0), "t1", LEASE_S)
            else:
                shared_store.set_progress(_job_id(0), "t1", "train_full", step)

    _in_threads(2, heartbeat_or_progress)
    job = shared_store.get_job(_job_id(0))
    assert job["progress"]["percent"] == 49 and job["lease"]["token"] == "t1"
    assert job["lease"]["expiresAt"] == clock.now + timedelta(seconds=LEASE_S)


# ---------------------------------------------------------------- processes on the real server
# (SQLite's process races are in test_sqlite.py: there the processes share a file, here a server.)

def _claim_renew_commit_all(store, n: int) -> list[tuple[str, str]]:
    return [(_job_id(r), _claim_renew_commit(store, n, r)) for r in range(ROUNDS)]


def _submit_all(store, n: int) -> list[tuple[str, bool]]:
    # Every process offers its own job id for each key; only one per key may be created.
    return [submit(store, f"{n:08x}{r:016x}", f"{n:08x}{r:016x}"[::-1], key=f"request-{r}")
            for r in range(ROUNDS)]


def _in_server_process(uri: str, database: str, n: int, ready, results, act) -> None:
    # Any failure is reported as a result, so the parent fails fast instead of waiting on the queue.
    try:
        client = connect_mongo(uri, max_attempts=3, retry_delay_s=0.5)
        try:
            # The store's own clock, the server's: as separate workers on separate hosts would run.
            store = MongoStore(client[database])
            ready.wait(60)
            results.put(act(store, n))
        finally:
            client.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put([("error", repr(exc))])


def _run_in_server_processes(act, uri: str, database: str) -> list:
    # spawn: children share nothing with this process but the server, like separate workers.
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_in_server_process, args=(uri, database, n, ready, results, act))
             for n in range(PROCESSES)]
    for proc in procs:
        proc.start()
    out = [item for _ in procs for item in results.get(timeout=120)]
    for proc in procs:
        proc.join(10)
    assert [item for item in out if item[0] == "error"] == []
    return out


def test_processes_racing_claims_renewals_and_commits_on_the_server_commit_each_job_once(
        mongo_server_uri, mongo_db, clock):
    """Four processes racing for each job on one server: one claims, renews and commits it; the others are refused."""
    store = MongoStore(mongo_db, clock=clock)
    store.ensure_indexes()
    for r in range(ROUNDS):
        submit(store, _job_id(r), _profile_id(r))
    outcomes = _run_in_server_processes(_claim_renew_commit_all, mongo_server_uri, mongo_db.name)
    for r in range(ROUNDS):
        mine = sorted(outcome for job_id, outcome in outcomes if job_id == _job_id(r))
        assert mine == ["committed"] + ["refused"] * (PROCESSES - 1)
        job = store.get_job(_job_id(r))
        assert job["status"] == "completed" and job["attempts"] == 1 and len(job["history"]) == 1
        assert store.get_profile(_profile_id(r))["claims"] == [
            {"jobId": _job_id(r), "token": job["history"][0]["token"], "epoch": 1}]


def test_processes_submitting_under_the_same_keys_on_the_server_create_one_job_per_key(
        mongo_server_uri, mongo_db, clock):
    """Four processes submitting under the same idempotency keys create one job per key, and all get its id."""
    MongoStore(mongo_db, clock=clock).ensure_indexes()
    results = _run_in_server_processes(_submit_all, mongo_server_uri, mongo_db.name)
    created = [job_id for job_id, was_created in results if was_created]
    assert len(created) == ROUNDS
    assert {job_id for job_id, _ in results} == set(created)
    store = MongoStore(mongo_db, clock=clock)
    offered = [f"{n:08x}{r:016x}" for n in range(PROCESSES) for r in range(ROUNDS)]
    assert sum(store.get_job(job_id) is not None for job_id in offered) == ROUNDS
