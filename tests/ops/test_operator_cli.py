"""The operator's command line: redrive on the local moto server, quiet exits into a closed pipe,
--watch checked and drawn, layouts that fit 80 columns, --version, `jobs`, and a cancelled job's files."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from tests.ops.test_commands import PAYLOAD
from tests.support import FaultyClient, create_queues
from tests.voice.records.conftest import WallClock
from worker.ops import cli
from worker.ops.commands import (
    WIDTH,
    Watch,
    cmd_dlq_list,
    cmd_dlq_redrive,
    cmd_jobs,
    cmd_status,
    cmd_submit,
    error_line,
    parse_since,
    render_letter,
    render_status,
    status_document,
)
from worker.ops.dlq import DeadLetterQueue, move_task_missing
from worker.voice.records.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
HTML_PAGE = ("<!doctype html>\n<html lang=en>\n<title>500 Internal Server Error</title>\n"
             "<h1>Internal Server Error</h1>\n<p>The server encountered an internal error.</p>\n")


def suffix() -> str:
    return f"{os.getpid()}-{time.monotonic_ns()}"


def server_sqs(moto_server):
    return boto3.session.Session(aws_access_key_id="t", aws_secret_access_key="t",
                                 region_name="us-east-1").client("sqs", endpoint_url=moto_server)


def http_error(status: int, message: str, content_type: str, code: str | None = None) -> ClientError:
    return ClientError({"Error": {"Code": code or str(status), "Message": message},
                        "ResponseMetadata": {"HTTPStatusCode": status,
                                             "HTTPHeaders": {"content-type": content_type}}},
                       "StartMessageMoveTask")


def run_submit(store, sqs, queue_url, payload, as_json=True):
    out, err = io.StringIO(), io.StringIO()
    code = cmd_submit(lambda: contextlib.nullcontext(store), sqs, queue_url, io.StringIO(json.dumps(payload)),
                      as_json=as_json, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def clocked_store(tmp_path):
    clock = WallClock()
    store = SqliteStore(str(tmp_path / "records.db"), clock=clock)
    yield store, clock
    store.close()


# ---------------------------------------------------------------- 4. redrive on the local moto server


@pytest.mark.server
def test_redrive_on_the_moto_server_falls_back_and_prints_no_html(moto_server):
    """The moto server answers StartMessageMoveTask with an HTML 500: redrive moves the message by receive -> send -> delete."""
    sqs = server_sqs(moto_server)
    queues = create_queues(sqs, name=f"redrive-{suffix()}")
    sqs.send_message(QueueUrl=queues.dlq_url, MessageBody=json.dumps({"jobId": "a" * 24}))
    dlq = DeadLetterQueue.of(sqs, queues.url)
    assert dlq is not None
    out, err = io.StringIO(), io.StringIO()

    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=False, out=out, err=err) == 0

    text = out.getvalue() + err.getvalue()
    assert "moved 1 message(s)" in text and "the endpoint has no StartMessageMoveTask" in text
    assert "<" not in text and "html" not in text.lower().replace("an html page came back", "")
    [moved] = sqs.receive_message(QueueUrl=queues.url, WaitTimeSeconds=1)["Messages"]
    assert json.loads(moved["Body"])["jobId"] == "a" * 24


def test_a_json_5xx_from_sqs_is_a_failure_not_a_missing_operation(sqs, queues):
    """A real service error (JSON, with a code) stops the redrive with one line; only an HTML or 501 answer means "not implemented"."""
    assert move_task_missing(http_error(500, HTML_PAGE, "text/html; charset=utf-8"))
    assert move_task_missing(http_error(501, "Not Implemented", "application/json"))
    internal = http_error(500, "We encountered an internal error.", "application/x-amz-json-1.0", "InternalError")
    assert not move_task_missing(internal)
    client = FaultyClient(sqs)
    client.faults["start_message_move_task"] = lambda _kw: internal
    dlq = DeadLetterQueue.of(client, queues.url)
    out, err = io.StringIO(), io.StringIO()

    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=False, out=out, err=err) == 1

    assert err.getvalue().startswith("redrive stopped: StartMessageMoveTask") and "InternalError" in err.getvalue()
    assert not [op for op, *_ in client.calls if op == "receive_message"]


def test_an_html_page_in_a_failed_call_is_named_not_printed(sqs, queues):
    """A proxy's HTML 403 page stops the redrive with one line that says a page came back, without its markup."""
    client = FaultyClient(sqs)
    client.faults["start_message_move_task"] = lambda _kw: http_error(403, HTML_PAGE, "text/html")
    dlq = DeadLetterQueue.of(client, queues.url)
    err = io.StringIO()

    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=False, out=io.StringIO(), err=err) == 1

    [line] = err.getvalue().splitlines()
    assert "<" not in line and "an HTML page of" in line and line.startswith("redrive stopped:")


def test_an_error_line_keeps_the_first_line_of_a_multi_line_text():
    """Error texts of several lines print as their first line and a count of the rest."""
    assert error_line("store down\nTraceback (most recent call last):\n  x") == \
        "store down (and 2 more lines, not shown)"
    assert error_line("fine") == "fine"


# ---------------------------------------------------------------- 5. a reader that has gone


def closed_pipe_run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs ``python -m worker ARGV`` with stdout a pipe whose reader has already closed it (`| head` done early)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "worker", *argv], env=env, cwd=REPO, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)


def command_env(**settings: str) -> dict[str, str]:
    # Without PYTHONUNBUFFERED, as in an operator's shell: stdout into a pipe is then block-buffered,
    # and a reader that went away is found only when the buffer is flushed.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SQS_", "STORE_", "MONGO_", "AWS_")) and k != "PYTHONUNBUFFERED"}
    return {**env, "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t", "AWS_REGION": "us-east-1", **settings}


def test_status_into_a_closed_pipe_exits_141_quietly(tmp_path):
    """`status … | head` with head gone: nothing on stderr, exit 141 as git's."""
    db = tmp_path / "records.db"
    with SqliteStore(str(db)) as store:
        store.submit({"_id": "a" * 24, "profileId": "p"}, {"_id": "p"})
    proc = closed_pipe_run(["status", "a" * 24], command_env(STORE_URL=f"sqlite:///{db}"))
    assert (proc.returncode, proc.stderr) == (141, "")


@pytest.mark.server
def test_dlq_list_into_a_closed_pipe_exits_141_quietly(moto_server):
    """`dlq list | head` with head gone: nothing on stderr, exit 141."""
    sqs = server_sqs(moto_server)
    queues = create_queues(sqs, name=f"pipe-{suffix()}")
    sqs.send_message(QueueUrl=queues.dlq_url, MessageBody="{}")
    proc = closed_pipe_run(["dlq", "list"], command_env(SQS_QUEUE_URL=queues.url, AWS_ENDPOINT_URL=moto_server))
    assert (proc.returncode, proc.stderr) == (141, "")


@pytest.mark.parametrize("value", ["-5", "0", "nan", "soon"])
def test_watch_must_be_a_positive_number_of_seconds(value, capsys):
    """--watch -5, 0, nan or a word is refused by the parser: exit 2 with a message naming --watch."""
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["status", "a" * 24, "--watch", value])
    assert exited.value.code == 2
    assert "--watch: must be a number of seconds" in capsys.readouterr().err


class Ticks:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def watched(store, job_id: str, *, tty: bool, polls: list) -> str:
    """``status --watch 2`` output, running ``polls[i]()`` at the i-th sleep; the clock moves 2 s per sleep."""
    ticks, out = Ticks(), io.StringIO()

    def sleep(seconds):
        ticks.now_s += seconds
        polls.pop(0)()

    assert cmd_status(store, job_id, as_json=False, watch_s=2.0, out=out, sleep=sleep, clock=ticks, tty=tty) == 0
    return out.getvalue()


def test_watch_on_a_terminal_redraws_the_block_in_place(clocked_store):
    """On a TTY each poll moves the cursor back over the last block, clears, and draws again under the elapsed time."""
    store, _ = clocked_store
    job_id, _ = store.submit({"_id": "a" * 24, "profileId": "p"}, {"_id": "p"})
    store.claim(job_id, owner="w1", token="t", lease_s=60)
    text = watched(store, job_id, tty=True, polls=[lambda: None, lambda: store.mark_cancelled(job_id, "t")])
    draws = text.split("\x1b[")
    first_block_rows = len(draws[0].rstrip("\n").split("\n"))
    assert "0s since the watch began" in draws[0]
    assert draws[1].startswith(f"{first_block_rows}F") and draws[2].startswith("J")
    assert "2s since the watch began" in draws[2] and "4s since the watch began" in text
    assert text.count("\x1b[J") == 2 and text.rstrip().endswith("profile p: processing")


def test_watch_into_a_pipe_prints_only_what_changed(clocked_store):
    """Not a TTY: an unchanged poll prints nothing; a change prints the new block after the time since the start."""
    store, _ = clocked_store
    job_id, _ = store.submit({"_id": "a" * 24, "profileId": "p"}, {"_id": "p"})
    store.claim(job_id, owner="w1", token="t", lease_s=60)
    text = watched(store, job_id, tty=False,
                   polls=[lambda: None, lambda: None, lambda: store.mark_cancelled(job_id, "t")])
    assert "\x1b" not in text
    assert text.count(f"job {job_id}:") == 2 and "[6s later]" in text and "2s" not in text


def test_watch_counts_the_rows_of_a_line_longer_than_the_terminal():
    """A line wider than the terminal took several rows: the redraw moves up over all of them."""
    out = io.StringIO()
    watch = Watch(out, 2.0, tty=True, clock=Ticks(), columns=lambda: 40)
    watch.show("x" * 100)
    watch.show("y")
    # The header (65 characters: 2 rows) and the 100-character line (3 rows).
    assert "\x1b[5F\x1b[J" in out.getvalue()


# ---------------------------------------------------------------- 5. layouts that fit 80 columns


def long_job_document(store, clock) -> dict:
    job_id, _ = store.submit({"_id": "665f1c2e9b1e8a0012ab34cd", "profileId": "665f1c2e9b1e8a0012ab34ce"},
                             {"_id": "665f1c2e9b1e8a0012ab34ce"})
    store.claim(job_id, owner="ip-10-0-1-23:4242", token="t1", lease_s=600)
    clock.advance(1800)
    store.record_error(job_id, token="t1", error_type="StageFailed", retryable=True, gpu_seconds=1234.5,
                       message="stage train_full exited 1: " + "CUDA out of memory while allocating a tensor " * 5)
    store.claim(job_id, owner="ip-10-0-1-24:4243", token="t2", lease_s=600)
    store.set_progress(job_id, "t2", "train_full", 42.0, gpu_seconds=321.0,
                       detail={"step": 123_456, "stageIndex": 4, "stageCount": 5, "overallPercent": 37.33,
                               "etaS": 7265.0, "stageElapsedS": 3600.0, "device": "cuda",
                               "latest": {f"loss_term_{n}": 1 / 3 for n in range(10)}})
    return status_document(store, job_id)


def test_status_fits_80_columns_with_the_error_on_its_own_lines(clocked_store):
    """Two attempts, a lease, progress, cost and a long error: every line fits 80 columns and the error keeps every word."""
    store, clock = clocked_store
    text = render_status(long_job_document(store, clock))
    assert max(len(line) for line in text.splitlines()) <= WIDTH, text
    assert "  error      StageFailed (retryable)\n             | stage train_full exited 1" in text
    assert " ".join(line.strip("| ").strip() for line in text.splitlines() if "|" in line).count("CUDA") == 5
    assert "  attempt 1  2024-05-01 12:00:00Z -> 12:30:00Z  " in text
    assert "on ip-10-0-1-24:4243" in text and "GPU-s" in text and "  cost " in text


def test_dlq_list_fits_80_columns(sqs, queues, dlq):
    """A DLQ message with a 36-character id and a long error prints in blocks no wider than 80 columns."""
    block = render_letter({"messageId": "0f5c1b8e-3b4f-4b1a-9e6f-2d7c5a1e9b3c", "jobId": "665f1c2e9b1e8a0012ab34cd",
                           "receiveCount": 5, "ageSeconds": 90_000, "errorType": "BadRecording",
                           "errorMessage": "recording 2 of 3 is not audio: " + "s3://voice-recordings/a/b/c.wav " * 4})
    assert max(len(line) for line in block.splitlines()) <= WIDTH, block
    assert block.splitlines()[0] == "job 665f1c2e9b1e8a0012ab34cd  receives 5  age 1d01h"
    sqs.send_message(QueueUrl=queues.dlq_url, MessageBody="{}")
    out = io.StringIO()
    assert cmd_dlq_list(dlq, as_json=False, out=out) == 0
    assert max(len(line) for line in out.getvalue().splitlines()) <= WIDTH, out.getvalue()


# ---------------------------------------------------------------- 6. --version, jobs, a cancelled job's files


def test_version_prints_the_package_version(capsys):
    """`python -m worker --version` prints the package version (pyproject's, as worker.__version__) and exits 0."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"voice-worker {version('voice-worker')}"


def test_since_reads_iso_times_and_durations():
    """--since takes ISO 8601 (UTC without an offset) or a duration back from now; anything else is refused."""
    assert parse_since("2h") == timedelta(hours=2) and parse_since("30m") == timedelta(minutes=30)
    assert parse_since("1.5d") == timedelta(hours=36)
    assert parse_since("2026-12-01T09:00Z") == datetime(2026, 12, 1, 9, tzinfo=UTC)
    assert parse_since("2026-12-01 09:00") == datetime(2026, 12, 1, 9, tzinfo=UTC)
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_since("yesterday")


@pytest.mark.parametrize("argv", [["--status", "stuck"], ["--since", "yesterday"], ["--limit", "0"]])
def test_jobs_refuses_bad_arguments_with_exit_2(argv, capsys):
    """An unknown status, an unreadable --since or a --limit below 1 is a usage error (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["jobs", *argv])
    assert exited.value.code == 2 and argv[0] in capsys.readouterr().err


def test_jobs_lists_newest_first_with_what_each_is_doing(clocked_store):
    """`jobs` prints one line per job, newest first, with progress or error under it, in 80 columns."""
    store, clock = clocked_store
    for n in range(3):
        store.submit({"_id": f"{n + 1:024x}", "profileId": "p"}, {"_id": "p"})
        clock.advance(600)
    store.claim(f"{1:024x}", owner="w1", token="t", lease_s=600)
    store.set_progress(f"{1:024x}", "t", "train_full", 40.0)
    store.claim(f"{2:024x}", owner="w1", token="t2", lease_s=600)
    store.record_error(f"{2:024x}", token="t2", error_type="BadRecording", message="gone " * 40, retryable=False)
    out = io.StringIO()

    assert cmd_jobs(store, out=out) == 0

    lines = out.getvalue().splitlines()
    assert lines[0] == "3 job(s), newest first:"
    assert [line.split()[0] for line in lines if not line.startswith(" ")][1:] == [f"{n:024x}" for n in (3, 2, 1)]
    assert f"{1:024x}  processing  created 2024-05-01 12:00:00Z  attempts 1" in lines
    assert "  train_full 40 % at 2024-05-01 12:30:00Z, lease until 2024-05-01 12:40:00Z" in lines
    assert any(line.startswith("  BadRecording (permanent): gone gone") for line in lines)
    assert max(map(len, lines)) <= WIDTH


def test_jobs_filters_by_status_and_a_duration_on_the_store_clock(clocked_store):
    """--status and --since 20m (back from the store's clock) narrow the list; --json prints the records."""
    store, clock = clocked_store
    for n in range(3):
        store.submit({"_id": f"{n + 1:024x}", "profileId": "p"}, {"_id": "p"})
        clock.advance(600)
    out = io.StringIO()
    assert cmd_jobs(store, status="pending", since=timedelta(minutes=20), as_json=True, out=out) == 0
    assert [job["_id"] for job in json.loads(out.getvalue())] == [f"{3:024x}", f"{2:024x}"]
    out = io.StringIO()
    assert cmd_jobs(store, status="completed", out=out) == 0
    assert out.getvalue() == "no completed jobs\n"
    out = io.StringIO()
    assert cmd_jobs(store, limit=2, out=out) == 0
    assert "the newest 2: --limit N for more" in out.getvalue()
    out = io.StringIO()
    assert cmd_jobs(store, status="pending", since=timedelta(minutes=20), limit=1, out=out) == 0
    assert out.getvalue().splitlines()[0].startswith(
        "1 pending job(s) created since 2024-05-01 12:10:00Z, newest first (the newest 1")
    out = io.StringIO()
    assert cmd_jobs(store, status="completed", since=timedelta(minutes=20), out=out) == 0
    assert out.getvalue() == "no completed jobs created since 2024-05-01 12:10:00Z\n"


def test_status_of_a_cancelled_job_shows_none_of_the_profiles_files(clocked_store):
    """A job that completed shows the files it committed; a later job of that profile, cancelled, shows none of them."""
    store, _ = clocked_store
    first, _ = store.submit({"_id": "a" * 24, "profileId": "p"}, {"_id": "p"})
    store.claim(first, owner="w1", token="t1", lease_s=60)
    store.write_paths("p", "t1", {"fullModel": "/work/a/fullModel.pth"}, {"fullModel": "s3://m/a/fullModel.pth"},
                      job_id=first)
    store.mark_profile_completed("p", "t1", job_id=first)
    store.mark_job_completed(first, "t1")
    assert "s3://m/a/fullModel.pth" in render_status(status_document(store, first))

    second, _ = store.submit({"_id": "b" * 24, "profileId": "p"}, {"_id": "p"})
    store.claim(second, owner="w1", token="t2", lease_s=60)
    store.mark_cancelled(second, "t2")
    doc = status_document(store, second)
    text = render_status(doc)

    assert doc.files is None and "fullModel" not in text
    assert "none committed by this job" in text


# ---------------------------------------------------------------- 7. an idempotency key with another body


def test_a_known_key_with_a_different_body_is_refused_with_exit_6(clocked_store, sqs, queues):
    """The same idempotencyKey with other fields creates and sends nothing, says why on stderr, and exits 6."""
    store, _ = clocked_store
    code, out, _ = run_submit(store, sqs, queues.url, {**PAYLOAD, "idempotencyKey": "order-7"})
    assert code == 0 and json.loads(out)["created"] is True
    other = {**PAYLOAD, "environment": "production", "idempotencyKey": "order-7"}

    code, out, err = run_submit(store, sqs, queues.url, other)

    assert (code, out) == (6, "")
    assert err.startswith("submit refused: idempotencyKey 'order-7' was used for job ")
    assert len(queues.receive_now()) == 1 and len(store.list_jobs()) == 1


def test_a_known_key_with_the_same_fields_in_another_order_is_the_same_submission(clocked_store, sqs, queues):
    """Field order and a generated jobId do not make a submission different: the old job, created false."""
    store, _ = clocked_store
    _, first, _ = run_submit(store, sqs, queues.url, {**PAYLOAD, "idempotencyKey": "k"})
    reordered = {key: PAYLOAD[key] for key in reversed(list(PAYLOAD))}
    code, again, err = run_submit(store, sqs, queues.url, {"idempotencyKey": "k", **reordered})
    assert code == 0 and err == ""
    assert json.loads(again) == {"jobId": json.loads(first)["jobId"], "created": False}


def test_a_key_recorded_before_hashes_is_accepted_with_a_note(clocked_store, sqs, queues):
    """A record made before submissions were hashed has no hash: its key is honoured, and stderr says it was not compared."""
    store, _ = clocked_store
    store.submit({"_id": "c" * 24, "profileId": PAYLOAD["profileId"]}, {"_id": PAYLOAD["profileId"]},
                 idempotency_key="legacy")
    code, out, err = run_submit(store, sqs, queues.url, {**PAYLOAD, "idempotencyKey": "legacy"}, as_json=False)
    assert code == 0 and out.startswith("c" * 24 + " (already submitted")
    assert "recorded before submissions were hashed" in err
    assert queues.receive_now() == []
