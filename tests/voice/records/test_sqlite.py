"""SQLite-only behaviour: safety across processes and threads, and error translation."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from datetime import UTC, datetime, timedelta

import pytest

from tests.voice.records.conftest import JOB_ID, LEASE_S, MODEL_PATHS, PROFILE_ID, S3_PATHS, submit
from worker.voice.records import rules
from worker.voice.records.errors import StaleWrite, StoreError
from worker.voice.records.sqlite import SqliteStore

PROCESSES = 4
# Many rounds per run: one contested claim overlaps only for microseconds, so a single round could
# pass by luck even with a broken transaction.
ROUNDS = 30


def _job_id(round_no: int) -> str:
    return f"{round_no:024x}"


def _in_process(path: str, n: int, ready, results, act) -> None:
    # Any failure is reported as a result, so the parent fails fast instead of waiting on the queue.
    try:
        store = SqliteStore(path)
        try:
            ready.wait(20)
            results.put(act(store, n))
        finally:
            store.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put([("error", repr(exc))])


def _claim_all(store: SqliteStore, n: int) -> list[tuple[str, str]]:
    return [(_job_id(r), store.claim(_job_id(r), owner=f"w{n}", token=f"t{n}", lease_s=LEASE_S).outcome)
            for r in range(ROUNDS)]


def _submit_all(store: SqliteStore, n: int) -> list[tuple[str, bool]]:
    # Every process offers its own job id for each key; only one per key may be created.
    return [submit(store, f"{n:08x}{r:016x}", f"{n:08x}{r:016x}"[::-1], key=f"request-{r}")
            for r in range(ROUNDS)]


def _run_in_processes(act, path: str) -> list:
    # spawn: children share nothing with this process but the file, like separate workers.
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_in_process, args=(path, n, ready, results, act))
             for n in range(PROCESSES)]
    for proc in procs:
        proc.start()
    out = [item for _ in procs for item in results.get(timeout=60)]
    for proc in procs:
        proc.join(10)
    assert [item for item in out if item[0] == "error"] == []
    return out


def test_claim_race_across_processes_has_one_winner(tmp_path):
    """Four processes claiming the same jobs on one file: each job has exactly one "claimed", the rest "held"."""
    path = str(tmp_path / "records.db")
    with SqliteStore(path) as store:
        for r in range(ROUNDS):
            submit(store, _job_id(r), _job_id(r)[::-1])
    outcomes = _run_in_processes(_claim_all, path)
    with SqliteStore(path) as store:
        for r in range(ROUNDS):
            mine = sorted(outcome for job_id, outcome in outcomes if job_id == _job_id(r))
            assert mine == ["claimed"] + ["held"] * (PROCESSES - 1)
            job = store.get_job(_job_id(r))
            assert job["attempts"] == 1 and len(job["history"]) == 1
            assert store.get_profile(_job_id(r)[::-1])["claims"] == [
                {"jobId": _job_id(r), "token": job["lease"]["token"], "epoch": 1}]


def test_submit_race_across_processes_creates_one_job(tmp_path):
    """Four processes submitting under the same idempotency keys create one job per key, and all get its id."""
    path = str(tmp_path / "records.db")
    SqliteStore(path).close()
    results = _run_in_processes(_submit_all, path)
    created = [job_id for job_id, was_created in results if was_created]
    assert len(created) == ROUNDS
    assert {job_id for job_id, _ in results} == set(created)
    with SqliteStore(path) as store:
        offered = [f"{n:08x}{r:016x}" for n in range(PROCESSES) for r in range(ROUNDS)]
        assert sum(store.get_job(job_id) is not None for job_id in offered) == ROUNDS


def test_uses_write_ahead_logging(tmp_path):
    """The file is in WAL mode, so readers in other processes never block the writer."""
    path = str(tmp_path / "records.db")
    SqliteStore(path).close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_locked_beyond_busy_timeout_is_store_error(tmp_path):
    """A write lock held past the busy timeout surfaces as StoreError chained to sqlite's error, and the store recovers."""
    path = str(tmp_path / "records.db")
    store = SqliteStore(path, busy_timeout_s=0.05)
    submit(store)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreError) as caught:
            store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S).outcome == "claimed"
    store.close()


def test_failed_write_rolls_back(tmp_path, monkeypatch):
    """An error in the middle of a swap leaves the record as it was and no open transaction behind."""
    path = str(tmp_path / "records.db")
    store = SqliteStore(path)
    submit(store)
    assert store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S).outcome == "claimed"
    before = store.get_profile(PROFILE_ID)

    def broken_profile_write(*_args):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(SqliteStore, "_put_profile", staticmethod(broken_profile_write))
    with pytest.raises(StoreError):
        store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    assert store.get_profile(PROFILE_ID) == before
    monkeypatch.undo()
    store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    assert store.get_profile(PROFILE_ID)["modelPaths"] == MODEL_PATHS
    store.close()


def test_closed_store_raises_store_error(tmp_path):
    """Using a closed store is a StoreError, not a raw sqlite3 exception; closing twice is harmless."""
    store = SqliteStore(str(tmp_path / "records.db"))
    store.close()
    store.close()
    with pytest.raises(StoreError):
        store.get_job(JOB_ID)


def test_unopenable_path_is_store_error(tmp_path):
    """A path that cannot be opened is a StoreError."""
    with pytest.raises(StoreError):
        SqliteStore(str(tmp_path / "missing-dir" / "records.db"))


def test_heartbeat_thread_and_main_thread_share_the_store(tmp_path):
    """Renewals from one thread and progress from another interleave on one store without errors."""
    store = SqliteStore(str(tmp_path / "records.db"))
    submit(store)
    store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
    errors: list[BaseException] = []

    def renew_many() -> None:
        try:
            for _ in range(100):
                store.renew_lease(JOB_ID, "t1", LEASE_S)
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread below
            errors.append(exc)

    heartbeat = threading.Thread(target=renew_many)
    heartbeat.start()
    for n in range(100):
        store.set_progress(JOB_ID, "t1", "train_full", n)
    heartbeat.join()
    assert errors == []
    assert store.get_job(JOB_ID)["progress"]["percent"] == 99
    store.mark_job_completed(JOB_ID, "t1")
    with pytest.raises(StaleWrite):
        store.renew_lease(JOB_ID, "t1", LEASE_S)
    store.close()


# ---------------------------------------------------------------- the profile's per-job claims

def test_file_with_the_old_profiles_schema_still_works(tmp_path):
    """A file made when profiles had a claim_token column opens, and two jobs of one profile both commit."""
    path = str(tmp_path / "records.db")
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE profiles (id TEXT PRIMARY KEY, doc TEXT NOT NULL, status TEXT NOT NULL, "
                 "claim_token TEXT)")
    conn.commit()
    conn.close()
    other = "665f1c2e9b1e8a0012ab34cf"
    with SqliteStore(path) as store:
        submit(store)
        submit(store, other)
        store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S)
        store.claim(other, owner="w2", token="t2", lease_s=LEASE_S)
        for job_id, token in ((JOB_ID, "t1"), (other, "t2")):
            store.write_paths(PROFILE_ID, token, MODEL_PATHS, S3_PATHS, job_id=job_id)
            store.mark_profile_completed(PROFILE_ID, token, job_id=job_id)
            store.mark_job_completed(job_id, token)
        assert store.get_profile(PROFILE_ID)["status"] == "completed"


def test_read_only_store_reads_and_refuses_every_write(tmp_path):
    """A store opened read-only reads the records and turns any write into StoreError, leaving them unchanged."""
    path = str(tmp_path / "records.db")
    with SqliteStore(path) as store:
        submit(store)
    with SqliteStore(path, mode="ro") as store:
        assert store.get_job(JOB_ID)["status"] == "pending"
        with pytest.raises(StoreError):
            store.request_cancel(JOB_ID)
    with SqliteStore(path) as store:
        assert store.get_job(JOB_ID)["cancelRequested"] is False


def test_read_only_store_is_not_created_where_there_is_no_file(tmp_path):
    """Opening a missing file read-only or for existing-only writes fails and creates nothing."""
    from worker.core.errors import ConfigError

    for mode in ("ro", "rw"):
        with pytest.raises(ConfigError):
            SqliteStore(str(tmp_path / "missing.db"), mode=mode)
    assert list(tmp_path.iterdir()) == []


def test_a_path_with_uri_characters_opens_the_file_it_names(tmp_path):
    """A file name with "?" and "#" is quoted into the URI, not read as its query or fragment."""
    path = tmp_path / "odd?name#1.db"
    with SqliteStore(str(path)) as store:
        submit(store)
    assert path.exists()
    with SqliteStore(str(path), mode="ro") as store:
        assert store.get_job(JOB_ID) is not None


# ---------------------------------------------------------------- the store's clock is SQLite's

def _host_now() -> datetime:
    return datetime.now(UTC)


@pytest.mark.parametrize("skew_s", [30, 300])
def test_a_process_with_a_skewed_clock_cannot_move_a_lease_on_the_file(tmp_path, monkeypatch, skew_s):
    """With SQLite's own clock, a process whose Python clock is off sees a live lease as live and stamps true times."""
    path = str(tmp_path / "records.db")
    with SqliteStore(path) as holder, SqliteStore(path) as skewed:
        submit(holder)
        before = rules.to_ms(_host_now())
        assert holder.claim(JOB_ID, owner="w1", token="t1", lease_s=10).outcome == "claimed"
        after = _host_now()
        monkeypatch.setattr(rules, "utc_now", lambda: _host_now() + timedelta(seconds=skew_s))
        refused = skewed.claim(JOB_ID, owner="w2", token="t2", lease_s=10)
        assert refused.outcome == "held" and refused.now < _host_now()
        expires_at = holder.get_job(JOB_ID)["lease"]["expiresAt"]
        assert before + timedelta(seconds=10) <= expires_at <= after + timedelta(seconds=10)
        assert skewed.find_stale() == []


def test_the_store_clock_is_sqlites_which_is_this_hosts(tmp_path, monkeypatch):
    """now() reads SQLite's clock (the host's), so a moved Python clock shows up as an offset, not a new now."""
    with SqliteStore(str(tmp_path / "records.db")) as store:
        monkeypatch.setattr(rules, "utc_now", lambda: _host_now() + timedelta(seconds=300))
        before = rules.to_ms(_host_now())
        now = store.now()
        assert before <= now <= _host_now() and now.tzinfo is not None
        assert store.clock_offset_s() < -290
