"""Stage logs shipped to S3 while they are written: chunks, redaction, attempts kept apart, failures only warned."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import EndpointConnectionError
from structlog.testing import capture_logs

from pipeline.errors import StageFailed
from pipeline.stages import open_step_log
from pipeline.workdir import attempt_dir_for, work_layout
from tests.support import moto_bucket
from worker.core.stop import StopSignal
from worker.voice.stage_logs import (
    LogShipping,
    LogShippingConfig,
    LogsUnavailable,
    S3Logs,
    ShippingTrainer,
    chunk_key,
    parse_chunk_key,
    take_lines,
)

BUCKET = "voice-models"
JOB_ID = "665f1c2e9b1e8a0012ab34cd"


@pytest.fixture
def s3(aws):
    return moto_bucket(BUCKET)


@pytest.fixture
def logs(s3):
    return S3Logs(s3, BUCKET, "models")


def config(interval_s: float = 0.05, chunk_bytes: int = 64 * 1024) -> LogShippingConfig:
    return LogShippingConfig(bucket=BUCKET, prefix="models", interval_s=interval_s, chunk_bytes=chunk_bytes)


def attempt_dir(tmp_path: Path, number: int = 1, token: str = "aaaaaaaa11112222") -> Path:
    path = attempt_dir_for(tmp_path / "work" / "production" / "user-1" / JOB_ID, number, token)
    path.mkdir(parents=True)
    work_layout(path).logs.mkdir(parents=True, exist_ok=True)
    return path


def shipped_text(logs: S3Logs, attempt: str | None = None, step: str | None = None) -> str:
    return "".join(logs.read_chunk(c) for c in logs.chunks(JOB_ID)
                   if (attempt is None or c.attempt == attempt) and (step is None or c.step == step))


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


class Job:
    job_id = JOB_ID


def test_lines_are_shipped_while_the_step_still_writes(tmp_path, logs):
    """A step's lines reach S3 within the interval, before the step ends, and the rest when it ends."""
    work = attempt_dir(tmp_path)
    first_out = threading.Event()
    go_on = threading.Event()

    def train(job, work_dir, stop, progress, ledger):
        _path, handle = open_step_log(work_layout(work_dir).logs, "train_full")
        with handle:
            handle.write(b"step 1/3 loss 0.5\n")
            handle.flush()
            first_out.set()
            assert go_on.wait(10)
            handle.write(b"step 3/3 loss 0.1\nno newline at the end")
        return {}

    trainer = ShippingTrainer(train, LogShipping(logs, config()))
    runner = threading.Thread(target=trainer, args=(Job(), work, StopSignal(), None, None))
    runner.start()
    try:
        assert first_out.wait(10)
        wait_for(lambda: "step 1/3" in shipped_text(logs))
        assert "step 3/3" not in shipped_text(logs)
    finally:
        go_on.set()
        runner.join(10)
    assert shipped_text(logs) == "step 1/3 loss 0.5\nstep 3/3 loss 0.1\nno newline at the end"


def test_shipped_logs_are_redacted(tmp_path, logs, s3):
    """Presigned query strings and credential-shaped text a step prints never reach the shipped log."""
    work = attempt_dir(tmp_path)

    def train(job, work_dir, stop, progress, ledger):
        _path, handle = open_step_log(work_layout(work_dir).logs, "download")
        with handle:
            handle.write(b"GET https://media.example.com/rec/1.wav?X-Amz-Signature=abc123def&X-Amz-Credential=AKIA\n"
                         b"connect mongodb://voice:hunter2@db.example.net/voice\n"
                         b"aws_secret_access_key=wJalrXUtnFEMI token: sekrit-value \x1b[2Jcleared\n")
        return {}

    ShippingTrainer(train, LogShipping(logs, config()))(Job(), work, StopSignal(), None, None)
    # As stored, not as read back (the reader redacts again).
    text = "".join(s3.get_object(Bucket=BUCKET, Key=c.key)["Body"].read().decode() for c in logs.chunks(JOB_ID))
    assert "https://media.example.com/rec/1.wav" in text
    for secret in ("X-Amz-Signature", "abc123def", "hunter2", "wJalrXUtnFEMI", "sekrit-value", "\x1b"):
        assert secret not in text


def test_earlier_attempts_logs_are_left_to_them_and_each_attempt_ships_under_its_own_key(tmp_path, logs, s3):
    """Each attempt ships only the logs it wrote, under its own attempt's prefix: the first attempt's keys stay as they were."""
    first = attempt_dir(tmp_path, 1, "aaaaaaaa00000000")

    def writes(text: bytes):
        def train(job, work_dir, stop, progress, ledger):
            _path, handle = open_step_log(work_layout(work_dir).logs, "train_full")
            with handle:
                handle.write(text)
            return {}
        return train

    shipping = LogShipping(logs, config())
    ShippingTrainer(writes(b"attempt one\n"), shipping)(Job(), first, StopSignal(), None, None)
    before = {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    second = attempt_dir_for(first.parent.parent, 2, "bbbbbbbb00000000")
    second.mkdir(parents=True)
    ShippingTrainer(writes(b"attempt two\n"), shipping)(Job(), second, StopSignal(), None, None)
    after = {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert {k: after[k] for k in before} == before
    assert shipped_text(logs, "0001-aaaaaaaa") == "attempt one\n"
    assert shipped_text(logs, "0002-bbbbbbbb") == "attempt two\n"
    assert all(k.startswith(f"models/.logs/{JOB_ID}/0002-bbbbbbbb/") for k in set(after) - set(before))


def test_a_long_log_ships_as_chunks_of_whole_lines_that_join_to_it(tmp_path, logs):
    """A log beyond the chunk size goes as several chunks, each of whole lines and at most the chunk size."""
    work = attempt_dir(tmp_path)
    lines = b"".join(f"step {i:05d} loss {1 / (i + 1):.6f}\n".encode() for i in range(6000))

    def train(job, work_dir, stop, progress, ledger):
        _path, handle = open_step_log(work_layout(work_dir).logs, "train_full")
        with handle:
            handle.write(lines)
        return {}

    ShippingTrainer(train, LogShipping(logs, config(chunk_bytes=64 * 1024)))(Job(), work, StopSignal(), None, None)
    chunks = logs.chunks(JOB_ID)
    assert len(chunks) >= 3 and [c.seq for c in chunks] == list(range(len(chunks)))
    texts = [logs.read_chunk(c) for c in chunks]
    assert all(len(t.encode()) <= 64 * 1024 and t.endswith("\n") for t in texts)
    assert "".join(texts).encode() == lines


class FlakyLogs:
    """S3 logs whose first ``failures`` writes fail as an unreachable endpoint would."""

    def __init__(self, logs: S3Logs, failures: int):
        self._logs, self.failures, self.calls = logs, failures, 0

    def put_chunk(self, *args) -> None:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise LogsUnavailable("could not ship: EndpointConnectionError")
        self._logs.put_chunk(*args)

    def __getattr__(self, name):
        return getattr(self._logs, name)


def test_a_failed_shipment_is_a_warning_and_is_retried_not_the_jobs_failure(tmp_path, logs):
    """S3 refusing shipments mid-step only logs logs.ship_failed; a later interval sends the same lines."""
    work = attempt_dir(tmp_path)
    flaky = FlakyLogs(logs, failures=2)

    def train(job, work_dir, stop, progress, ledger):
        _path, handle = open_step_log(work_layout(work_dir).logs, "train_full")
        with handle:
            handle.write(b"early line\n")
            handle.flush()
            wait_for(lambda: flaky.failures == 0 and "early line" in shipped_text(logs))
            handle.write(b"late line\n")
        return {"done": work_dir}

    with capture_logs() as events:
        result = ShippingTrainer(train, LogShipping(flaky, config()))(Job(), work, StopSignal(), None, None)
    assert result == {"done": work}
    assert [e["event"] for e in events if e["event"] == "logs.ship_failed"] == ["logs.ship_failed"] * 2
    assert shipped_text(logs) == "early line\nlate line\n"


def test_a_failing_step_is_shipped_to_its_last_line_and_its_error_goes_on(tmp_path, logs):
    """When training ends with an error, what the step wrote up to its end is shipped and the error is the job's."""
    work = attempt_dir(tmp_path)

    def train(job, work_dir, stop, progress, ledger):
        _path, handle = open_step_log(work_layout(work_dir).logs, "train_full")
        with handle:
            handle.write(b"Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n")
        raise StageFailed("stage train_full exited with code 1: RuntimeError: CUDA out of memory")

    with pytest.raises(StageFailed):
        ShippingTrainer(train, LogShipping(logs, config(interval_s=3600)))(Job(), work, StopSignal(), None, None)
    assert shipped_text(logs).endswith("RuntimeError: CUDA out of memory\n")


def test_s3_errors_are_translated_at_the_adapter(logs, s3):
    """A botocore failure reading or writing logs is the project's LogsUnavailable, its text without a URL's query."""
    def refuse(**kw):
        raise EndpointConnectionError(endpoint_url="https://s3.example.com/b?X-Amz-Signature=zzz")

    s3.meta.events.register("before-call.s3.PutObject", refuse)
    with pytest.raises(LogsUnavailable) as caught:
        logs.put_chunk(JOB_ID, "0001-aaaaaaaa", "20261202T052042.000000Z-train_full.log", 0, "x\n")
    assert "X-Amz-Signature" not in str(caught.value)


def test_a_link_planted_in_the_log_directory_is_not_followed(tmp_path, logs):
    """A stage that puts a link named like a step log in {log_dir} gets nothing outside the job shipped."""
    work = attempt_dir(tmp_path)
    outside = tmp_path / "secret.txt"
    outside.write_text("outside the job\n")

    def train(job, work_dir, stop, progress, ledger):
        (work_layout(work_dir).logs / "20261202T052042.000000Z-evil.log").symlink_to(outside)
        return {}

    ShippingTrainer(train, LogShipping(logs, config()))(Job(), work, StopSignal(), None, None)
    assert logs.chunks(JOB_ID) == []


def test_chunk_keys_round_trip_and_foreign_keys_are_ignored():
    """A chunk's key parses back to its attempt, log and number; keys outside the layout are not chunks."""
    key = chunk_key("models/", JOB_ID, "0003-abcd1234", "20261202T052042.123456Z-train_full.log", 7)
    assert key == f"models/.logs/{JOB_ID}/0003-abcd1234/20261202T052042.123456Z-train_full.log/00000007.log"
    chunk = parse_chunk_key(f"models/.logs/{JOB_ID}/", key)
    assert chunk is not None and (chunk.attempt_number, chunk.step, chunk.seq) == (3, "train_full", 7)
    for foreign in (f"models/.logs/{JOB_ID}/0003-abcd1234/notes.txt/00000000.log",
                    f"models/.logs/{JOB_ID}/../x/20261202T052042.123456Z-a.log/00000000.log",
                    f"models/.logs/{JOB_ID}/0003-abcd1234/20261202T052042.123456Z-a.log/0.log"):
        assert parse_chunk_key(f"models/.logs/{JOB_ID}/", foreign) is None


def test_a_chunk_takes_whole_lines_and_cuts_only_an_over_long_one():
    """The next chunk ends at a line's end, waits for an unfinished line, and cuts a line longer than a chunk."""
    assert take_lines(b"a\nb\nunfinished", final=False, chunk_bytes=100) == b"a\nb\n"
    assert take_lines(b"unfinished", final=False, chunk_bytes=100) == b""
    assert take_lines(b"unfinished", final=True, chunk_bytes=100) == b"unfinished"
    assert take_lines(b"x" * 150, final=False, chunk_bytes=100) == b"x" * 100


def test_the_worker_ships_logs_unless_the_interval_is_zero():
    """The daemon's trainer ships logs with a bucket and an interval; LOG_SHIP_INTERVAL_SECONDS=0 leaves it as it is."""
    from worker.app import log_shipping
    from worker.settings import load_settings

    def trainer(*_args):
        return {}

    base = {"S3_BUCKET": BUCKET, "S3_PREFIX": "models", "AWS_REGION": "us-east-1"}
    settings = load_settings({**base, "LOG_SHIP_INTERVAL_SECONDS": "3", "LOG_SHIP_CHUNK_KIB": "128"})
    shipping = log_shipping(settings, trainer, settings.aws_config(), boto3.session.Session())
    assert isinstance(shipping, ShippingTrainer)
    assert settings.log_shipping_config() == LogShippingConfig(bucket=BUCKET, prefix="models", interval_s=3.0,
                                                               chunk_bytes=128 * 1024)
    off = load_settings({**base, "LOG_SHIP_INTERVAL_SECONDS": "0"})
    assert log_shipping(off, trainer, off.aws_config(), boto3.session.Session()) is trainer


def test_a_chunk_size_below_64_kib_is_refused():
    """LOG_SHIP_CHUNK_KIB must hold the longest line the runner writes (64 KiB): a smaller value does not load."""
    from worker.core.errors import ConfigError
    from worker.settings import load_settings

    with pytest.raises(ConfigError) as caught:
        load_settings({"LOG_SHIP_CHUNK_KIB": "16"})
    assert "LOG_SHIP_CHUNK_KIB" in str(caught.value)


def test_a_log_directory_replaced_by_a_link_is_not_followed(tmp_path, logs):
    """A stage that makes {log_dir} a link to another directory gets nothing from there shipped."""
    work = attempt_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def train(job, work_dir, stop, progress, ledger):
        logs_dir = work_layout(work_dir).logs
        logs_dir.rmdir()
        logs_dir.symlink_to(elsewhere)
        (elsewhere / "20261202T052042.000000Z-evil.log").write_text("outside the job\n")
        return {}

    ShippingTrainer(train, LogShipping(logs, config()))(Job(), work, StopSignal(), None, None)
    assert logs.chunks(JOB_ID) == []


class SlowLogs:
    """Every write takes 2 s of the shipper's clock."""

    def __init__(self, logs: S3Logs, clock: list[float]):
        self._logs, self._clock = logs, clock

    def put_chunk(self, *args) -> None:
        self._clock[0] += 2.0
        self._logs.put_chunk(*args)

    def __getattr__(self, name):
        return getattr(self._logs, name)


def test_the_last_shipment_stops_at_its_budget_and_says_so(tmp_path, logs):
    """At the attempt's end, shipping goes on only for its budget; what is left stays on the host, with a warning."""
    from worker.voice.stage_logs import AttemptLogShipper

    work = attempt_dir(tmp_path)
    log_dir = work_layout(work).logs
    clock = [0.0]
    shipper = AttemptLogShipper(SlowLogs(logs, clock), config(interval_s=3600, chunk_bytes=64 * 1024), JOB_ID,
                                work.name, log_dir, clock=lambda: clock[0])
    (log_dir / "20261202T052042.000000Z-train_full.log").write_bytes(b"x" * 1023 + b"\n" * 1 + b"y" * 64 * 1024 * 9)
    with capture_logs() as events:
        assert shipper.finish() is False
    assert len(logs.chunks(JOB_ID)) == 3  # 2 s each: the third starts before the 5 s are up
    assert "logs.ship_incomplete" in [e["event"] for e in events]


def test_a_runaway_log_is_shipped_up_to_its_cap_and_then_says_so(tmp_path, logs, monkeypatch):
    """Past the per-log cap one last chunk says the rest stays on the host, and nothing more of that log is sent."""
    import worker.voice.stage_logs as stage_logs

    monkeypatch.setattr(stage_logs, "MAX_SHIPPED_BYTES_PER_LOG", 128 * 1024)
    work = attempt_dir(tmp_path)

    def train(job, work_dir, stop, progress, ledger):
        _path, handle = open_step_log(work_layout(work_dir).logs, "train_full")
        with handle:
            handle.write(b"spam spam spam\n" * 20000)
        return {}

    ShippingTrainer(train, LogShipping(logs, config()))(Job(), work, StopSignal(), None, None)
    texts = [logs.read_chunk(c) for c in logs.chunks(JOB_ID)]
    assert sum(len(t) for t in texts[:-1]) <= 128 * 1024 + 64 * 1024
    assert texts[-1].startswith("[shipper] this log is not shipped beyond 131072 bytes")


class HeldLogs:
    """Writes wait until the test lets them through."""

    def __init__(self, logs: S3Logs):
        self._logs, self.release = logs, threading.Event()

    def put_chunk(self, *args) -> None:
        assert self.release.wait(10)
        self._logs.put_chunk(*args)

    def __getattr__(self, name):
        return getattr(self._logs, name)


def test_a_stopped_attempt_is_not_held_up_by_its_last_shipment(tmp_path, logs):
    """After a stop (a spot shutdown), the attempt ends at once; its last lines still ship beside the release."""
    from worker.core.errors import Stopped, StopReason

    work = attempt_dir(tmp_path)
    held = HeldLogs(logs)
    stop = StopSignal()

    def train(job, work_dir, stop, progress, ledger):
        _path, handle = open_step_log(work_layout(work_dir).logs, "train_full")
        with handle:
            handle.write(b"checkpoint saved at step 7\n")
        stop.set(StopReason.SHUTDOWN)
        stop.raise_if_set()

    # The write is let through a while later: an attempt that waited for it would return after it.
    letting_through = threading.Timer(2.0, held.release.set)
    letting_through.start()
    try:
        with pytest.raises(Stopped):
            ShippingTrainer(train, LogShipping(held, config(interval_s=3600)))(Job(), work, stop, None, None)
        assert logs.chunks(JOB_ID) == []  # the attempt ended before its last shipment
    finally:
        letting_through.join()
    wait_for(lambda: shipped_text(logs) == "checkpoint saved at step 7\n")
