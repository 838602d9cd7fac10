"""The whole-request deadline and the stop signal cut every phase of a download, https and s3.

Each server here misbehaves in one phase: DNS that never answers, a connect whose SYN is dropped, a
TLS handshake that never completes, a request that is never answered, headers dripped one line at a
time. A fetch must end with DownloadError naming the deadline once ``timeout_s`` has passed, or with
Stopped moments after the stop signal is set, and must really close its socket either way.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import boto3
import pytest
from botocore.config import Config

from pipeline.downloads import DownloadSettings, fetch
from pipeline.errors import DownloadError
from tests.pipeline.tls_server import LOOPBACK, ca, ca_path, leftovers  # noqa: F401  (ca, ca_path are fixtures)
from worker.core.errors import Stopped
from worker.core.stop import StopSignal

DEADLINE_S = 0.4
# A stop or deadline must end the fetch within this much more. The watchdog polls every 50 ms; the
# margin is wide for a loaded machine (tests in parallel) and still far below what it tells apart:
# the client's 30 s read timeout and the servers' own give-up after SERVER_GIVES_UP_S.
MARGIN_S = 2.0
# How long a helper thread left behind may take to end on a starved machine.
LATE_HELPER_S = 30.0
STOP_AFTER_S = 0.2
# Servers give up on their own after this long, so a broken client fails a test instead of hanging it.
SERVER_GIVES_UP_S = 6.0
DRIP_EVERY_S = 0.2


class RawServer:
    """A loopback TCP (optionally TLS) server whose every connection runs ``behave(conn, server)``."""

    def __init__(self, behave: Callable[[socket.socket, RawServer], None], context: ssl.SSLContext | None = None,
                 backlog: int = 16):
        self.behave, self.context = behave, context
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=backlog)
        self.port = self.listener.getsockname()[1]
        self.done = threading.Event()
        self.closed_by_client = threading.Event()  # set when a client's end of a connection went away
        self.connected = threading.Event()  # set when a client's connection was accepted
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            self.connected.set()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(SERVER_GIVES_UP_S)
        try:
            if self.context is not None:
                conn = self.context.wrap_socket(conn, server_side=True)
            self.behave(conn, self)
        except TimeoutError:
            pass  # the server gave up: nothing to say about the client
        except (OSError, ssl.SSLError):
            self.closed_by_client.set()
        finally:
            conn.close()

    def close(self) -> None:
        self.done.set()
        self.listener.close()

    def client_hung_up(self) -> bool:
        """Whether the client closed the connection it made. On a starved machine the cut can come
        before the client even connected: then there is nothing to close, which is no leak either."""
        if not self.connected.wait(0.3):
            return True
        return self.closed_by_client.wait(MARGIN_S)


def hold_silently(conn: socket.socket, server: RawServer) -> None:
    """Read whatever comes and never answer, until the client hangs up or the server gives up."""
    try:
        while conn.recv(65536):
            pass
    except TimeoutError:
        return  # the server gave up: the client never closed
    server.closed_by_client.set()


def drip_headers(conn: socket.socket, server: RawServer) -> None:
    """Read the request, then send a status line and one more header line every DRIP_EVERY_S."""
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    conn.settimeout(DRIP_EVERY_S)
    started, n = time.monotonic(), 0
    while time.monotonic() - started < SERVER_GIVES_UP_S and not server.done.is_set():
        try:
            if conn.recv(65536) == b"":
                server.closed_by_client.set()
                return
        except TimeoutError:
            conn.sendall(f"X-Drip-{n}: still here\r\n".encode())
            n += 1


def never_handshake(conn: socket.socket, server: RawServer) -> None:
    """Accept the TCP connection and never start TLS: the client's ClientHello goes unanswered."""
    hold_silently(conn, server)


@pytest.fixture(scope="module")
def tls_context(ca) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)
    return context


@pytest.fixture(scope="module")
def ds(ca_path) -> DownloadSettings:
    return DownloadSettings(timeout_s=DEADLINE_S, max_bytes=10**7, allowed_networks=LOOPBACK, ca_certs=ca_path)


@contextmanager
def serving(behave, context=None, backlog=16) -> Iterator[RawServer]:
    server = RawServer(behave, context, backlog)
    try:
        yield server
    finally:
        server.close()


def loopback(host: str, port: int) -> list[str]:
    return ["127.0.0.1"]


@contextmanager
def https_phase(phase: str, tls_context) -> Iterator[tuple[str, Callable[[str, int], list[str]], RawServer | None]]:
    """(url, resolver, server) for a server that hangs in ``phase``."""
    if phase == "dns":
        never = threading.Event()

        def stuck_resolver(host: str, port: int) -> list[str]:
            never.wait(SERVER_GIVES_UP_S)
            return ["127.0.0.1"]

        try:
            yield "https://localhost:9/x.wav", stuck_resolver, None
        finally:
            never.set()
    elif phase == "connect":
        # A full accept queue makes the kernel drop further SYNs: connect() waits with no answer.
        with socket.create_server(("127.0.0.1", 0), backlog=0) as listener:
            port = listener.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port)):
                yield f"https://localhost:{port}/x.wav", loopback, None
    else:
        behave, context = {
            "tls-handshake": (never_handshake, None),
            "status-line": (hold_silently, tls_context),
            "header-drip": (drip_headers, tls_context),
        }[phase]
        with serving(behave, context) as server:
            yield f"https://localhost:{server.port}/x.wav", loopback, server


def stop_soon(stop: StopSignal, reason: str) -> list[float]:
    """Set ``stop`` after STOP_AFTER_S from a timer; the returned list receives the moment it was set."""
    when: list[float] = []

    def fire() -> None:
        when.append(time.monotonic())
        stop.set(reason)

    threading.Timer(STOP_AFTER_S, fire).start()
    return when


HTTPS_PHASES = ["dns", "connect", "tls-handshake", "status-line", "header-drip"]


@pytest.mark.parametrize("phase", HTTPS_PHASES)
def test_https_deadline_cuts_every_phase(tls_context, ds, tmp_path, phase):
    """Whatever phase the server hangs in, the fetch ends at the deadline with DownloadError naming it."""
    with https_phase(phase, tls_context) as (url, resolver, server):
        started = time.monotonic()
        with pytest.raises(DownloadError, match="deadline"):
            fetch(url, tmp_path / "r.wav", settings=ds, resolver=resolver)
        elapsed = time.monotonic() - started
        if server is not None:
            assert server.client_hung_up(), "the socket was not closed"
    assert DEADLINE_S - 0.05 <= elapsed < DEADLINE_S + MARGIN_S
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("phase", HTTPS_PHASES)
def test_https_stop_cuts_every_phase(tls_context, ds, tmp_path, phase):
    """A stop set while the server hangs in any phase raises Stopped with its reason within moments."""
    stop = StopSignal()
    slow = DownloadSettings(**{**ds.__dict__, "timeout_s": 3.0})
    with https_phase(phase, tls_context) as (url, resolver, server):
        when = stop_soon(stop, "lease_lost")
        with pytest.raises(Stopped) as caught:
            fetch(url, tmp_path / "r.wav", settings=slow, stop=stop, resolver=resolver)
        stopped_after = time.monotonic()
        if server is not None:
            assert server.client_hung_up(), "the socket was not closed"
    assert caught.value.reason == "lease_lost"
    assert stopped_after - when[0] < MARGIN_S
    assert leftovers(tmp_path) == []


# --- s3


def helpers_gone_within(seconds: float) -> bool:
    """Whether every helper thread a guard left behind has ended within ``seconds``."""
    ends = time.monotonic() + seconds
    while any(t.name == "download-call" for t in threading.enumerate()):
        if time.monotonic() > ends:
            return False
        time.sleep(0.05)
    return True


def s3_client_for(server: RawServer):
    """A real botocore client (no moto) whose endpoint is the misbehaving local server."""
    return boto3.client(
        "s3", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{server.port}",
        aws_access_key_id="testing", aws_secret_access_key="testing",
        # The worker's own client settings: standard retries and a read timeout far past the deadline.
        config=Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=5, read_timeout=30,
                      s3={"addressing_style": "path"}),
    )


S3_BEHAVIOURS = {"silent": hold_silently, "header-drip": drip_headers}


@pytest.mark.parametrize("behaviour", list(S3_BEHAVIOURS))
def test_s3_deadline_cuts_a_hanging_endpoint(ds, tmp_path, behaviour):
    """An S3 endpoint that never answers (or drips headers) ends at the deadline and its socket is closed."""
    with serving(S3_BEHAVIOURS[behaviour]) as server:
        started = time.monotonic()
        with pytest.raises(DownloadError, match="deadline"):
            fetch("s3://recordings/user/1.wav", tmp_path / "r.wav", settings=ds, s3_client=s3_client_for(server))
        elapsed = time.monotonic() - started
        assert server.client_hung_up(), "the S3 connection was left open"
        time.sleep(0.3)
        assert server.accepted <= 1, "botocore retried after the cut"
    assert DEADLINE_S - 0.05 <= elapsed < DEADLINE_S + MARGIN_S
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("behaviour", list(S3_BEHAVIOURS))
def test_s3_stop_cuts_a_hanging_endpoint(ds, tmp_path, behaviour):
    """A stop while S3 says nothing raises Stopped within moments and closes the connection."""
    stop = StopSignal()
    slow = DownloadSettings(**{**ds.__dict__, "timeout_s": 3.0})
    with serving(S3_BEHAVIOURS[behaviour]) as server:
        when = stop_soon(stop, "shutdown")
        with pytest.raises(Stopped) as caught:
            fetch("s3://recordings/user/1.wav", tmp_path / "r.wav", settings=slow, stop=stop,
                  s3_client=s3_client_for(server))
        assert time.monotonic() - when[0] < MARGIN_S
        assert server.client_hung_up(), "the S3 connection was left open"
        # botocore sees a dropped connection and backs off (up to 2 s) before its retry, which the
        # guard refuses: the call left behind ends instead of reconnecting.
        assert helpers_gone_within(3.0), "the abandoned GetObject is still running"
        assert server.accepted <= 1
    assert caught.value.reason == "shutdown"
    assert leftovers(tmp_path) == []


def test_a_connect_that_lands_after_the_cut_is_shut_down_when_its_helper_ends():
    """A socket adopted before the guard fired but connected after it is closed towards the server anyway."""
    from pipeline.download_guard import Cut, Guard

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(LATE_HELPER_S)
    kept = []  # the library's socket, still referenced: only the guard can end its connection

    def connect_late(guard: Guard):
        sock = socket.socket()
        kept.append(sock)
        guard.adopt(sock)  # what the audit hook does just before connect() ...
        while guard.fired is None:
            time.sleep(0.01)
        # ... whose system call lands after the firing, when shutdown could not reach it yet
        connector = threading.Thread(target=sock.connect, args=(listener.getsockname(),))
        connector.start()
        connector.join()

    started = time.monotonic()
    with Guard(lambda: DEADLINE_S - (time.monotonic() - started), None) as guard:
        with pytest.raises(Cut):
            guard.call(lambda: connect_late(guard))
    conn, _ = listener.accept()
    # The helper may end well after the cut on a loaded machine; a connection left open blocks
    # this recv until the timeout, so only a failing run waits for it.
    conn.settimeout(LATE_HELPER_S)
    try:
        assert conn.recv(1) == b"", "the late connection was left open"
    finally:
        conn.close()
        listener.close()
        kept[0].close()
