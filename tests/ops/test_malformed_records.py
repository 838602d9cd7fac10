"""`status`, `jobs` and `cancel` on records another writer malformed: `?` and a warning, never a traceback."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from tests.voice.records.conftest import WallClock
from worker.ops.commands import cmd_cancel, cmd_jobs, cmd_status
from worker.voice.records.sqlite import SqliteStore

BAD, GOOD = "b" * 24, ("a" * 24, "c" * 24)
YEAR_1_PLUS_5 = {"$date": "0001-01-01T00:00:00+05:00"}  # year 0 in UTC, as SQLite keeps a time

# Each malformed job document the issue names: (fields over a processing job, the field warned about,
# what `status` shows for it, what `jobs` shows for it).
MALFORMED = {
    "percent as text": ({"progress": {"stage": "train_full", "percent": "42"}}, "progress.percent",
                        "train_full ? %", "train_full ? % at"),
    "percent null": ({"progress": {"stage": "train_full", "percent": None}}, "progress.percent",
                     "train_full ? %", "train_full ? % at"),
    "updatedAt year 1 at +05:00": ({"progress": {"stage": "train_full", "percent": 5, "updatedAt": YEAR_1_PLUS_5}},
                                   "progress.updatedAt", "at ?", "% at ?"),
    "history as text": ({"history": "oops"}, "history", "  history    ?", None),
    "error as text": ({"status": "error", "error": "boom"}, "error", "  error      ?", "  error ?"),
    "lease as text": ({"lease": "w1"}, "lease", "  lease      ?", ", lease ?"),
    "attempts as text": ({"attempts": "three"}, "attempts", "(attempts: ?)", "attempts ?"),
}


@pytest.fixture
def store(tmp_path):
    clock = WallClock()
    store = SqliteStore(str(tmp_path / "records.db"), clock=clock)
    for job_id in (GOOD[0], BAD, GOOD[1]):
        store.submit({"_id": job_id, "profileId": "p"}, {"_id": "p"})
        store.claim(job_id, owner="w1", token=f"t{job_id[0]}", lease_s=600)
        store.set_progress(job_id, f"t{job_id[0]}", "train_full", 40.0)
        clock.advance(60)
    yield store
    store.close()


def malform(store: SqliteStore, job_id: str, fields: dict) -> None:
    """Write fields over the stored document as another writer would: past every rule of the store."""
    (text,) = store._conn.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
    doc = json.loads(text)  # times stay {"$date": ...}, as stored
    for key, value in fields.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) and isinstance(doc.get(key), dict) else value
    store._conn.execute("UPDATE jobs SET doc = ? WHERE id = ?", (json.dumps(doc), job_id))


@pytest.mark.parametrize("case", MALFORMED)
def test_status_of_a_malformed_job_shows_a_question_mark_and_a_warning(store, case):
    """`status` draws the job, the malformed field as `?`, with one warning naming the field on stderr, and exits 0."""
    fields, field, shown, _ = MALFORMED[case]
    malform(store, BAD, fields)
    out, err = io.StringIO(), io.StringIO()

    assert cmd_status(store, BAD, as_json=False, out=out, err=err) == 0

    assert out.getvalue().startswith(f"job {BAD}: ") and shown in out.getvalue()
    assert f"warning: job {BAD}: {field}: " in err.getvalue()


@pytest.mark.parametrize("case", MALFORMED)
def test_status_json_of_a_malformed_job_names_the_problem(store, case):
    """`status --json` prints the record as stored and the problems under "problems"."""
    fields, field, _, _ = MALFORMED[case]
    malform(store, BAD, fields)
    out = io.StringIO()

    assert cmd_status(store, BAD, as_json=True, out=out, err=io.StringIO()) == 0

    doc = json.loads(out.getvalue())
    assert doc["job"]["_id"] == BAD and [p["field"] for p in doc["problems"]] == [field]
    assert doc["problems"][0]["record"] == "job"


@pytest.mark.parametrize("case", MALFORMED)
def test_jobs_lists_every_job_with_the_malformed_one_as_a_question_mark(store, case):
    """`jobs` lists the two good jobs as usual and the malformed one on its own line, warned about on stderr."""
    fields, field, _, shown = MALFORMED[case]
    malform(store, BAD, fields)
    out, err = io.StringIO(), io.StringIO()

    assert cmd_jobs(store, out=out, err=err) == 0

    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines if not line.startswith(" ")][1:] == [GOOD[1], BAD, GOOD[0]]
    for good in GOOD:
        [at] = [n for n, line in enumerate(lines) if line.startswith(good)]
        assert lines[at].endswith("attempts 1") and lines[at + 1].startswith("  train_full 40 % at ")
    assert shown is None or any(shown in line for line in lines), lines
    assert all(BAD in line for line in err.getvalue().splitlines())
    assert f"warning: job {BAD}: {field}: " in err.getvalue()


class ListedStore:
    """A store whose listing hands back the given documents as they are (MongoDB can hold a NaN; SQLite's
    JSON functions cannot)."""

    def __init__(self, *docs):
        self.docs = list(docs)

    def list_jobs(self, status=None, since=None, limit=50):
        return self.docs


def test_jobs_json_prints_the_records_and_warns_on_stderr():
    """`jobs --json` keeps its array of records, odd values as JSON can hold them, and warns on stderr."""
    year_1 = datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5)))
    store = ListedStore({"_id": BAD, "status": "processing", "attempts": 10**5000, "blob": b"\x00",
                         "progress": {"stage": "s", "percent": float("nan"), "updatedAt": year_1}})
    out, err = io.StringIO(), io.StringIO()

    assert cmd_jobs(store, as_json=True, out=out, err=err) == 0

    [bad] = json.loads(out.getvalue())
    assert bad["progress"] == {"stage": "s", "percent": "nan", "updatedAt": "0001-01-01T00:00:00+05:00"}
    assert bad["attempts"] == "a number of 16610 bits" and bad["blob"] == "b'\\x00'"
    assert [line.split(": ")[2] for line in err.getvalue().splitlines()] == [
        "attempts", "progress.percent", "progress.updatedAt"]


def test_cancel_of_a_malformed_job_decides_and_warns(store):
    """`cancel` on a job whose progress and attempts are text warns, requests the cancel and names who stops."""
    malform(store, BAD, {"progress": "stuck", "attempts": "three"})
    out, err = io.StringIO(), io.StringIO()

    assert cmd_cancel(store, BAD, heartbeat_s=60, out=out, err=err) == 0

    assert store.get_job(BAD)["cancelRequested"] is True
    assert "the running attempt on w1 stops at its next heartbeat" in out.getvalue()
    assert err.getvalue().splitlines() == [
        f"warning: job {BAD}: attempts: text ('three'), not a count (a whole number from 0)",
        f"warning: job {BAD}: progress: text ('stuck'), not a document"]


def run_cli(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQS_", "STORE_", "MONGO_"))}
    env["STORE_URL"] = f"sqlite:///{tmp_path}/records.db"
    return subprocess.run([sys.executable, "-m", "worker", *argv], env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_commands_on_a_malformed_record_print_no_traceback(store, tmp_path):
    """On the command line, `status` and `jobs` of a record with several malformed fields exit 0, with warnings."""
    malform(store, BAD, {"attempts": "three", "history": "oops", "lease": "w1",
                         "progress": {"percent": None, "updatedAt": YEAR_1_PLUS_5}})

    status, jobs = run_cli(tmp_path, "status", BAD), run_cli(tmp_path, "jobs")

    for proc in (status, jobs):
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "warning: job" in proc.stderr and "?" in proc.stdout
    assert all(job_id in jobs.stdout for job_id in (*GOOD, BAD))


def test_a_time_the_store_cannot_decode_is_a_warning_not_a_traceback(store, tmp_path):
    """A time that is no time reaches `status` as a field the view warns about, and `status` exits 0."""
    malform(store, BAD, {"createdAt": {"$date": "not a time"}})

    proc = run_cli(tmp_path, "status", BAD)

    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert f"warning: job {BAD}: createdAt: " in proc.stderr


def test_a_job_that_cannot_be_drawn_does_not_hide_the_others(store, monkeypatch):
    """Should drawing one job fail all the same, `jobs` says so on that job's line and lists every other job."""
    from worker.ops import commands

    drawn = commands.render_job_line

    def fails_on_bad(job):
        if job.id == BAD:
            raise ValueError("a bug")
        return drawn(job)

    monkeypatch.setattr(commands, "render_job_line", fails_on_bad)
    out = io.StringIO()

    assert cmd_jobs(store, out=out, err=io.StringIO()) == 0

    assert f"{BAD}  (cannot be shown: ValueError)" in out.getvalue().splitlines()
    assert all(job_id in out.getvalue() for job_id in GOOD)


def test_watch_shows_the_warnings_under_the_block_it_redraws(store):
    """`status --watch` keeps the warnings in its block, where a redraw covers them, not on stderr between draws."""
    malform(store, BAD, {"progress": {"stage": "train_full", "percent": None}})
    out, err = io.StringIO(), io.StringIO()

    assert cmd_status(store, BAD, as_json=False, watch_s=1.0, out=out, err=err, tty=False,
                      sleep=lambda _s: store.mark_cancelled(BAD, "tb")) == 0

    assert err.getvalue() == ""
    assert out.getvalue().count(f"warning: job {BAD}: progress.percent: missing") == 2



def test_on_mongodb_a_date_before_year_1_in_utc_is_one_question_mark():
    """The backend's year 1 at +05:00 (year 0 in UTC, which no datetime holds) decodes through the
    store's codecs as a value the view calls unreadable: `jobs` lists every job, that field `?`.
    (The test's MongoDB wire server cannot hold such a date itself: its BSON is Python's too.)"""
    import bson
    from bson.codec_options import CodecOptions, DatetimeConversion

    from worker.voice.records.mongo import CLIENT_DATETIME_CONVERSION, connect_mongo, from_bson

    made: list[dict] = []

    class Client:
        def __init__(self, _uri, **options):
            made.append(options)
            self.admin = self

        def command(self, _name):
            return {"ok": 1}

    connect_mongo("mongodb://127.0.0.1:1/voice", client_factory=Client, max_attempts=1)
    assert made[0]["datetime_conversion"] == CLIENT_DATETIME_CONVERSION
    year_0 = bson.DatetimeMS(-62135614800000 - 5 * 3600 * 1000)
    codecs = CodecOptions(tz_aware=True, datetime_conversion=DatetimeConversion[made[0]["datetime_conversion"]])
    stored = {"_id": BAD, "profileId": "p", "status": "processing", "attempts": 1,
              "progress": {"stage": "train_full", "percent": 5.0, "updatedAt": year_0}}
    decoded = from_bson(bson.decode(bson.encode(stored), codec_options=codecs))
    good = [{"_id": job_id, "profileId": "p", "status": "pending", "attempts": 0} for job_id in GOOD]
    out, err = io.StringIO(), io.StringIO()

    assert cmd_jobs(ListedStore(good[0], decoded, good[1]), out=out, err=err) == 0
    assert {line.split()[0] for line in out.getvalue().splitlines()[1:] if not line.startswith(" ")} == {*GOOD, BAD}
    assert f"warning: job {BAD}: progress.updatedAt: " in err.getvalue() and "% at ?" in out.getvalue()


def test_sqlite_lists_every_job_around_a_nan_and_an_unreadable_date(store):
    """A NaN (which SQLite's JSON functions refuse) and a date no datetime holds, written into one
    document, cost `jobs` that document's fields, never the listing of the others."""
    malform(store, BAD, {"progress": {"stage": "train_full", "percent": float("nan"),
                                      "updatedAt": {"$date": "0000-12-31T19:00:00+00:00"}}})
    out, err = io.StringIO(), io.StringIO()

    assert cmd_jobs(store, out=out, err=err) == 0

    assert {line.split()[0] for line in out.getvalue().splitlines()[1:] if not line.startswith(" ")} == {*GOOD, BAD}
    assert f"warning: job {BAD}: progress.updatedAt: " in err.getvalue()


def test_a_lease_another_writer_left_as_text_can_still_be_cancelled_on_sqlite(store):
    """The store's index columns do not trip over a lease that is no document: the cancel request lands."""
    malform(store, BAD, {"lease": "w1"})

    assert store.request_cancel(BAD) is True
    assert store.get_job(BAD)["cancelRequested"] is True


def test_any_other_failure_of_an_operator_command_is_one_line(monkeypatch, capsys, tmp_path):
    """An exception no layer translated (a library's own) ends a command with one line naming its type, exit 1."""
    from worker.ops import cli
    from worker.settings import load_settings

    def broken(_settings, _args):
        raise KeyError("a library's own surprise")

    settings = load_settings({"STORE_URL": f"sqlite:///{tmp_path / 'records.db'}"})
    monkeypatch.setattr(cli, "load_settings", lambda: settings)

    assert cli._run_command(broken, "status", None) == 1
    err = capsys.readouterr().err
    assert err.startswith("status failed: KeyError: ") and len(err.splitlines()) == 1


def test_status_shows_what_an_attempts_stages_noted(store, tmp_path):
    """The notes on an attempt's entry (clips a stage left out) are drawn under that attempt."""
    store.record_note(GOOD[0], f"t{GOOD[0][0]}", "train_full", "left out 1 clip(s) after phonemising: clip 2 (utt00002)")
    out = io.StringIO()

    assert cmd_status(store, GOOD[0], as_json=False, out=out, err=io.StringIO()) == 0

    drawn = " ".join(line.strip().removeprefix("| ") for line in out.getvalue().splitlines())
    assert "note from train_full: left out 1 clip(s) after phonemising: clip 2 (utt00002)" in drawn
