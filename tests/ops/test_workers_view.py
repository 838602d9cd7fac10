"""`workers`: each worker's presence with what it runs and for how long, stale ones marked, text and JSON."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta

import pytest

from worker.ops import cli
from worker.ops.workers_view import cmd_workers, render_row, worker_rows
from worker.voice.records.sqlite import SqliteStore

START = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(tmp_path, clock):
    store = SqliteStore(str(tmp_path / "records.db"), clock=clock)
    yield store
    store.close()


def presence(worker_id: str, state: str = "idle", job_id: str | None = None, since: datetime = START) -> dict:
    return {"workerId": worker_id, "host": worker_id.split(":")[0], "version": "1.2.3", "state": state,
            "jobId": job_id, "since": since, "device": "cuda", "intervalS": 60.0}


def test_workers_lists_each_with_its_job_time_in_state_and_stale_ones_marked(store, clock):
    """A busy worker shows its job and how long; one silent for over 3 ticks and 30 s shows STALE, listed last."""
    store.upsert_worker(presence("gone:1"))
    clock.now = START + timedelta(minutes=10)
    store.upsert_worker(presence("busy:2", "working", "665f1c2e9b1e8a0012ab34cd", since=START + timedelta(minutes=8)))
    clock.now = START + timedelta(minutes=10, seconds=12)
    out = io.StringIO()
    assert cmd_workers(store, as_json=False, default_interval_s=60, out=out) == 0
    assert out.getvalue().splitlines() == [
        "2 worker(s), 1 stale (silent for over 3 of its ticks and 30 s: 210 s with this heartbeat)",
        "busy:2  working  job 665f1c2e9b1e8a0012ab34cd  for 2m  seen 12s ago  cuda  v1.2.3  host busy",
        "gone:1  STALE idle  -  for 10m  seen 10m ago  cuda  v1.2.3  host gone"]


def test_workers_json_carries_the_records_with_stale_and_ages(store, clock):
    """--json prints the store's time and each record with stale, forS and seenAgoS, times as ISO text."""
    store.upsert_worker(presence("a:1", since=START - timedelta(seconds=30)))
    clock.now = START + timedelta(seconds=5)
    out = io.StringIO()
    cmd_workers(store, as_json=True, default_interval_s=60, out=out)
    shown = json.loads(out.getvalue())
    assert shown["now"] == "2024-05-01T12:00:05+00:00"
    [row] = shown["workers"]
    assert (row["workerId"], row["stale"], row["forS"], row["seenAgoS"]) == ("a:1", False, 35.0, 5.0)
    assert row["lastSeen"] == "2024-05-01T12:00:00+00:00"


def test_an_empty_fleet_says_so(store):
    """With no presence record, workers says none is running and exits 0."""
    out = io.StringIO()
    assert cmd_workers(store, as_json=False, default_interval_s=60, out=out) == 0
    assert out.getvalue().startswith("no worker presence recorded")


def test_what_another_process_wrote_is_shown_as_one_inert_line():
    """A record's text with line breaks and escape sequences is drawn on one line without them."""
    row = worker_rows([{**presence("evil\n:1", "working", "j\x1b[2J"), "lastSeen": START}], START, 60)[0]
    line = render_row(row)
    assert "\n" not in line and "\x1b" not in line


def test_the_command_reads_a_records_file_without_creating_one(tmp_path, monkeypatch, capsys, clock):
    """`python -m worker workers` lists the workers of STORE_URL's file, opened read-only."""
    path = tmp_path / "records.db"
    with SqliteStore(str(path)) as store:
        store.upsert_worker(presence("a:1"))
    monkeypatch.setenv("STORE_URL", f"sqlite:///{path}")
    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)
    assert cli.main(["workers", "--json"]) == 0
    assert [row["workerId"] for row in json.loads(capsys.readouterr().out)["workers"]] == ["a:1"]
    monkeypatch.setenv("STORE_URL", f"sqlite:///{tmp_path / 'absent.db'}")
    assert cli.main(["workers"]) == 2
    assert not (tmp_path / "absent.db").exists()
