"""Sentry, with the real SDK and an in-memory transport: no signed query reaches an event, no variable a stage."""

from __future__ import annotations

import http.client
import http.server
import json
import subprocess
import sys
import threading

import pytest
import sentry_sdk
from sentry_sdk import integrations
from sentry_sdk.transport import Transport

from worker.core.reporting import Reporter, scrub_event

SIGNED = "/rec/a.wav?X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20240101&X-Amz-Signature=SECRETSIG123"
SECRETS = ("SECRETSIG123", "AKIAIOSFODNN7EXAMPLE")


class MemoryTransport(Transport):
    def __init__(self):
        super().__init__()
        self.envelopes = []

    def capture_envelope(self, envelope):
        self.envelopes.append(envelope)

    def sent(self) -> bytes:
        return b"".join(envelope.serialize() for envelope in self.envelopes)


class RealSdk:
    """The real sentry_sdk, initialised as Reporter asks but sending into memory; options can be dropped."""

    def __init__(self, transport: MemoryTransport, drop: tuple[str, ...] = ()):
        self.transport, self.drop = transport, drop

    def init(self, **options):
        for name in self.drop:
            options.pop(name, None)
        sentry_sdk.init(**options, transport=self.transport)

    def capture_exception(self, exc):
        sentry_sdk.capture_exception(exc)


class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def local_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def transport():
    """An in-memory transport, with the stdlib integration as a fresh worker process finds it."""
    # The SDK decides once per process whether an integration is set up (and one disabled at that
    # moment never is later), so each test starts with stdlib "never seen"; the rest is left alone.
    states = (integrations._processed_integrations, integrations._installed_integrations)
    saved = ["stdlib" in state for state in states]
    for state in states:
        state.discard("stdlib")
    sentry_sdk.get_isolation_scope().clear_breadcrumbs()
    yield MemoryTransport()
    sentry_sdk.get_client().close()
    sentry_sdk.get_global_scope().set_client(None)
    sentry_sdk.get_isolation_scope().clear_breadcrumbs()
    for state, had in zip(states, saved, strict=True):
        (state.add if had else state.discard)("stdlib")


def signed_request_then_unrelated_error(reporter: Reporter, port: int, message: str) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request("GET", SIGNED)
    assert connection.getresponse().read() == b"ok"
    connection.close()
    try:
        raise ValueError(message)  # distinct per test: the SDK drops a repeated error
    except ValueError as exc:
        reporter.capture(exc)


def test_signed_download_leaves_no_trace_in_a_later_event(transport, local_server):
    """A presigned request before an unrelated error puts neither its signature nor key id in the event."""
    reporter = Reporter("https://public@sentry.invalid/1", sdk=RealSdk(transport))
    signed_request_then_unrelated_error(reporter, local_server, "unrelated failure later on")
    sent = transport.sent()
    assert b"unrelated failure later on" in sent
    assert not any(secret.encode() in sent for secret in SECRETS)


def test_breadcrumbs_are_scrubbed_even_when_an_integration_records_http(transport, local_server):
    """With the stdlib integration forced on and no before_send, the stored http breadcrumb has no query."""
    sdk = RealSdk(transport, drop=("disabled_integrations", "before_send"))
    reporter = Reporter("https://public@sentry.invalid/1", sdk=sdk)
    signed_request_then_unrelated_error(reporter, local_server, "another unrelated failure")
    sent = transport.sent()
    assert f"127.0.0.1:{local_server}/rec/a.wav".encode() in sent  # the breadcrumb was recorded
    assert not any(secret.encode() in sent for secret in SECRETS)


def test_before_send_drops_query_fields_and_scrubs_breadcrumbs():
    """scrub_event removes http.query/http.fragment anywhere and cuts the URLs and key ids it finds."""
    event = {"breadcrumbs": {"values": [{"category": "httplib", "message": "GET " + SIGNED, "data": {
        "url": "https://b.example" + SIGNED, "http.query": SIGNED.split("?")[1], "http.fragment": "f"}}]},
        "exception": {"values": [{"value": "boom"}]}}
    scrubbed = json.dumps(scrub_event(event, {}))
    assert not any(secret in scrubbed for secret in SECRETS)
    assert "http.query" not in scrubbed and "https://b.example/rec/a.wav" in scrubbed


def test_stage_processes_get_no_sentry_variables(transport):
    """With reporting on, a subprocess gets exactly the environment it was given (no SUBPROCESS_ trace data)."""
    Reporter("https://public@sentry.invalid/1", sdk=RealSdk(transport))
    shown = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(sorted(os.environ)))"],
                           env={"ONLY": "1"}, capture_output=True, text=True, check=True).stdout
    assert [name for name in json.loads(shown) if name != "LC_CTYPE"] == ["ONLY"]
