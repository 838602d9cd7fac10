"""Recording downloads against a real local HTTPS server (trustme CA) and moto-backed S3."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import struct
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pytest
import trustme
from hypothesis import given
from hypothesis import strategies as st
from moto import mock_aws
from structlog.testing import capture_logs

from pipeline.downloads import (
    LOCAL_RUN_NETWORKS,
    DownloadSettings,
    classify_status,
    fetch,
    s3_error_is_permanent,
)
from pipeline.netguard import (
    checked_addresses,
    default_resolver,
    describe_error,
    parse_https,
    refusal_reason,
)
from worker.errors import BadRecording, ConfigError, DownloadError, Stopped
from worker.redact import redact_parsed_url as redact_url
from worker.settings import load_settings
from worker.stop import StopSignal

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


def _settings(ds: DownloadSettings, **changes) -> DownloadSettings:
    return DownloadSettings(**{**ds.__dict__, **changes})


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- success


def test_https_download_writes_the_body_and_renames_it(base, ds, tmp_path):
    """A 200 body is written in full to dest, no .part is left and the byte count is returned."""
    dest = tmp_path / "rec.wav"
    assert fetch(f"{base}/ok", dest, settings=ds, resolver=resolver) == len(PAYLOAD)
    assert dest.read_bytes() == PAYLOAD
    assert _leftovers(tmp_path) == ["rec.wav"]


def test_connects_to_the_checked_ip_with_the_real_name_for_tls_and_host(server, ds, tmp_path):
    """A name only the injected resolver knows works, so the socket goes to the checked IP, not to DNS."""
    port = server.server_address[1]
    server.seen.clear()
    fetch(f"https://rebind.test:{port}/ok", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert server.seen == [("/ok", f"rebind.test:{port}")]


def test_a_certificate_for_another_name_is_rejected(server, ds, tmp_path):
    """TLS checks the URL's host name against the certificate even though we connect by IP."""
    port = server.server_address[1]
    with pytest.raises(DownloadError):
        fetch(f"https://wrongname.test:{port}/ok", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert _leftovers(tmp_path) == []


def test_an_unknown_ca_is_rejected(base, ds, tmp_path):
    """Without the test CA the server's certificate is not trusted and nothing is written."""
    with pytest.raises(DownloadError):
        fetch(f"{base}/ok", tmp_path / "r.wav", settings=_settings(ds, ca_certs=None), resolver=resolver)
    assert _leftovers(tmp_path) == []


def test_a_stale_part_is_replaced_and_a_failure_keeps_the_old_file(base, ds, tmp_path):
    """A leftover .part from a crash is overwritten; a failed download leaves an existing dest alone."""
    dest = tmp_path / "rec.wav"
    (tmp_path / "rec.wav.part").write_bytes(b"junk from a crashed attempt" * 1000)
    fetch(f"{base}/bytes/10", dest, settings=ds, resolver=resolver)
    assert dest.read_bytes() == b"a" * 10
    with pytest.raises(BadRecording):
        fetch(f"{base}/status/404", dest, settings=ds, resolver=resolver)
    assert dest.read_bytes() == b"a" * 10
    assert _leftovers(tmp_path) == ["rec.wav"]


# --- status codes


@pytest.mark.parametrize("status", [404, 410, 403, 400, 418])
def test_gone_forbidden_and_other_4xx_are_permanent(base, ds, tmp_path, status):
    """404/410/403 and other 4xx answers raise BadRecording and leave no file."""
    with pytest.raises(BadRecording, match=f"HTTP {status}"):
        fetch(f"{base}/status/{status}", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("status", [408, 429, 500, 503])
def test_timeouts_throttling_and_5xx_are_retryable(base, ds, tmp_path, status):
    """408/429/5xx raise DownloadError and leave no file."""
    with pytest.raises(DownloadError, match=f"HTTP {status}"):
        fetch(f"{base}/status/{status}", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("status", "expected"),
    [(200, None), (204, None), (304, BadRecording), (400, BadRecording), (403, BadRecording),
     (404, BadRecording), (410, BadRecording), (408, DownloadError), (429, DownloadError),
     (500, DownloadError), (599, DownloadError)],
)
def test_classify_status(status, expected):
    """Each final status maps to the documented fate."""
    assert classify_status(status) is expected


# --- redirects


def test_three_redirects_are_followed(base, ds, tmp_path):
    """A chain of exactly max_redirects (3) hops ends in the body."""
    dest = tmp_path / "r.wav"
    assert fetch(f"{base}/redirect/3", dest, settings=ds, resolver=resolver) == len(PAYLOAD)
    assert dest.read_bytes() == PAYLOAD


def test_a_fourth_redirect_is_refused(base, server, ds, tmp_path):
    """A chain of 4 redirects is refused as permanent without requesting the fourth target."""
    with pytest.raises(BadRecording, match="redirects"):
        fetch(f"{base}/redirect/4", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert [path for path, _ in server.seen] == ["/redirect/4", "/redirect/3", "/redirect/2", "/redirect/1"]
    assert _leftovers(tmp_path) == []


def test_an_absolute_redirect_to_another_checked_host_is_followed(base, ds, tmp_path):
    """A Location naming another allowed host is resolved, checked and followed."""
    assert fetch(f"{base}/to/absolute", tmp_path / "r.wav", settings=ds, resolver=resolver) == len(PAYLOAD)


@pytest.mark.parametrize("where", ["http", "s3"])
def test_a_redirect_off_https_is_refused(base, server, ds, tmp_path, where):
    """A redirect to http:// or s3:// is refused: every hop must be https."""
    with pytest.raises(BadRecording, match="not https"):
        fetch(f"{base}/to/{where}", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert len(server.seen) == 1


@pytest.mark.parametrize("allowed", [LOOPBACK, LOCAL_RUN_NETWORKS])
def test_a_redirect_to_the_metadata_address_is_refused(base, ds, tmp_path, allowed):
    """A hop resolving to 169.254.169.254 is refused even when loopback/private hosts are allowed."""
    with pytest.raises(BadRecording, match="169.254.169.254"):
        fetch(f"{base}/to/metadata", tmp_path / "r.wav", settings=_settings(ds, allowed_networks=allowed),
              resolver=resolver)
    assert _leftovers(tmp_path) == []


# --- address policy


@pytest.mark.parametrize("host", ["localhost", "private.test", "mixed.test"])
def test_non_public_hosts_are_refused_before_connecting(server, ds, tmp_path, host):
    """With nothing allowed, a host resolving to 127.x or 10.x (even one address of several) is never contacted."""
    server.seen.clear()
    url = f"https://{host}:{server.server_address[1]}/ok"
    with pytest.raises(BadRecording, match=host):
        fetch(url, tmp_path / "r.wav", settings=_settings(ds, allowed_networks=()), resolver=resolver)
    assert server.seen == []
    assert _leftovers(tmp_path) == []


def test_a_host_with_one_private_address_is_refused_even_if_another_is_allowed():
    """Every resolved address must pass, not just the first."""
    with pytest.raises(BadRecording, match="10.0.0.7"):
        checked_addresses("mixed.test", 443, LOOPBACK, resolver)


def test_the_default_resolver_returns_plain_addresses():
    """The system resolver's answer is reduced to unique address strings the policy can parse."""
    assert default_resolver("127.0.0.1", 443) == ["127.0.0.1"]


def test_settings_open_private_ranges_only_on_request():
    """DOWNLOAD_ALLOW_PRIVATE_HOSTS opens loopback/private ranges (never link-local); unset, nothing is open."""
    closed = DownloadSettings.from_settings(load_settings({"DOWNLOAD_TIMEOUT_SECONDS": "5"}))
    opened = DownloadSettings.from_settings(load_settings({"DOWNLOAD_ALLOW_PRIVATE_HOSTS": "true"}))
    assert (closed.timeout_s, closed.allowed_networks) == (5.0, ())
    assert refusal_reason(ipaddress.ip_address("10.0.0.1"), opened.allowed_networks) is None
    assert refusal_reason(ipaddress.ip_address("169.254.169.254"), opened.allowed_networks) is not None


def test_an_unresolvable_host_is_retryable():
    """A resolver failure is a network error: DownloadError."""
    with pytest.raises(DownloadError, match="nowhere.test"):
        checked_addresses("nowhere.test", 443, (), resolver)


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
     "224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255", "192.0.2.1", "198.18.0.1",
     "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "fec0::1", "ff02::1", "ff0e::1",
     "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "2002:a00:1::1",
     "64:ff9b::a9fe:a9fe", "2001:db8::1", "100::1"],
)
def test_non_global_addresses_are_refused(address):
    """Loopback, private, link-local, shared, multicast, reserved, unspecified and wrapped ones are refused."""
    assert refusal_reason(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize(
    ("address", "named"),
    [("169.254.169.254", "link-local"), ("100.64.0.1", "shared"), ("224.0.0.1", "multicast"),
     ("127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "embeds 10.0.0.1, which is private")],
)
def test_a_refusal_names_the_kind_of_address(address, named):
    """The refusal reason, which ends up in the job's error, says what kind of address it was."""
    assert named in refusal_reason(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8",
                                     "2002:808:808::1", "64:ff9b::808:808"])
def test_global_addresses_are_accepted(address):
    """Globally routable addresses, plain or wrapping a public IPv4, pass."""
    assert refusal_reason(ipaddress.ip_address(address)) is None


def test_allowed_networks_open_only_their_own_ranges():
    """An allowed network admits its addresses (also IPv4-mapped) and nothing else."""
    assert refusal_reason(ipaddress.ip_address("127.0.0.1"), LOOPBACK) is None
    assert refusal_reason(ipaddress.ip_address("::ffff:127.0.0.1"), LOOPBACK) is None
    assert refusal_reason(ipaddress.ip_address("10.0.0.1"), LOOPBACK) is not None


@given(st.ip_addresses(v=4))
def test_ipv4_mapped_addresses_get_the_ipv4_verdict(address):
    """Wrapping an IPv4 address in ::ffff:0:0/96 never changes whether it is refused."""
    mapped = ipaddress.IPv6Address(f"::ffff:{address}")
    assert (refusal_reason(mapped) is None) == (refusal_reason(address) is None)


@pytest.mark.parametrize(
    "url", ["http://localhost/ok", "ftp://localhost/ok", "https:///ok", "https://user:pw@localhost/ok",
            "https://bad_host!/ok", "https://localhost:99999/ok"],
)
def test_only_plain_https_urls_are_accepted(url):
    """Other schemes, missing or odd hosts, bad ports and userinfo are refused as permanent."""
    with pytest.raises(BadRecording):
        parse_https(url)


@pytest.mark.parametrize(
    ("url", "shown"),
    [("https://user:pw@Host.example:8443/a/b.wav?X-Amz-Signature=s#frag", "https://host.example:8443/a/b.wav"),
     ("https://[::1]/x?q=1", "https://[::1]/x"), ("s3://bucket/key.wav", "s3://bucket/key.wav"),
     ("https://[::1/x", "<unparsable url>")],
)
def test_redact_url_keeps_only_scheme_host_port_and_path(url, shown):
    """redact_url drops userinfo, query string and fragment."""
    assert redact_url(url) == shown


# --- size cap


@pytest.mark.parametrize(("route", "limit"), [("declared/5000", 4999), ("declared-lie/1000000000000", 10**7)])
def test_a_declared_length_over_the_cap_is_permanent(base, ds, tmp_path, route, limit):
    """Content-Length above max_bytes is refused from the header alone, before the body is read."""
    with pytest.raises(BadRecording, match="over the limit"):
        fetch(f"{base}/{route}", tmp_path / "r.wav", settings=_settings(ds, max_bytes=limit), resolver=resolver)
    assert _leftovers(tmp_path) == []


def test_a_chunked_body_over_the_cap_is_permanent(base, ds, tmp_path):
    """A body with no declared length is cut off as soon as it passes max_bytes."""
    with pytest.raises(BadRecording, match="over the limit"):
        fetch(f"{base}/chunked/5000", tmp_path / "r.wav", settings=_settings(ds, max_bytes=2500), resolver=resolver)
    assert _leftovers(tmp_path) == []


def test_a_body_of_exactly_the_cap_is_accepted(base, ds, tmp_path):
    """The cap is inclusive: max_bytes bytes, declared or chunked, are fine."""
    small = _settings(ds, max_bytes=5000)
    assert fetch(f"{base}/declared/5000", tmp_path / "a.wav", settings=small, resolver=resolver) == 5000
    assert fetch(f"{base}/chunked/5000", tmp_path / "b.wav", settings=small, resolver=resolver) == 5000


# --- deadline, network failures, stop


def test_a_trickling_body_hits_the_whole_file_deadline(base, ds, tmp_path):
    """A server sending a byte every 10 ms never trips a read timeout, yet the per-file deadline ends it."""
    with pytest.raises(DownloadError, match="deadline"):
        fetch(f"{base}/trickle", tmp_path / "r.wav", settings=_settings(ds, timeout_s=0.3), resolver=resolver)
    assert _leftovers(tmp_path) == []


def test_a_stalled_body_hits_the_deadline(base, ds, tmp_path):
    """A server that stops sending mid-body is cut off at the deadline and the .part removed."""
    with pytest.raises(DownloadError, match="deadline"):
        fetch(f"{base}/stall", tmp_path / "r.wav", settings=_settings(ds, timeout_s=0.3), resolver=resolver)
    assert _leftovers(tmp_path) == []


def test_a_connection_reset_mid_body_is_retryable(base, ds, tmp_path):
    """A TCP reset after part of the body raises DownloadError and removes the .part."""
    with pytest.raises(DownloadError):
        fetch(f"{base}/reset", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert _leftovers(tmp_path) == []


def test_a_body_shorter_than_declared_is_retryable(base, ds, tmp_path):
    """A clean close before Content-Length bytes arrived is a failed download, not a short file."""
    with pytest.raises(DownloadError):
        fetch(f"{base}/short", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert _leftovers(tmp_path) == []


def test_a_refused_connection_is_retryable(ds, tmp_path):
    """Nothing listening on the port is a network error."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(DownloadError, match="could not connect"):
        fetch(f"https://localhost:{port}/ok", tmp_path / "r.wav", settings=ds, resolver=resolver)


@pytest.mark.parametrize("route", ["stall", "stall-unframed"])
def test_a_stop_during_a_stalled_read_raises_stopped_promptly(base, ds, tmp_path, route):
    """A stop while a read is blocked ends it within moments as Stopped, never as a short success."""
    stop = StopSignal()
    timer = threading.Timer(0.2, stop.set, args=("shutdown",))
    timer.start()
    started = time.monotonic()
    with pytest.raises(Stopped) as caught:
        fetch(f"{base}/{route}", tmp_path / "r.wav", settings=_settings(ds, timeout_s=30), stop=stop,
              resolver=resolver)
    timer.join()
    assert caught.value.reason == "shutdown"
    assert time.monotonic() - started < 5  # the stall lasts 10 s and the deadline is 30 s
    assert _leftovers(tmp_path) == []


def test_a_stop_set_before_the_start_does_no_work(base, server, ds, tmp_path):
    """An already-set stop raises Stopped before any request, directory or file is made."""
    stop = StopSignal()
    stop.set("cancelled")
    for url in (f"{base}/ok", "s3://recordings/user/1.wav"):
        with pytest.raises(Stopped):
            fetch(url, tmp_path / "new" / "r.wav", settings=ds, stop=stop, resolver=resolver)
    assert server.seen == []
    assert _leftovers(tmp_path) == []


def test_a_part_path_that_cannot_be_written_is_retryable(base, ds, tmp_path):
    """A .part that cannot be opened (a planted symlink is not followed) is a DownloadError."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / "r.wav.part").symlink_to(victim)
    with pytest.raises(DownloadError, match="cannot write"):
        fetch(f"{base}/ok", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert victim.read_bytes() == b"keep"


# --- secrets


def _everything_said(caught: pytest.ExceptionInfo | None, logs: list[dict]) -> str:
    said = [repr(event) for event in logs]
    if caught is not None:
        said.append("".join(traceback.format_exception(caught.value)))
    return "\n".join(said)


@pytest.mark.parametrize(
    ("path", "error"),
    [("ok", None), ("status/404", BadRecording), ("status/503", DownloadError),
     ("redirect/4", BadRecording), ("redirect-signed", None), ("trickle", DownloadError),
     ("reset", DownloadError), ("to/metadata", BadRecording), ("o k%00\x01", BadRecording)],
)
def test_query_strings_never_reach_logs_or_errors(base, ds, tmp_path, path, error):
    """A presigned query string appears in no log event, exception message or traceback, whatever happens."""
    url = f"{base}/{path}?{SECRET}#frag-secret"
    caught = None
    with capture_logs() as logs:
        if error is None:
            fetch(url, tmp_path / "r.wav", settings=_settings(ds, timeout_s=0.3), resolver=resolver)
        else:
            with pytest.raises(error) as caught:
                fetch(url, tmp_path / "r.wav", settings=_settings(ds, timeout_s=0.3), resolver=resolver)
    said = _everything_said(caught, logs)
    assert logs, "the download should have logged something"
    assert "secret" not in said


def test_third_party_error_text_is_scrubbed():
    """A library message quoting the request target loses its query string, userinfo and fragment."""
    url = f"https://me:pw-secret@localhost/a.wav?{SECRET}#frag-secret"
    quoted = OSError(f"bad target '/a.wav?{SECRET}' for me:pw-secret (#frag-secret)")
    described = describe_error(quoted, url)
    assert described.startswith("OSError: bad target '/a.wav?")
    assert "secret" not in described


def test_userinfo_never_reaches_logs_or_errors(base, ds, tmp_path):
    """Credentials in a URL's userinfo are refused without being repeated."""
    url = base.replace("https://", "https://user:hunter2@") + "/ok"
    with capture_logs() as logs, pytest.raises(BadRecording) as caught:
        fetch(url, tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert "hunter2" not in _everything_said(caught, logs)


# --- s3


@pytest.fixture
def s3():
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="recordings")
        client.put_object(Bucket="recordings", Key="user/1.wav", Body=PAYLOAD)
        yield client


def test_s3_download_streams_the_object(s3, ds, tmp_path):
    """s3://bucket/key goes through the injected client and lands whole at dest."""
    dest = tmp_path / "r.wav"
    assert fetch("s3://recordings/user/1.wav", dest, settings=ds, s3_client=s3) == len(PAYLOAD)
    assert dest.read_bytes() == PAYLOAD
    assert _leftovers(tmp_path) == ["r.wav"]


@pytest.mark.parametrize("url", ["s3://recordings/user/missing.wav", "s3://no-such-bucket/user/1.wav"])
def test_s3_missing_key_or_bucket_is_permanent(s3, ds, tmp_path, url):
    """NoSuchKey and NoSuchBucket raise BadRecording and leave no file."""
    with pytest.raises(BadRecording):
        fetch(url, tmp_path / "r.wav", settings=ds, s3_client=s3)
    assert _leftovers(tmp_path) == []


def test_s3_object_over_the_cap_is_permanent(s3, ds, tmp_path):
    """An object larger than max_bytes is refused and nothing is kept."""
    with pytest.raises(BadRecording, match="over the limit"):
        fetch("s3://recordings/user/1.wav", tmp_path / "r.wav", settings=_settings(ds, max_bytes=1000), s3_client=s3)
    assert _leftovers(tmp_path) == []


def test_the_deadline_is_checked_between_chunks(s3, ds, tmp_path):
    """Even when no read blocks (so no watchdog can help), the loop stops once the deadline has passed."""
    s3.put_object(Bucket="recordings", Key="user/big.wav", Body=b"b" * (5 * 1024 * 1024))
    ticks = iter(range(1000))
    with pytest.raises(DownloadError, match="deadline"):
        fetch("s3://recordings/user/big.wav", tmp_path / "r.wav", settings=_settings(ds, timeout_s=2.5),
              s3_client=s3, clock=lambda: float(next(ticks)))
    assert _leftovers(tmp_path) == []


def test_s3_without_a_client_is_a_wiring_error(ds, tmp_path):
    """An s3:// URL with no client is a configuration problem, not the recording's fault."""
    with pytest.raises(ConfigError):
        fetch("s3://recordings/user/1.wav", tmp_path / "r.wav", settings=ds)


@pytest.mark.parametrize("url", ["s3://recordings", "s3:///key", "s3://recordings/k?versionId=1", "ftp://x/y"])
def test_malformed_recording_urls_are_permanent(ds, tmp_path, url):
    """Anything that is not https:// or s3://bucket/key is refused as permanent."""
    with pytest.raises(BadRecording):
        fetch(url, tmp_path / "r.wav", settings=ds)


@pytest.mark.parametrize(
    ("code", "status", "permanent"),
    [("NoSuchKey", 404, True), ("NoSuchBucket", 404, True), ("AccessDenied", 403, True), ("", 404, True),
     ("InternalError", 500, False), ("SlowDown", 503, False), ("RequestTimeout", 400, False)],
)
def test_s3_error_classification(code, status, permanent):
    """Only gone/forbidden S3 answers are permanent; the rest are worth a retry."""
    assert s3_error_is_permanent(code, status) is permanent
