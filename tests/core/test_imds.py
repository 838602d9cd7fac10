"""Spot interruption notices: read from IMDSv2, and the first one starts a shutdown as SIGTERM does."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from structlog.testing import capture_logs

from worker.core.imds import (
    NOTICE_PATH,
    TOKEN_PATH,
    Endpoint,
    InstanceMetadata,
    MetadataUnavailable,
    SpotNotice,
    SpotWatch,
    parse_endpoint,
    parse_notice,
)
from worker.settings import load_settings

NOTICE = {"action": "terminate", "time": "2026-12-01T17:00:00Z"}


class MetadataStandIn:
    """IMDSv2 on 127.0.0.1: tokens from PUT, the spot notice (404 until ``notice`` is set) for GETs
    that carry a token it issued; ``revoke`` makes it forget the tokens it gave (as a restart does)."""

    def __init__(self):
        self.notice: dict | bytes | None = None  # bytes: sent as they are
        self.token_body: bytes | None = None  # sent instead of a fresh token when set
        self.tokens: list[str] = []
        self.requests: list[tuple[str, str]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                stand_in.requests.append(("PUT", self.path))
                if self.path != TOKEN_PATH or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._answer(400)
                if stand_in.token_body is not None:
                    return self._answer(200, stand_in.token_body)
                stand_in.tokens.append(f"token-{len(stand_in.tokens)}")
                self._answer(200, stand_in.tokens[-1].encode())

            def do_GET(self):
                stand_in.requests.append(("GET", self.path))
                if self.headers.get("X-aws-ec2-metadata-token") not in stand_in.tokens:
                    return self._answer(401)
                if self.path != NOTICE_PATH or stand_in.notice is None:
                    return self._answer(404)
                notice = stand_in.notice
                self._answer(200, notice if isinstance(notice, bytes) else json.dumps(notice).encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def revoke(self) -> None:
        self.tokens = [f"revoked-{t}" for t in self.tokens]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def imds():
    with MetadataStandIn() as stand_in:
        yield stand_in


def test_the_notice_is_read_with_one_imdsv2_token_until_it_is_refused(imds):
    """No notice reads as None, a notice as its action and time; one token serves every read until a 401."""
    metadata = InstanceMetadata(parse_endpoint(imds.endpoint))
    assert metadata.spot_notice() is None and metadata.spot_notice() is None
    imds.notice = NOTICE
    assert metadata.spot_notice() == SpotNotice("terminate", "2026-12-01T17:00:00Z")
    assert [m for m, _ in imds.requests].count("PUT") == 1
    imds.revoke()
    assert metadata.spot_notice() == SpotNotice("terminate", "2026-12-01T17:00:00Z")
    assert [m for m, _ in imds.requests].count("PUT") == 2


def test_the_first_notice_starts_the_shutdown_once(imds):
    """The watch calls its shutdown once, at the first notice, and logs the reclaim."""
    calls = []
    watch = SpotWatch(InstanceMetadata(parse_endpoint(imds.endpoint)), 60, on_notice=lambda: calls.append(1))
    assert not watch.check() and calls == []
    imds.notice = NOTICE
    with capture_logs() as logs:
        assert watch.check()
    assert calls == [1]
    assert [e for e in logs if e["event"] == "worker.spot_interruption"][0]["action"] == "terminate"


def test_a_metadata_service_that_does_not_answer_is_one_warning_never_a_shutdown():
    """Off EC2 (nothing listens) the watch warns once, then quietly asks again; no shutdown starts."""
    with MetadataStandIn() as gone:
        endpoint = gone.endpoint
    calls = []
    watch = SpotWatch(InstanceMetadata(parse_endpoint(endpoint), timeout_s=1), 60, on_notice=lambda: calls.append(1))
    with capture_logs() as logs:
        assert not watch.check() and not watch.check()
    assert calls == []
    assert [e["log_level"] for e in logs if e["event"] == "spot_watch.metadata_unavailable"] == ["warning", "debug"]


def test_the_watch_thread_ends_after_the_notice_and_on_close(imds):
    """The thread stops at the first notice; close() ends it otherwise."""
    seen = threading.Event()
    watch = SpotWatch(InstanceMetadata(parse_endpoint(imds.endpoint)), 0.01, on_notice=seen.set)
    watch.start()
    imds.notice = NOTICE
    assert seen.wait(30)
    watch.close()
    idle = SpotWatch(InstanceMetadata(parse_endpoint(imds.endpoint)), 3600, on_notice=seen.set)
    idle.start()
    idle.close()


def test_the_app_watches_for_spot_notices_only_when_asked(queues, tmp_path, imds):
    """With SPOT_INTERRUPTION_CHECK_SECONDS a notice requests the worker's shutdown; by default no watch."""
    from worker.app import build_app

    base = {"SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
            "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1"}
    app = build_app(load_settings(base))
    try:
        assert app.spot_watch is None
    finally:
        app.close()
    app = build_app(load_settings({**base, "SPOT_INTERRUPTION_CHECK_SECONDS": "5", "IMDS_ENDPOINT": imds.endpoint}))
    try:
        assert app.spot_watch is not None
        imds.notice = NOTICE
        assert app.spot_watch.check()
        assert app.worker.shutdown.requested.is_set()
        app.worker.stop()  # the SIGTERM the ECS agent sends after the notice: the grace stays
        assert not app.worker.shutdown.hurried.is_set()
    finally:
        app.close()


@pytest.mark.parametrize("endpoint", ["https://169.254.169.254", "169.254.169.254", "http://x/latest",
                                      "http://127.0.0.1:99999", "http://127.0.0.1:0", "http://127.0.0.1:x",
                                      "http://[::1", "http://169.254.169.254\n", "http://169.254.169.254/?a=1"])
def test_an_imds_endpoint_that_is_not_plain_http_is_refused(endpoint):
    """IMDS_ENDPOINT must be http://host[:port] with a usable port: anything else is one settings line."""
    from worker.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_settings({"IMDS_ENDPOINT": endpoint})
    [line] = info.value.problems
    assert line.startswith("IMDS_ENDPOINT=") and "must be http://host[:port]" in line


def test_the_imds_endpoint_is_parsed_once_into_host_and_port():
    """The settings hold IMDS_ENDPOINT as a host and a port (80 when none is given)."""
    assert load_settings({}).imds_endpoint == Endpoint("169.254.169.254", 80)
    assert load_settings({"IMDS_ENDPOINT": "http://127.0.0.1:8080/"}).imds_endpoint == Endpoint("127.0.0.1", 8080)
    assert load_settings({"IMDS_ENDPOINT": "http://[::1]:81"}).imds_endpoint == Endpoint("::1", 81)


DEEP = b"[" * 60_000  # under the 64 KiB read cap, far deeper than the JSON decoder goes


@pytest.mark.parametrize("body", [DEEP, b'{"action": "stop", "time": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                  b"\xff\xfe\x00", b"{", b"null", b'{"action": 1}', b""])
def test_a_garbled_notice_is_metadata_unavailable_and_nothing_else(body):
    """Whatever a 200 answer's body holds, reading it as a notice gives a notice or MetadataUnavailable."""
    with pytest.raises(MetadataUnavailable):
        parse_notice(body)


def test_a_notice_shows_its_time_only_when_it_is_text():
    """A notice whose time is not a string is still a notice, with no time shown."""
    deep_time = b'{"action": "stop", "time": ' + b"[" * 900 + b"]" * 900 + b"}"
    assert parse_notice(deep_time) == SpotNotice("stop", "")


def test_a_garbled_answer_from_imds_is_a_warning_and_the_watch_asks_again(imds):
    """A token no header can carry, then nested brackets: each look is logged, none raises or shuts down."""
    calls = []
    watch = SpotWatch(InstanceMetadata(parse_endpoint(imds.endpoint)), 60, on_notice=lambda: calls.append(1))
    imds.notice, imds.token_body = NOTICE, b"\xff\xfe token\nwith a break"
    with capture_logs() as logs:
        assert not watch.check()
        imds.notice, imds.token_body = DEEP, None
        assert not watch.check()
    assert calls == []
    assert [e["event"] for e in logs] == ["spot_watch.metadata_unavailable"] * 2
    imds.notice = NOTICE
    assert watch.check() and calls == [1]


class Flaky:
    """Metadata whose reads go as scripted: an exception is raised, anything else returned."""

    def __init__(self, *answers):
        self.answers = list(answers)

    def spot_notice(self):
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_the_watch_thread_outlives_any_error_of_a_look_and_of_the_shutdown():
    """An error from the read or from on_notice is logged; the thread looks again and starts the shutdown."""
    notice = SpotNotice("terminate", "2026-12-01T17:00:00Z")
    metadata = Flaky(RecursionError("maximum recursion depth exceeded"), OverflowError("too large"), notice)
    shutdowns = []

    def on_notice():
        shutdowns.append(1)
        if len(shutdowns) == 1:
            raise RuntimeError("the first request failed")

    watch = SpotWatch(metadata, 0.001, on_notice=on_notice)
    with capture_logs() as logs:
        watch.start()
        watch._thread.join(30)  # it ends by itself once a shutdown started
    assert not watch._thread.is_alive()
    assert shutdowns == [1, 1]
    assert [e["error"] for e in logs if e["event"] == "spot_watch.check_failed"] == [
        "RecursionError", "OverflowError", "RuntimeError"]


def test_a_spot_watch_is_closed_with_the_app(queues, tmp_path, imds):
    """Closing the app ends its spot watch's thread."""
    from worker.app import build_app

    app = build_app(load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        "SPOT_INTERRUPTION_CHECK_SECONDS": "120", "IMDS_ENDPOINT": imds.endpoint}))
    app.start()
    assert app.spot_watch is not None and app.spot_watch._thread.is_alive()
    app.close()
    assert not app.spot_watch._thread.is_alive()
