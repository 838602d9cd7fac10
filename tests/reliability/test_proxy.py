"""The soak's TCP proxy against a loopback echo server: it passes, drops, stalls and delays as told."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.reliability.procs import wait_until
from tests.reliability.proxy import DROP, PASS, STALL, FaultProxy, loopback_target

QUIET_S = 0.5  # how long "nothing arrives" is watched for


class Echo:
    """A loopback echo server that counts the bytes it received."""

    def __init__(self):
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.received = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._done.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.received += len(data)
                conn.sendall(data)

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        self._server.close()


@pytest.fixture
def echo():
    server = Echo()
    yield server
    server.close()


@pytest.fixture
def proxy(echo):
    with FaultProxy(echo.url, max_stall_s=10) as proxy:
        yield proxy


def connect(proxy: FaultProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=5)


def receive(conn: socket.socket, n_bytes: int, timeout_s: float = 5) -> bytes:
    conn.settimeout(timeout_s)
    data = b""
    while len(data) < n_bytes:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def nothing_arrives(conn: socket.socket) -> bool:
    conn.settimeout(QUIET_S)
    try:
        conn.recv(1)
    except TimeoutError:
        return True
    return False


def test_passes_bytes_both_ways(proxy):
    """In pass-through, what the client sends comes back from the server unchanged."""
    payload = bytes(range(256)) * 1024
    with connect(proxy) as conn:
        conn.sendall(payload)
        assert receive(conn, len(payload)) == payload
    assert proxy.mode == PASS


def test_drop_closes_open_connections_and_refuses_new_ones(proxy):
    """A drop ends every open connection and closes new ones at once; pass-through afterwards works again."""
    with connect(proxy) as conn:
        conn.sendall(b"hello")
        assert receive(conn, 5) == b"hello"
        proxy.drop()
        assert receive(conn, 1) == b""
    with connect(proxy) as conn:
        assert receive(conn, 1) == b""
    assert proxy.mode == DROP
    proxy.passthrough()
    with connect(proxy) as conn:
        conn.sendall(b"again")
        assert receive(conn, 5) == b"again"


def test_a_stall_holds_the_bytes_and_delivers_them_on_release(proxy):
    """While stalled nothing gets through, on either an open or a new connection; released, everything held arrives."""
    with connect(proxy) as old:
        old.sendall(b"ping")
        assert receive(old, 4) == b"ping"
        proxy.stall()
        old.sendall(b"held")
        with connect(proxy) as new:
            new.sendall(b"also held")
            assert nothing_arrives(old) and nothing_arrives(new)
            proxy.passthrough()
            assert receive(old, 4) == b"held" and receive(new, 9) == b"also held"


def test_an_armed_stall_starts_mid_request(echo, proxy):
    """Armed for 100 kB, the proxy forwards the first bytes of a larger request to the server and holds the rest."""
    payload = b"x" * 400_000
    proxy.stall_after(100_000)
    with connect(proxy) as conn:
        conn.sendall(payload)
        wait_until(lambda: proxy.mode == STALL and echo.received > 0, 5, "the stall and the first bytes")
        assert proxy.stalls == 1 and 0 < echo.received < len(payload)
        proxy.passthrough()
        assert receive(conn, len(payload)) == payload


def test_a_forgotten_stall_releases_itself(echo):
    """A stall never released ends after max_stall_s, so a test cannot hold a worker forever."""
    with FaultProxy(echo.url, max_stall_s=0.3) as proxy, connect(proxy) as conn:
        proxy.stall()
        conn.sendall(b"late")
        assert receive(conn, 4) == b"late"
        assert proxy.mode == PASS


def test_delay_adds_latency_to_each_chunk(proxy):
    """With a delay set, an echo takes at least the delay there and back (a lower bound: a slow machine only adds)."""
    proxy.delay(0.2)
    with connect(proxy) as conn:
        started_s = time.monotonic()
        conn.sendall(b"slow")
        assert receive(conn, 4) == b"slow"
        assert time.monotonic() - started_s >= 0.4


def test_only_loopback_targets_are_forwarded():
    """The proxy refuses a target off the loopback interface."""
    with pytest.raises(ValueError):
        loopback_target("http://example.com:80")
    assert loopback_target("http://127.0.0.1:4566") == ("127.0.0.1", 4566)
