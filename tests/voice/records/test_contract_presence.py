"""Presence records on every store: upserted by workerId, lastSeen on the store's clock, removed, pruned."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from worker.voice.records.presence import PRESENCE_KEPT_S, is_stale, presence_record, stale_after_s
from worker.voice.records.sqlite import READ_ONLY, SqliteStore

SINCE = datetime(2024, 5, 1, 11, 0, 0, tzinfo=UTC)


def presence(worker_id: str = "host-a:11", **changes) -> dict:
    return {"workerId": worker_id, "host": "host-a", "version": "1.2.3", "state": "idle", "jobId": None,
            "since": SINCE, "device": "cuda", "intervalS": 60.0, **changes}


def test_a_worker_appears_once_with_the_stores_lastseen_and_its_latest_state(store, clock):
    """Two writes of one worker leave one record: the second's fields, lastSeen from the store's clock."""
    store.upsert_worker(presence())
    clock.advance(60)
    store.upsert_worker(presence(state="working", jobId="665f1c2e9b1e8a0012ab34cd"))
    [record] = store.list_workers()
    assert record == {"workerId": "host-a:11", "host": "host-a", "version": "1.2.3", "state": "working",
                      "jobId": "665f1c2e9b1e8a0012ab34cd", "since": SINCE, "device": "cuda",
                      "intervalS": 60.0, "lastSeen": clock.now.replace(microsecond=250_000)}


def test_workers_are_listed_by_id_and_a_removed_one_is_gone(store):
    """list_workers returns every worker by id; remove_worker deletes one, and removing it again is no error."""
    for worker_id in ("b:2", "a:1", "c:3"):
        store.upsert_worker(presence(worker_id))
    assert [r["workerId"] for r in store.list_workers()] == ["a:1", "b:2", "c:3"]
    store.remove_worker("b:2")
    store.remove_worker("b:2")
    assert [r["workerId"] for r in store.list_workers()] == ["a:1", "c:3"]


def test_only_the_known_fields_are_kept_and_text_is_clipped(store):
    """A presence with extra fields, long text or a non-finite interval is stored as the known fields only."""
    store.upsert_worker(presence(host="h" * 500, extra="dropped", intervalS=float("nan"), since="yesterday"))
    [record] = store.list_workers()
    assert "extra" not in record and len(record["host"]) == 200
    assert record["intervalS"] is None and record["since"] is None


def test_a_worker_silent_for_a_day_is_dropped(store, clock):
    """Any worker's write prunes records whose lastSeen is over PRESENCE_KEPT_S old on the store's clock."""
    store.upsert_worker(presence("gone:1"))
    clock.advance(PRESENCE_KEPT_S - 1)
    store.upsert_worker(presence("live:2"))
    assert [r["workerId"] for r in store.list_workers()] == ["gone:1", "live:2"]
    clock.advance(2)
    store.upsert_worker(presence("live:2"))
    assert [r["workerId"] for r in store.list_workers()] == ["live:2"]


def test_a_read_only_file_no_worker_wrote_presence_to_lists_none(tmp_path):
    """A records file from before presence existed, opened read-only, lists no workers instead of failing."""
    import sqlite3

    path = tmp_path / "old.db"
    sqlite3.connect(path).execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, doc TEXT)").connection.close()
    store = SqliteStore(str(path), mode=READ_ONLY)
    assert store.list_workers() == []
    store.close()


def test_a_presence_without_a_worker_id_is_refused():
    """presence_record raises for a presence that names no worker: there is nothing to key it by."""
    with pytest.raises(ValueError):
        presence_record({"workerId": ""}, datetime.now(UTC))


@pytest.mark.parametrize(("age_s", "interval_s", "stale"), [
    (0, 60.0, False), (stale_after_s(60.0), 60.0, False), (stale_after_s(60.0) + 1, 60.0, True),
    (100, None, True), (100, 60.0, False)])
def test_a_worker_is_stale_past_a_few_of_its_own_ticks(age_s, interval_s, stale):
    """is_stale judges lastSeen against 3 of the record's ticks and 30 s, else the reader's interval (20 s here)."""
    now = datetime(2024, 5, 1, 12, tzinfo=UTC)
    record = {"lastSeen": now - timedelta(seconds=age_s), "intervalS": interval_s}
    assert is_stale(record, now, default_interval_s=20.0) is stale


def test_a_record_without_a_readable_lastseen_is_stale():
    """A lastSeen that is missing or not an aware time counts as stale."""
    now = datetime(2024, 5, 1, 12, tzinfo=UTC)
    assert is_stale({}, now, 60.0) and is_stale({"lastSeen": "now"}, now, 60.0)
