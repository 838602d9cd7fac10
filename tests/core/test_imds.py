"""Spot interruption notices: read from IMDSv2, and the first one starts a shutdown as SIGTERM does."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from structlog.testing import capture_logs

from worker.core.imds import NOTICE_PATH, TOKEN_PATH, InstanceMetadata, SpotNotice, SpotWatch
from worker.settings import load_settings

NOTICE = {"action": "terminate", "time": "2026-12-01T17:00:00Z"}


class MetadataStandIn:
    """IMDSv2 on 127.0.0.1: tokens from PUT, the spot notice (404 until ``notice`` is set) for GETs
    that carry a token it issued; ``revoke`` makes it forget the tokens it gave (as a restart does)."""

    def __init__(self):
        self.notice: dict | None = None
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
                stand_in.tokens.append(f"token-{len(stand_in.tokens)}")
                self._answer(200, stand_in.tokens[-1].encode())

            def do_GET(self):
                stand_in.requests.append(("GET", self.path))
                if self.headers.get("X-aws-ec2-metadata-token") not in stand_in.tokens:
                    return self._answer(401)
                if self.path != NOTICE_PATH or stand_in.notice is None:
                    return self._answer(404)
                self._answer(200, json.dumps(stand_in.notice).encode())

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
    metadata = InstanceMetadata(imds.endpoint)
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
    watch = SpotWatch(InstanceMetadata(imds.endpoint), 60, on_notice=lambda: calls.append(1))
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
    watch = SpotWatch(InstanceMetadata(endpoint, timeout_s=1), 60, on_notice=lambda: calls.append(1))
    with capture_logs() as logs:
        assert not watch.check() and not watch.check()
    assert calls == []
    assert [e["log_level"] for e in logs if e["event"] == "spot_watch.metadata_unavailable"] == ["warning", "debug"]


def test_the_watch_thread_ends_after_the_notice_and_on_close(imds):
    """The thread stops at the first notice; close() ends it otherwise."""
    seen = threading.Event()
    watch = SpotWatch(InstanceMetadata(imds.endpoint), 0.01, on_notice=seen.set)
    watch.start()
    imds.notice = NOTICE
    assert seen.wait(30)
    watch.close()
    idle = SpotWatch(InstanceMetadata(imds.endpoint), 3600, on_notice=seen.set)
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


@pytest.mark.parametrize("endpoint", ["https://169.254.169.254", "169.254.169.254", "http://x/latest"])
def test_an_imds_endpoint_that_is_not_plain_http_is_refused(endpoint):
    """IMDS_ENDPOINT must be http://host[:port]."""
    from worker.core.errors import ConfigError

    with pytest.raises(ConfigError, match="IMDS_ENDPOINT"):
        load_settings({"IMDS_ENDPOINT": endpoint})


def test_a_spot_watch_is_closed_with_the_app(queues, tmp_path, imds):
    """Closing the app ends its spot watch's thread."""
    from worker.app import build_app

    app = build_app(load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        "SPOT_INTERRUPTION_CHECK_SECONDS": "3600", "IMDS_ENDPOINT": imds.endpoint}))
    app.start()
    assert app.spot_watch is not None and app.spot_watch._thread.is_alive()
    app.close()
    assert not app.spot_watch._thread.is_alive()
