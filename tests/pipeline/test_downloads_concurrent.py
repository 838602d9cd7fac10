"""A job's recordings downloaded several at a time: in flight together, in order, within the job's
budget, over kept-alive connections per checked address, and cut together by a stop or a failure."""

from __future__ import annotations

import ssl
import threading
from collections import Counter
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.config import load_pipeline_config
from pipeline.download_pool import DownloadPool, Item
from pipeline.downloads import Connections, DownloadSettings
from pipeline.errors import BadRecording
from pipeline.recording_url import parse_recording_url
from pipeline.run import PipelineTrainer, download_all
from tests.pipeline.tls_server import LOOPBACK, ca, ca_path, leftovers  # noqa: F401  (ca, ca_path are fixtures)
from tests.support import FakeJob as Job
from tests.support import FakeRecording as Rec
from worker.core.errors import Stopped
from worker.core.stop import StopSignal
from worker.settings import load_settings

REPO = Path(__file__).resolve().parents[2]
SERVER_GIVES_UP_S = 10.0  # a broken client fails a test instead of hanging it
STALL_S = 5.0  # a stalled body completes after this long, well before the client's 30 s deadline
NAMES = {"one.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}


def body_of(index: int, size: int = 3000) -> bytes:
    return bytes([index % 251]) * size


def resolver(host: str, port: int) -> list[str]:
    return list(NAMES[host])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive unless a route says otherwise

    def log_message(self, *_args) -> None:
        pass

    def do_GET(self) -> None:
        srv: _Server = self.server  # type: ignore[assignment]
        route, _, arg = self.path.strip("/").partition("/")
        with srv.lock:
            srv.requests.append(self.path)
            srv.per_connection[id(self.connection)] += 1
            srv.request_arrived.notify_all()
        try:
            getattr(self, "route_" + route)(arg)
        except (OSError, ssl.SSLError):
            with srv.lock:
                srv.hung_up.append(self.path)
                srv.request_arrived.notify_all()
            raise
        with srv.lock:
            srv.served.add(self.path)
            srv.request_arrived.notify_all()

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def route_rec(self, arg: str) -> None:
        self._send(200, body_of(int(arg)))

    def route_size(self, arg: str) -> None:
        """``size/<n>[/<anything>]``: n bytes with their length declared."""
        self._send(200, b"s" * int(arg.split("/")[0]))

    def route_chunked(self, arg: str) -> None:
        """``chunked/<n>``: n bytes (a multiple of 100) with no declared length."""
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for _ in range(int(arg) // 100):
            self.wfile.write(b"64\r\n" + b"c" * 100 + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def route_status(self, arg: str) -> None:
        self._send(int(arg), b"error page")

    def route_gather(self, arg: str) -> None:
        """Answers only once ``gather`` requests are in at the same time."""
        try:
            self.server.barrier.wait(SERVER_GIVES_UP_S)  # type: ignore[attr-defined]
        except threading.BrokenBarrierError:
            self._send(503, b"the others never came")
            return
        self._send(200, body_of(int(arg)))

    def route_after(self, arg: str) -> None:
        """``after/<path>/<index>``: recording ``index``, once the request for ``/<path>`` has been answered."""
        waited, _, index = arg.rpartition("/")
        srv: _Server = self.server  # type: ignore[assignment]
        with srv.lock:
            srv.request_arrived.wait_for(lambda: f"/{waited}" in srv.served, SERVER_GIVES_UP_S)
        self._send(200, body_of(int(index)))

    def route_late1000(self, arg: str) -> None:
        """``late1000/<path>``: 1000 bytes, once the request for ``/<path>`` has been answered."""
        srv: _Server = self.server  # type: ignore[assignment]
        with srv.lock:
            srv.request_arrived.wait_for(lambda: f"/{arg}" in srv.served, SERVER_GIVES_UP_S)
        self._send(200, b"l" * 1000)

    def route_late404(self, arg: str) -> None:
        """``late404/<path>``: a 404, once a request for ``/<path>`` has arrived."""
        srv: _Server = self.server  # type: ignore[assignment]
        with srv.lock:
            srv.request_arrived.wait_for(lambda: f"/{arg}" in srv.requests, SERVER_GIVES_UP_S)
        self._send(404, b"gone")

    def route_stall(self, _arg: str) -> None:
        """Headers and part of the body, then nothing for STALL_S (short of the client's deadline), then the rest."""
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"s" * 100)
        self.wfile.flush()
        if self.server.release.wait(STALL_S):  # type: ignore[attr-defined]
            return
        self.wfile.write(b"s" * 900)

    def route_hold(self, _arg: str) -> None:
        """Like stall, but noticing the client hanging up while it holds."""
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"s" * 100)
        self.wfile.flush()
        while not self.server.release.wait(0.05):  # type: ignore[attr-defined]
            # A peek tells when the client hung up: its shutdown ends the TLS stream.
            try:
                self.connection.settimeout(0.01)
                if self.connection.recv(1) == b"":
                    raise ConnectionResetError
            except (TimeoutError, ssl.SSLWantReadError):
                pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, context: ssl.SSLContext, gather: int = 1):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.context = context
        self.lock = threading.Lock()
        self.request_arrived = threading.Condition(self.lock)
        self.requests: list[str] = []
        self.served: set[str] = set()
        self.hung_up: list[str] = []
        self.handshakes = 0
        self.per_connection: Counter[int] = Counter()
        self.barrier = threading.Barrier(gather)
        self.release = threading.Event()

    def finish_request(self, request, client_address) -> None:
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        with self.lock:
            self.handshakes += 1
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            tls.close()

    def handle_error(self, request, client_address) -> None:
        pass

    def wait_for_requests(self, count: int) -> bool:
        with self.lock:
            return self.request_arrived.wait_for(lambda: len(self.requests) >= count, SERVER_GIVES_UP_S)

    def wait_for_hang_ups(self, count: int) -> bool:
        with self.lock:
            return self.request_arrived.wait_for(lambda: len(self.hung_up) >= count, SERVER_GIVES_UP_S)


@pytest.fixture(scope="module")
def context(ca) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("one.test", "other.test").configure_cert(ctx)
    return ctx


@pytest.fixture
def serve(context):
    servers: list[_Server] = []

    def start(gather: int = 1) -> _Server:
        srv = _Server(context, gather)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.release.set()
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def settings(ca_path) -> DownloadSettings:
    return DownloadSettings(timeout_s=30.0, max_bytes=10**7, allowed_networks=LOOPBACK, ca_certs=ca_path, concurrency=4)



def job_of(srv: _Server, paths: list[str], host: str = "one.test") -> Job:
    port = srv.server_address[1]
    return Job(tuple(Rec(parse_recording_url(f"https://{host}:{port}/{path}")) for path in paths))


def run_step(tmp_path: Path, job: Job, settings: DownloadSettings, stop: StopSignal | None = None,
             budget_bytes: int | None = None, sized: bool = True) -> list[Path]:
    """The download step as ``PipelineTrainer`` runs it: its Downloader (with the test resolver) and its plan."""
    stop = stop or StopSignal()
    trainer = PipelineTrainer(load_pipeline_config(REPO / "config" / "pipeline.toml"), settings)
    fetch = replace(trainer.downloader(stop), resolver=resolver, connections=None)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return download_all(job, tmp_path / "downloads", tmp_path / "logs", stop, fetch, lambda _s, _p: None,
                        budget_bytes, replace(trainer.download_plan, sized_reservations=sized))


def test_several_downloads_are_in_flight_at_once(serve, settings, tmp_path):
    """Four recordings whose server answers only once all four requests are in: all four arrive."""
    srv = serve(gather=4)
    paths = run_step(tmp_path, job_of(srv, [f"gather/{i}" for i in range(4)]), settings)
    assert [p.read_bytes() for p in paths] == [body_of(i) for i in range(4)]


def test_results_and_the_step_log_follow_the_order_of_the_recordings(serve, settings, tmp_path):
    """The first recording finishing last still comes first, in the paths and in the step's log."""
    srv = serve()
    paths = run_step(tmp_path, job_of(srv, ["after/rec/3/0", "rec/1", "rec/2", "rec/3"]), settings)
    assert [p.name for p in paths] == ["00000.audio", "00001.audio", "00002.audio", "00003.audio"]
    assert [p.read_bytes() for p in paths] == [body_of(i) for i in range(4)]
    log = next((tmp_path / "logs").glob("*-download.log")).read_text()
    assert [line.split(":")[0] for line in log.splitlines()] == [f"recording {i}" for i in range(4)]


def test_connections_are_kept_alive_per_checked_address(serve, settings, tmp_path):
    """Twelve files over four at a time make at most four TLS handshakes, each connection serving several."""
    srv = serve()
    run_step(tmp_path, job_of(srv, [f"rec/{i}" for i in range(12)]), settings)
    assert srv.handshakes <= settings.concurrency
    assert sum(srv.per_connection.values()) == 12


def test_a_connection_is_never_shared_between_names_or_addresses(serve, settings, tmp_path):
    """Pools are keyed by the checked address, the port and the TLS name: the same address under another
    name gets a connection of its own, and another address another pool."""
    srv = serve()
    port = srv.server_address[1]
    one, other = (parse_recording_url(f"https://{h}:{port}/rec/1") for h in ("one.test", "other.test"))
    connections = Connections(settings)
    assert connections.pool("127.0.0.1", one) is connections.pool("127.0.0.1", one)
    assert connections.pool("127.0.0.1", one) is not connections.pool("127.0.0.2", one)
    assert connections.pool("127.0.0.1", one) is not connections.pool("127.0.0.1", other)
    sequential = DownloadSettings(**{**settings.__dict__, "concurrency": 1})
    job = Job(job_of(srv, ["rec/0", "rec/1"]).recordings + job_of(srv, ["rec/2", "rec/3"], "other.test").recordings)
    run_step(tmp_path, job, sequential)
    assert srv.handshakes == 2 and sorted(srv.per_connection.values()) == [2, 2]


@pytest.mark.parametrize("sized", [True, False], ids=["declared-length-shares", "maximum-shares"])
def test_the_job_budget_holds_exactly_under_concurrency(serve, settings, tmp_path, sized):
    """With room for five files and a half, the first five land and the sixth is refused with what was left,
    whether each file reserves its declared length or its maximum."""
    srv = serve()
    small = DownloadSettings(**{**settings.__dict__, "max_bytes": 1500})
    with pytest.raises(BadRecording, match=r"size/1000/5: the job's total download limit \(MAX_JOB_DOWNLOAD_BYTES\) "
                                           r"was hit, 500 bytes were left"):
        run_step(tmp_path, job_of(srv, [f"size/1000/{i}" for i in range(10)]), small, budget_bytes=5500, sized=sized)
    assert leftovers(tmp_path / "downloads") == [f"0000{i}.audio" for i in range(5)]


def test_shares_are_taken_in_the_order_of_the_recordings(serve, settings, tmp_path):
    """The first recording's length arrives last, yet it gets its share first: the third is the one refused."""
    srv = serve()
    with pytest.raises(BadRecording, match=r"size/1000/2: the job's total download limit .* 500 bytes were left"):
        run_step(tmp_path, job_of(srv, ["late1000/size/1000/2", "size/1000/1", "size/1000/2"]), settings,
                 budget_bytes=2500)
    assert leftovers(tmp_path / "downloads") == ["00000.audio", "00001.audio"]


@pytest.mark.parametrize("sized", [True, False], ids=["declared-length-shares", "maximum-shares"])
def test_a_file_that_does_not_fit_yet_waits_for_what_the_files_in_flight_give_back(serve, settings, tmp_path, sized):
    """A body of unknown length reserves the file maximum; the next file, which fits only once the first
    gave back what it did not use, waits for that instead of being refused."""
    srv = serve()
    small = DownloadSettings(**{**settings.__dict__, "max_bytes": 1500})
    paths = run_step(tmp_path, job_of(srv, ["chunked/1000", "size/1000"]), small, budget_bytes=2200, sized=sized)
    assert [p.stat().st_size for p in paths] == [1000, 1000]


def test_reservations_never_exceed_the_budget(tmp_path):
    """Whatever the timing, the reservations of the files in flight and the bytes of those done stay within it."""
    lock, in_flight, done, seen = threading.Lock(), {}, [0], []
    budget, file_max = 10_000, 3000

    def fetch(url, dest: Path, *, remaining_job_bytes: int, stop: StopSignal) -> None:
        with lock:
            in_flight[dest] = remaining_job_bytes
            seen.append(sum(in_flight.values()) + done[0])
        size = 1500 + int(dest.stem) % 3 * 700  # like the real fetch: refused when over its share
        with lock:
            del in_flight[dest]
            if size > remaining_job_bytes:
                raise BadRecording(f"{dest.name}: over the budget")
            done[0] += size
        dest.write_bytes(b"x" * size)

    url = parse_recording_url("https://one.test/r")
    items = [Item(i, url, tmp_path / f"{i}.audio") for i in range(12)]
    pool = DownloadPool(items, fetch, StopSignal(), budget_bytes=budget, file_max_bytes=file_max, concurrency=6,
                        over_budget="over")
    with pytest.raises(BadRecording):
        pool.run(lambda _done: None)
    assert seen and max(seen) <= budget
    assert sum(p.stat().st_size for p in tmp_path.glob("*.audio")) <= budget


def test_a_stop_cuts_every_download_in_flight(serve, settings, tmp_path):
    """Four stalled downloads end together as Stopped when the job's stop is set, each hanging up, no .part left."""
    srv = serve()
    stop = StopSignal()
    threading.Thread(target=lambda: srv.wait_for_requests(4) and stop.set("shutdown"), daemon=True).start()
    with pytest.raises(Stopped) as caught:
        run_step(tmp_path, job_of(srv, [f"hold/{i}" for i in range(4)]), settings, stop=stop)
    assert caught.value.reason == "shutdown"
    assert srv.wait_for_hang_ups(4), "a stalled download was left open"
    assert leftovers(tmp_path / "downloads") == []


def test_a_permanent_failure_cuts_the_later_downloads_in_flight(serve, settings, tmp_path):
    """Once a recording is gone for good, the stalled ones after it are cut (they would complete later) and the
    failure is reported."""
    srv = serve()
    with pytest.raises(BadRecording, match="late404/stall/2 answered HTTP 404"):
        run_step(tmp_path, job_of(srv, ["late404/stall/2", "stall/1", "stall/2"]), settings)
    assert leftovers(tmp_path / "downloads") == []


def test_the_first_failure_by_recording_is_the_one_reported(tmp_path):
    """Recording 1 fails first in time, recording 0 after it: the error reported is recording 0's."""
    one_failed = threading.Event()

    def fetch(url, dest: Path, *, stop: StopSignal) -> None:
        if dest.name == "1.audio":
            one_failed.set()
            raise BadRecording("recording 1 is gone")
        # Recording 0 fails only once the worker that fetched recording 1 has ended: after its failure.
        assert one_failed.wait(10)
        while len([t for t in threading.enumerate() if t.name.removeprefix("download-").isdigit()]) > 1:
            threading.Event().wait(0.01)
        raise BadRecording("recording 0 is gone")

    url = parse_recording_url("https://one.test/r")
    items = [Item(i, url, tmp_path / f"{i}.audio") for i in range(3)]
    pool = DownloadPool(items, fetch, StopSignal(), budget_bytes=None, file_max_bytes=None, concurrency=2,
                        over_budget="over")
    with pytest.raises(BadRecording, match="recording 0 is gone"):
        pool.run(lambda _done: None)


def test_a_failing_progress_report_cuts_the_downloads_in_flight(serve, settings, tmp_path):
    """When reporting progress fails, the step ends with that error and no download goes on without it."""
    srv = serve()

    class ReportFailed(Exception):
        pass

    def progress(_step: str, percent: float) -> None:
        if 0 < percent < 100:
            raise ReportFailed

    stop = StopSignal()
    trainer = PipelineTrainer(load_pipeline_config(REPO / "config" / "pipeline.toml"), settings)
    fetch = replace(trainer.downloader(stop), resolver=resolver, connections=None)
    (tmp_path / "logs").mkdir()
    job = job_of(srv, ["rec/0"] + [f"stall/{i}" for i in range(1, 4)])
    with pytest.raises(ReportFailed):
        download_all(job, tmp_path / "downloads", tmp_path / "logs", stop, fetch, progress, None,
                     trainer.download_plan)
    assert leftovers(tmp_path / "downloads") == ["00000.audio"]
    assert not [t for t in threading.enumerate() if t.name.removeprefix("download-").isdigit()]


def test_the_step_syncs_the_downloads_directory_once(serve, settings, tmp_path, monkeypatch):
    """Each file's data is synced before its rename; the renames are made durable by one sync at the end."""
    synced: list[Path] = []
    monkeypatch.setattr("pipeline.part_file.fsync_dir", lambda d, **_k: synced.append(d))
    monkeypatch.setattr("pipeline.run.fsync_dir", lambda d, **_k: synced.append(d))
    srv = serve()
    run_step(tmp_path, job_of(srv, [f"rec/{i}" for i in range(5)]), settings)
    assert synced == [tmp_path / "downloads"]


def test_download_concurrency_reaches_the_downloader():
    """DOWNLOAD_CONCURRENCY (default 8) is the download settings' concurrency."""
    assert load_settings({}).download_settings().concurrency == 8
    assert load_settings({"DOWNLOAD_CONCURRENCY": "3"}).download_settings().concurrency == 3
