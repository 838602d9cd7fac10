"""The download step against urllib3 used directly: the same files, side by side in one run.

    python benchmarks/downloads.py [--files 50] [--size 1000000] [--latency-ms 20] [--runs 3]

A local HTTPS server (a trustme CA, in a process of its own so that it does not share the client's
GIL) serves FILES bodies of SIZE bytes. Every round trip costs LATENCY: a new connection waits two
(the TCP and the TLS handshake) before it is served, and every request one before its answer.
Each way fetches all files to disk, RUNS times, the ways taking turns:
  project   the download step as a job runs it (``pipeline.run``'s step with the ``Downloader`` that
            ``PipelineTrainer`` builds from the worker's default settings, DOWNLOAD_ALLOW_PRIVATE_HOSTS
            so that loopback may be fetched, and the default MAX_JOB_DOWNLOAD_BYTES budget): address
            checks, the guard, atomic writes with fsync, the step log
  baseline  urllib3 used directly: one PoolManager (kept-alive connections), 8 threads, each file
            streamed to disk in 1 MB chunks
Wall time is time.perf_counter; medians are printed, with the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import os
import random
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import urllib3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.recording_url import RecordingUrl, parse_recording_url  # noqa: E402
from worker.core.stop import StopSignal  # noqa: E402

BASELINE_THREADS = 8
CHUNK_BYTES = 1024 * 1024


def body_of(index: int, size: int) -> bytes:
    return random.Random(index).randbytes(size)


# --- the server (a child process: ``--serve``)


def serve(cert_dir: Path, files: int, size: int, latency_s: float) -> None:
    bodies = [body_of(i, size) for i in range(files)]
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_dir / "server.pem")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args) -> None:
            pass

        def do_GET(self) -> None:
            time.sleep(latency_s)  # the request's round trip
            body = bodies[int(self.path.rsplit("/", 1)[1])]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128

        def finish_request(self, request, client_address) -> None:
            time.sleep(2 * latency_s)  # the TCP and the TLS handshake's round trips
            try:
                tls = context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                return
            try:
                Handler(tls, client_address, self)
            finally:
                tls.close()

        def handle_error(self, request, client_address) -> None:
            pass

    server = Server(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


# --- the two ways


@dataclass(frozen=True)
class Rec:
    url: RecordingUrl
    text: str


@dataclass(frozen=True)
class Job:
    job_id: str
    language: str
    recordings: tuple[Rec, ...]


def project(urls: list[str], ca_path: str, out: Path) -> float:
    from pipeline.config import load_pipeline_config
    from pipeline.run import PipelineTrainer, download_all
    from pipeline.workdir import work_layout
    from worker.settings import load_settings

    settings = load_settings({"DOWNLOAD_ALLOW_PRIVATE_HOSTS": "true"})
    downloads = settings.download_settings()
    downloads = type(downloads)(**{**downloads.__dict__, "ca_certs": ca_path})
    trainer = PipelineTrainer(load_pipeline_config(ROOT / "config" / "pipeline.toml"), downloads,
                              limits=settings.job_limits())
    job = Job("bench", "en", tuple(Rec(parse_recording_url(u), "t") for u in urls))
    dirs = work_layout(out / "work")
    dirs.logs.mkdir(parents=True)
    stop = StopSignal()
    started = time.perf_counter()
    download_all(job, dirs.downloads, dirs.logs, stop, trainer.downloader(stop), lambda _s, _p: None,
                 trainer.limits.max_job_download_bytes, trainer.download_plan)
    return time.perf_counter() - started


def baseline(urls: list[str], ca_path: str, out: Path) -> float:
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    http = urllib3.PoolManager(maxsize=BASELINE_THREADS, cert_reqs="CERT_REQUIRED", ca_certs=ca_path)

    def one(pair: tuple[int, str]) -> None:
        index, url = pair
        resp = http.request("GET", url, preload_content=False)
        with open(out / f"{index:05d}.audio", "wb") as file:
            for chunk in resp.stream(CHUNK_BYTES):
                file.write(chunk)
        resp.release_conn()

    with ThreadPoolExecutor(BASELINE_THREADS) as pool:
        list(pool.map(one, enumerate(urls)))
    http.clear()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.files, args.size, args.latency_ms / 1000)
        return

    import structlog
    import trustme

    # The project's log lines are rendered as in the worker, into nothing, to keep the output short.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(open(os.devnull, "w")))  # noqa: SIM115

    with tempfile.TemporaryDirectory(prefix="bench-downloads-") as tmp:
        root = Path(tmp)
        ca = trustme.CA()
        ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(str(root / "server.pem"))
        ca_path = str(root / "ca.pem")
        ca.cert_pem.write_to_path(ca_path)
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(root), "--files", str(args.files), "--size", str(args.size),
             "--latency-ms", str(args.latency_ms)], stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            urls = [f"https://localhost:{port}/rec/{i}" for i in range(args.files)]
            times: dict[str, list[float]] = {"project": [], "baseline": []}
            for run in range(args.runs):
                for name, way in (("project", project), ("baseline", baseline)):
                    out = root / f"{name}-{run}"
                    times[name].append(way(urls, ca_path, out))
                    files = sorted(out.rglob("*.audio"))
                    assert len(files) == args.files, f"{name}: {len(files)} files"
                    assert files[7].read_bytes() == body_of(7, args.size), f"{name}: wrong bytes"
        finally:
            server.terminate()
            server.wait()
    project_s, baseline_s = statistics.median(times["project"]), statistics.median(times["baseline"])
    print(f"downloads: {args.files} x {args.size} bytes over HTTPS, {args.latency_ms:g} ms per round trip, "
          f"median of {args.runs}")
    print(f"  project   {project_s:6.2f} s   (runs: {', '.join(f'{t:.2f}' for t in times['project'])})")
    print(f"  baseline  {baseline_s:6.2f} s   (urllib3, {BASELINE_THREADS} threads; runs: "
          f"{', '.join(f'{t:.2f}' for t in times['baseline'])})")
    print(f"  ratio     {project_s / baseline_s:6.2f}x")


if __name__ == "__main__":
    main()
