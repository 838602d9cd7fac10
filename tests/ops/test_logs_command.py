"""`python -m worker logs`: every attempt's shipped stage logs read back from S3, filters, --follow, tail_lines, status's link."""

from __future__ import annotations

import io
import json

import pytest

from tests.support import moto_bucket
from worker.ops.cli import main
from worker.ops.commands import cmd_status
from worker.ops.logs import cmd_logs, tail_lines
from worker.voice.records.sqlite import SqliteStore
from worker.voice.stage_logs import S3Logs, logs_location

BUCKET = "voice-models"
JOB_ID = "665f1c2e9b1e8a0012ab34cd"
PROFILE_ID = "665f1c2e9b1e8a0012ab34ce"
FIRST, SECOND = "0001-aaaaaaaa", "0002-bbbbbbbb"
DOWNLOAD = "20261202T050000.000000Z-download.log"
TRAIN_1 = "20261202T050001.000000Z-train_full.log"
TRAIN_2 = "20261202T060001.000000Z-train_full.log"


@pytest.fixture
def s3(aws):
    return moto_bucket(BUCKET)


@pytest.fixture
def logs(s3):
    return S3Logs(s3, BUCKET, "models")


@pytest.fixture
def store(tmp_path):
    s = SqliteStore(str(tmp_path / "records.db"))
    s.submit({"_id": JOB_ID, "profileId": PROFILE_ID, "environment": "production"}, {"_id": PROFILE_ID})
    yield s
    s.close()


def two_attempts(logs: S3Logs) -> None:
    logs.put_chunk(JOB_ID, SECOND, TRAIN_2, 0, "second try step 1\n")
    logs.put_chunk(JOB_ID, FIRST, DOWNLOAD, 0, "recording 0: fetched 10 bytes\n")
    logs.put_chunk(JOB_ID, FIRST, TRAIN_1, 1, "first try step 2\nRuntimeError: boom\n")
    logs.put_chunk(JOB_ID, FIRST, TRAIN_1, 0, "first try step 1\n")


def run(logs, store, **kw) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cmd_logs(logs, store, JOB_ID, out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


def test_every_attempts_logs_print_oldest_first_under_headers(logs, store):
    """Attempts in number order, each log's chunks in sequence, a header naming attempt, step and start."""
    two_attempts(logs)
    code, out, _ = run(logs, store)
    assert code == 0
    assert out == (f"==> attempt 1 ({FIRST}) download, started 2026-12-02 05:00:00Z <==\n"
                   "recording 0: fetched 10 bytes\n\n"
                   f"==> attempt 1 ({FIRST}) train_full, started 2026-12-02 05:00:01Z <==\n"
                   "first try step 1\nfirst try step 2\nRuntimeError: boom\n\n"
                   f"==> attempt 2 ({SECOND}) train_full, started 2026-12-02 06:00:01Z <==\n"
                   "second try step 1\n")


def test_stage_and_attempt_narrow_the_output(logs, store):
    """--stage keeps one step's logs, --attempt one attempt's, and both together their intersection."""
    two_attempts(logs)
    _, out, _ = run(logs, store, stage="download")
    assert "fetched" in out and "try step" not in out
    _, out, _ = run(logs, store, attempt=2)
    assert "second try" in out and "first try" not in out and "fetched" not in out
    code, out, err = run(logs, store, stage="download", attempt=2)
    assert (code, out) == (0, "") and "no logs of stage download of attempt 2 shipped" in err


def test_an_unknown_job_exits_3_and_a_job_without_logs_says_so(logs, store):
    """No record and no logs: exit 3; a job that shipped nothing yet: exit 0, where they will be on stderr."""
    err = io.StringIO()
    assert cmd_logs(logs, store, "0" * 24, out=io.StringIO(), err=err) == 3
    assert "no job 000000000000000000000000" in err.getvalue()
    code, out, err = run(logs, store)
    assert (code, out) == (0, "") and f"s3://{BUCKET}/models/.logs/{JOB_ID}/" in err


def test_follow_prints_what_ships_next_until_the_job_ends(logs, store):
    """--follow polls: new chunks print as they come, and the command ends once the job does, after a last look."""
    claim = store.claim(JOB_ID, owner="w1", token="t" * 32, lease_s=60)
    assert claim.outcome == "claimed"
    logs.put_chunk(JOB_ID, FIRST, TRAIN_1, 0, "step 1\n")
    polls = []

    def sleep(_s):
        polls.append(_s)
        if len(polls) == 1:
            logs.put_chunk(JOB_ID, FIRST, TRAIN_1, 1, "step 2\n")
        elif len(polls) == 2:
            logs.put_chunk(JOB_ID, FIRST, TRAIN_1, 2, "step 3, the last\n")
            store.mark_cancelled(JOB_ID, "t" * 32)

    code, out, _ = run(logs, store, follow=True, sleep=sleep)
    assert code == 0 and len(polls) == 2
    assert out == (f"==> attempt 1 ({FIRST}) train_full, started 2026-12-02 05:00:01Z <==\n"
                   "step 1\nstep 2\nstep 3, the last\n")


def test_tail_lines_reads_the_newest_log_from_its_last_chunks(logs, store):
    """tail_lines gives the last N lines of the newest log (of a stage, when named) and reads no more chunks than needed."""
    two_attempts(logs)
    assert tail_lines(logs, JOB_ID, 5) == ["second try step 1"]
    assert tail_lines(logs, JOB_ID, 2, stage="download") == ["recording 0: fetched 10 bytes"]
    for seq in range(2, 6):
        logs.put_chunk(JOB_ID, SECOND, TRAIN_2, seq - 1, f"line {seq}a\nline {seq}b\n")
    read = []
    original = logs.read_chunk
    logs.read_chunk = lambda chunk: read.append(chunk.seq) or original(chunk)
    assert tail_lines(logs, JOB_ID, 3) == ["line 4b", "line 5a", "line 5b"]
    assert read == [4, 3]
    assert tail_lines(logs, "1" * 24, 3) == []


def test_a_planted_chunk_reads_back_without_terminal_controls(logs, s3):
    """A chunk someone else put under the job's logs is shown redacted, its escapes dropped."""
    s3.put_object(Bucket=BUCKET, Key=f"models/.logs/{JOB_ID}/{FIRST}/{TRAIN_1}/00000000.log",
                  Body=b"\x1b]0;owned\x07see https://h.example/x?X-Amz-Signature=abc\n")
    assert tail_lines(logs, JOB_ID) == ["see https://h.example/x"]


def test_status_links_the_shipped_logs(store):
    """status names the logs command and the S3 location of a job that has attempts, in text and in --json."""
    store.claim(JOB_ID, owner="w1", token="t" * 32, lease_s=60)
    at = lambda job_id: logs_location(BUCKET, "models", job_id)  # noqa: E731
    out = io.StringIO()
    assert cmd_status(store, JOB_ID, as_json=False, out=out, logs_at=at) == 0
    line = next(line for line in out.getvalue().splitlines() if line.strip().startswith("logs"))
    assert f"python -m worker logs {JOB_ID}" in line
    assert f"s3://{BUCKET}/models/.logs/{JOB_ID}/" in out.getvalue()
    out = io.StringIO()
    cmd_status(store, JOB_ID, as_json=True, out=out, logs_at=at)
    assert json.loads(out.getvalue())["logs"] == {"location": f"s3://{BUCKET}/models/.logs/{JOB_ID}/",
                                                  "command": f"python -m worker logs {JOB_ID}"}


def test_the_logs_command_runs_from_the_command_line(logs, store, tmp_path, monkeypatch, capsys):
    """`python -m worker logs JOB_ID --stage train_full` prints from S3 with the deployment's settings; exit 0."""
    two_attempts(logs)
    for name, value in {"STORE_URL": f"sqlite:///{tmp_path / 'records.db'}", "S3_BUCKET": BUCKET,
                        "S3_PREFIX": "models", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    assert main(["logs", JOB_ID, "--stage", "train_full", "--attempt", "1"]) == 0
    assert capsys.readouterr().out.endswith("first try step 1\nfirst try step 2\nRuntimeError: boom\n")
    monkeypatch.delenv("S3_BUCKET")
    assert main(["logs", JOB_ID]) == 2


def test_the_command_line_exits_1_on_s3_failure_and_130_on_ctrl_c(logs, store, tmp_path, monkeypatch, capsys):
    """An S3 refusal is one `logs failed:` line and exit 1; Ctrl-C during --follow is `logs interrupted`, exit 130."""
    for name, value in {"STORE_URL": f"sqlite:///{tmp_path / 'records.db'}", "S3_BUCKET": "no-such-bucket",
                        "S3_PREFIX": "models", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    assert main(["logs", JOB_ID]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"logs failed: could not list the logs of job {JOB_ID}: NoSuchBucket") and "Traceback" not in err

    monkeypatch.setenv("S3_BUCKET", BUCKET)
    store.claim(JOB_ID, owner="w1", token="t" * 32, lease_s=60)
    listed = []

    def chunks_then_ctrl_c(self, job_id):
        listed.append(job_id)
        if len(listed) > 1:
            raise KeyboardInterrupt
        return []

    monkeypatch.setattr(S3Logs, "chunks", chunks_then_ctrl_c)
    assert main(["logs", JOB_ID, "--follow"]) == 130
    assert "logs interrupted" in capsys.readouterr().err
