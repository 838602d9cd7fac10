"""A local HTTPS server for download tests: a trustme CA, routes that misbehave on purpose, fixtures.

Test modules import the fixtures they use by name (``from tests.pipeline.tls_server import ...``).
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import trustme

from pipeline.downloads import DownloadSettings

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
PAYLOAD = bytes(range(256)) * 1200  # 300 KiB: several TLS records and reads
SECRET = "X-Amz-Signature=secret"
HOSTS = {
    "localhost": ["127.0.0.1"],
    "rebind.test": ["127.0.0.1"],  # only the injected resolver knows it: proves we connect by IP
    "wrongname.test": ["127.0.0.1"],  # not on the server's certificate
    "metadata.test": ["169.254.169.254"],
    "private.test": ["10.1.2.3"],
    "mixed.test": ["127.0.0.1", "10.0.0.7"],
}


def resolver(host: str, port: int) -> list[str]:
    if host not in HOSTS:
        raise socket.gaierror(socket.EAI_NONAME, "unknown test host")
    return list(HOSTS[host])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers.get("Host")))
        parts = urlsplit(self.path).path.strip("/").split("/")
        route, arg = parts[0], (parts[1] if len(parts) > 1 else "")
        try:
            getattr(self, "route_" + route.replace("-", "_"), self.route_missing)(arg)
        except (OSError, ssl.SSLError):
            pass  # the client hung up, as several tests make it do

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in {"Connection": "close", **headers}.items():
            self.send_header(name, value)
        self.end_headers()

    def _body(self, status: int, body: bytes) -> None:
        self._head(status, {"Content-Length": str(len(body))})
        self.wfile.write(body)

    def route_missing(self, _arg) -> None:
        self._body(404, b"no such route")

    def route_ok(self, _arg) -> None:
        self._body(200, PAYLOAD)

    def route_bytes(self, arg) -> None:
        self._body(200, b"a" * int(arg))

    def route_status(self, arg) -> None:
        self._body(int(arg), b"error page")

    def route_redirect(self, arg) -> None:
        left = int(arg)
        location = "/ok" if left <= 1 else f"/redirect/{left - 1}"
        self._head(302, {"Location": location, "Content-Length": "0"})

    def route_redirect_signed(self, _arg) -> None:
        self._head(302, {"Location": f"/ok?{SECRET}2", "Content-Length": "0"})

    def route_to(self, arg) -> None:
        port = self.server.server_address[1]
        location = {
            "http": f"http://localhost:{port}/ok",
            "metadata": f"https://metadata.test:{port}/ok",
            "absolute": f"https://rebind.test:{port}/ok",
            "s3": "s3://bucket/key",
            "open-ipv6": "https://[::1/ok",  # urljoin itself refuses it
            "backslash": f"https://localhost:{port}\\@metadata.test/ok",
            "bad-host": f"https://bad_host.test:{port}/ok",
        }[arg]
        self._head(302, {"Location": location, "Content-Length": "0"})

    def route_declared(self, arg) -> None:
        self._body(200, b"d" * int(arg))

    def route_declared_lie(self, arg) -> None:
        # Claims a huge body, sends 10 bytes and hangs up: only the header can be judged.
        self._head(200, {"Content-Length": arg})
        self.wfile.write(b"d" * 10)

    def route_chunked(self, arg) -> None:
        self._head(200, {"Transfer-Encoding": "chunked"})
        for _ in range(int(arg) // 1000):
            self.wfile.write(b"3e8\r\n" + b"c" * 1000 + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def route_trickle(self, _arg) -> None:
        self._head(200, {"Content-Length": "300"})
        for _ in range(300):
            self.wfile.write(b"t")
            time.sleep(0.01)

    def route_stall(self, _arg) -> None:
        self._head(200, {"Content-Length": "1000"})
        self.wfile.write(b"s" * 100)
        self.server.release.wait(10)

    def route_stall_unframed(self, _arg) -> None:
        # No length and no chunking: the body ends when the connection does (HTTP/1.0 style).
        self._head(200, {})
        self.wfile.write(b"u" * 100)
        self.server.release.wait(10)

    def route_short(self, _arg) -> None:
        self._head(200, {"Content-Length": "1000"})
        self.wfile.write(b"x" * 500)

    def route_reset(self, _arg) -> None:
        self._head(200, {"Content-Length": "100000"})
        self.wfile.write(b"r" * 1000)
        # Linger 0 turns the close into a TCP reset.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()


class _TLSServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, context: ssl.SSLContext):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.context = context
        self.seen: list[tuple[str, str | None]] = []
        self.release = threading.Event()

    def finish_request(self, request, client_address) -> None:
        # Handshake in the request's own thread, so a stalled client never blocks accept().
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return  # the client rejected our certificate: the wrong-name test wants exactly that
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            tls.close()

    def handle_error(self, request, client_address) -> None:
        pass


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_path(ca, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(ca):
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "rebind.test", "metadata.test", "private.test").configure_cert(context)
    srv = _TLSServer(context)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def base(server) -> str:
    server.seen.clear()
    return f"https://localhost:{server.server_address[1]}"


@pytest.fixture
def ds(ca_path) -> DownloadSettings:
    return DownloadSettings(timeout_s=10.0, max_bytes=10**7, allowed_networks=LOOPBACK, ca_certs=ca_path)


def with_changes(ds: DownloadSettings, **changes) -> DownloadSettings:
    return DownloadSettings(**{**ds.__dict__, **changes})


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())
