"""IMDS on the GPU instances: hop limit 1, so no container reads the instance role, and the host's spot
relay (config/imds-spot-relay.py, installed by the template's user data) that gives the worker's spot
watch the notice and nothing else. The relay runs here against a stand-in metadata service, and the
worker's own IMDS client (worker/core/imds.py) reads through it."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.deploy.cfn import Resolver, load_template
from tests.deploy.files import REPO
from tests.deploy.test_ecs_layer import ECS_PARAMS, _container, _env
from worker.core.imds import TIMEOUT_S, InstanceMetadata, MetadataUnavailable, SpotNotice, parse_endpoint
from worker.settings import load_settings

RELAY = REPO / "config" / "imds-spot-relay.py"
NOTICE = b'{"action": "terminate", "time": "2026-12-02T03:00:00Z"}'
CREDENTIALS_PATH = "/latest/meta-data/iam/security-credentials/voice-worker-instance"


@pytest.fixture(scope="module")
def stack():
    return Resolver(load_template(), **ECS_PARAMS)


def _user_data(stack) -> str:
    return stack.resource("GpuLaunchTemplate")["LaunchTemplateData"]["UserData"]


def _heredoc(text: str, opener: str, end: str) -> str:
    start = text.index(opener) + len(opener) + 1
    return text[start:text.index("\n" + end + "\n", start) + 1]


def test_hop_limit_is_one_and_imdsv2_is_required(stack):
    """IMDSv2 only, and its token answer makes one hop: no bridge container reaches IMDS."""
    options = stack.resource("GpuLaunchTemplate")["LaunchTemplateData"]["MetadataOptions"]
    assert options == {"HttpEndpoint": "enabled", "HttpTokens": "required", "HttpPutResponseHopLimit": 1}
    assert stack.resource("WorkerTaskDefinition")["NetworkMode"] == "bridge"


def test_user_data_installs_the_relay_word_for_word_and_starts_it(stack):
    """The user data writes config/imds-spot-relay.py unchanged and runs it as a systemd service on the
    address the worker tasks' IMDS_ENDPOINT names."""
    data = _user_data(stack)
    installed = _heredoc(data, "cat > /usr/local/libexec/voice-worker-imds-spot-relay <<'RELAY'", "RELAY")
    assert installed == RELAY.read_text()
    unit = _heredoc(data, "cat > /etc/systemd/system/voice-worker-spot-relay.service <<'EOF'", "EOF")
    (exec_start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    listen = exec_start.split()[-1]
    env = _env(_container(stack, "WorkerTaskDefinition"))
    endpoint = load_settings({"IMDS_ENDPOINT": env["IMDS_ENDPOINT"]}).imds_endpoint
    assert f"{endpoint.host}:{endpoint.port}" == listen
    assert "DynamicUser=yes" in unit  # not root
    assert "systemctl enable --now --no-block voice-worker-spot-relay.service" in data


def test_worker_tasks_run_the_spot_watch_against_the_relay(stack):
    """SPOT_INTERRUPTION_CHECK_SECONDS is on in the worker task (the watch runs in the worker's own
    task), and IMDS_ENDPOINT is the relay, not 169.254.169.254 (unreachable with hop limit 1)."""
    env = _env(_container(stack, "WorkerTaskDefinition"))
    settings = load_settings({k: env[k] for k in ("SPOT_INTERRUPTION_CHECK_SECONDS", "IMDS_ENDPOINT")})
    assert settings.spot_interruption_check_s > 0
    assert settings.imds_endpoint.host != "169.254.169.254"


class _FakeImds(http.server.BaseHTTPRequestHandler):
    notice: bytes | None = None
    tokens: set[str] = set()
    seen: list[str] = []

    def do_PUT(self):  # noqa: N802
        type(self).seen.append("PUT " + self.path)
        token = f"t{len(self.tokens)}"
        type(self).tokens.add(token)
        self._answer(200, token.encode())

    def do_GET(self):  # noqa: N802
        type(self).seen.append("GET " + self.path)
        if self.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            self._answer(401, b"")
        elif self.path == "/latest/meta-data/spot/instance-action" and self.notice:
            self._answer(200, self.notice)
        elif self.path.startswith("/latest/meta-data/iam/"):
            self._answer(200, b'{"AccessKeyId": "ASIAEXAMPLE", "SecretAccessKey": "secret"}')
        else:
            self._answer(404, b"")

    def _answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _running_relay(upstream: str):
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(RELAY), f"127.0.0.1:{port}"],
                               env={**os.environ, "RELAY_UPSTREAM": upstream},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture()
def relay():
    _FakeImds.notice, _FakeImds.tokens, _FakeImds.seen = None, set(), []
    imds = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeImds)
    threading.Thread(target=imds.serve_forever, daemon=True).start()
    try:
        with _running_relay(f"127.0.0.1:{imds.server_address[1]}") as port:
            yield port
    finally:
        imds.shutdown()
        imds.server_close()


def _get(port: int, method: str, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_the_workers_imds_client_reads_no_notice_then_the_notice_through_the_relay(relay):
    """worker/core/imds.py, pointed at the relay, sees no notice (404), then the notice IMDS gives."""
    metadata = InstanceMetadata(parse_endpoint(f"http://127.0.0.1:{relay}"))
    assert metadata.spot_notice() is None
    _FakeImds.notice = NOTICE
    assert metadata.spot_notice() == SpotNotice(action="terminate", time="2026-12-02T03:00:00Z")


@pytest.mark.parametrize("method,path", [
    ("GET", CREDENTIALS_PATH), ("GET", "/latest/meta-data/iam/security-credentials/"),
    ("GET", "/latest/meta-data/spot/instance-action/../../iam/security-credentials/"),
    ("GET", "/latest/user-data"), ("GET", "/latest/dynamic/instance-identity/document"),
    ("POST", "/latest/api/token"), ("DELETE", "/latest/meta-data/spot/instance-action")])
def test_the_relay_serves_nothing_but_the_notice(relay, method, path):
    """Every other path or method is a 404, and never reaches the metadata service."""
    status, body = _get(relay, method, path, {"X-aws-ec2-metadata-token": "anything"})
    assert (status, body) == (404, b"")
    assert not [seen for seen in _FakeImds.seen if "/iam/" in seen or "user-data" in seen]


def test_an_unreachable_metadata_service_is_a_502_the_watch_retries():
    """When IMDS does not answer, the relay says 502 within the worker's request timeout: the watch
    logs it and looks again at its next check, the worker goes on."""
    with _running_relay(f"127.0.0.1:{_free_port()}") as port:
        started = time.monotonic()
        status, body = _get(port, "GET", "/latest/meta-data/spot/instance-action",
                            {"X-aws-ec2-metadata-token": "voice-worker-spot-relay"})
        assert (status, body) == (502, b"")
        assert time.monotonic() - started < TIMEOUT_S
        with pytest.raises(MetadataUnavailable):
            InstanceMetadata(parse_endpoint(f"http://127.0.0.1:{port}")).spot_notice()
