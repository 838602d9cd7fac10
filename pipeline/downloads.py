"""Fetch one recording to disk: https:// (hardened) or s3:// (through the worker's S3 client).

What a download guarantees, whatever happens:
- the bytes land in ``<dest>.part`` and are renamed onto ``dest`` only once complete and fsynced, and
  the ``.part`` is removed on every failure, so a file at ``dest`` is always a whole download;
- memory stays bounded: the body is copied in chunks of at most ``CHUNK_BYTES``;
- each https hop is checked by ``netguard`` and connected to by the checked IP (SNI and the Host
  header still carry the real name), and redirects are followed here, never by urllib3;
- errors come out as the project's own types: ``BadRecording`` when retrying cannot help (gone,
  refused, too large), ``DownloadError`` when it might (network, 5xx, throttling, deadline, disk),
  ``Stopped`` when the stop signal was set; their messages never hold a query string.
"""

from __future__ import annotations

import http.client
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import structlog
import urllib3
from botocore.exceptions import BotoCoreError, ClientError

from pipeline import netguard
from pipeline.files import fsync_dir
from pipeline.netguard import LOCAL_RUN_NETWORKS, IPNetwork, Resolver, describe_error
from worker.errors import BadRecording, ConfigError, DownloadError, Stopped, WorkerError
from worker.redact import redact_parsed_url
from worker.stop import StopSignal

log = structlog.get_logger(__name__)

CHUNK_BYTES = 1024 * 1024
_TRANSPORT_ERRORS = (BotoCoreError, urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# How often the watchdog looks at the stop signal while a read may be blocked.
WATCHDOG_POLL_S = 0.05


@dataclass(frozen=True)
class DownloadSettings:
    """How one recording may be fetched; build it with ``from_settings`` in the worker."""

    timeout_s: float = 60.0  # whole-file deadline, per file (DOWNLOAD_TIMEOUT_SECONDS)
    max_bytes: int = 2 * 1024**3  # DOWNLOAD_MAX_BYTES
    max_redirects: int = 3
    allowed_networks: tuple[IPNetwork, ...] = ()  # local runs and tests only
    ca_certs: str | None = None  # CA bundle path; None = the system's trust store

    @classmethod
    def from_settings(cls, settings) -> DownloadSettings:
        """The download part of the worker's ``Settings``."""
        return cls(
            timeout_s=settings.download_timeout_s,
            max_bytes=settings.download_max_bytes,
            allowed_networks=LOCAL_RUN_NETWORKS if settings.download_allow_private_hosts else (),
        )


def classify_status(status: int) -> type[WorkerError] | None:
    """The error a final (non-redirect) HTTP status means, or None when the body is the recording."""
    if 200 <= status < 300:
        return None
    if status in (408, 429) or 500 <= status < 600:
        return DownloadError
    return BadRecording  # 403/404/410 and every other answer that will not change on a retry


def s3_error_is_permanent(code: str, http_status: int | None) -> bool:
    """Whether an S3 GetObject error means the recording is gone or forbidden for good."""
    return code in {"NoSuchKey", "NoSuchBucket", "AccessDenied"} or http_status in (403, 404)


def fetch(
    url: str,
    dest: Path,
    *,
    settings: DownloadSettings,
    s3_client=None,
    stop: StopSignal | None = None,
    resolver: Resolver | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Download ``url`` to ``dest`` (replacing it atomically) and return the number of bytes written."""
    dest, shown = Path(dest), redact_parsed_url(url)
    if stop is not None:
        stop.raise_if_set()
    attempt = _Attempt(settings, stop, clock() + settings.timeout_s, clock)
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    log.info("download.started", url=shown)
    try:
        if scheme not in ("https", "s3"):
            raise BadRecording(f"recording URL {shown} is neither https:// nor s3://")
        with _part_file(dest) as write:
            if scheme == "s3":
                size = _fetch_s3(url, write, attempt, s3_client)
            else:
                size = _fetch_https(url, write, attempt, resolver)
    except Stopped as exc:
        log.info("download.stopped", url=shown, reason=exc.reason)
        raise
    except WorkerError as exc:
        log.warning("download.failed", url=shown, error_type=exc.error_type, error=str(exc))
        raise
    elapsed_s = settings.timeout_s - attempt.remaining_s()
    log.info("download.completed", url=shown, bytes=size, elapsed_s=round(elapsed_s, 3))
    return size


@dataclass(frozen=True)
class _Attempt:
    """One file's budget: its settings, its deadline and the stop signal it answers to."""

    settings: DownloadSettings
    stop: StopSignal | None
    deadline: float
    clock: Callable[[], float]

    def remaining_s(self) -> float:
        return self.deadline - self.clock()

    def check(self, url: str) -> None:
        if self.stop is not None:
            self.stop.raise_if_set()
        if self.remaining_s() <= 0:
            raise self.deadline_error(url)

    def deadline_error(self, url: str) -> DownloadError:
        return DownloadError(f"{redact_parsed_url(url)}: download deadline of {self.settings.timeout_s} s exceeded")


# --- https


def _fetch_https(url: str, write: Callable[[bytes], None], attempt: _Attempt, resolver: Resolver | None) -> int:
    settings, current = attempt.settings, url
    for hop in range(settings.max_redirects + 1):
        attempt.check(current)
        target = netguard.parse_https(current)
        addresses = netguard.checked_addresses(target.host, target.port, settings.allowed_networks, resolver)
        pool, resp = _open(target, addresses, attempt, current)
        try:
            if resp.status in REDIRECT_STATUSES:
                location = resp.headers.get("Location")
                if not location:
                    raise BadRecording(f"{target.redacted} answered HTTP {resp.status} without a Location")
                if hop == settings.max_redirects:
                    raise BadRecording(f"{target.redacted}: more than {settings.max_redirects} redirects, refused")
                following = urljoin(current, location.strip())
                log.info("download.redirect", status=resp.status, url=target.redacted, to=redact_parsed_url(following))
                current = following
                continue
            error = classify_status(resp.status)
            if error is not None:
                raise error(f"{target.redacted} answered HTTP {resp.status}")
            declared = _content_length(resp.headers.get("Content-Length"))
            return _copy(resp.read1, write, declared, attempt, _interrupter(resp), current)
        finally:
            # Close, never drain: a redirect or an error page may come with a huge body.
            resp.close()
            pool.close()
    raise AssertionError("unreachable: the last hop either returns or raises")


def _open(target: netguard.HttpsTarget, addresses: list[str], attempt: _Attempt, url: str):
    """Send the GET to the first checked address that accepts a connection."""
    headers = {"Host": target.host_header, "Accept-Encoding": "identity", "User-Agent": "voice-worker"}
    refused = "no address"
    for address in addresses:
        attempt.check(url)
        # The pool is keyed by the checked IP; the name only travels in SNI, the certificate check
        # and the Host header, so no second DNS answer can steer the connection.
        pool = urllib3.HTTPSConnectionPool(
            address, target.port, timeout=urllib3.Timeout(total=max(attempt.remaining_s(), 0.001)), retries=False,
            maxsize=1, cert_reqs="CERT_REQUIRED", ca_certs=attempt.settings.ca_certs,
            server_hostname=target.host, assert_hostname=target.host,
        )
        try:
            resp = pool.urlopen(
                "GET", target.request_target, headers=headers, redirect=False, retries=False,
                preload_content=False, decode_content=False, release_conn=False, assert_same_host=False,
            )
        except (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError) as exc:
            pool.close()
            refused = describe_error(exc, url)  # nothing was sent: the next address may answer
            continue
        except (ValueError, http.client.InvalidURL) as exc:
            pool.close()
            # http.client refuses control characters in the target, and its message quotes the target.
            raise BadRecording(f"{target.redacted}: unusable request ({type(exc).__name__})") from None
        except _TRANSPORT_ERRORS as exc:
            pool.close()
            raise DownloadError(f"{target.redacted}: {describe_error(exc, url)}") from None
        return pool, resp
    raise DownloadError(f"{target.redacted}: could not connect ({refused})")


# --- s3


def _fetch_s3(url: str, write: Callable[[bytes], None], attempt: _Attempt, s3_client) -> int:
    bucket, key = _parse_s3(url)
    if s3_client is None:
        raise ConfigError("an s3:// recording needs an S3 client, and none was given")
    try:
        reply = s3_client.get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        error = BadRecording if s3_error_is_permanent(code, status) else DownloadError
        raise error(f"{redact_parsed_url(url)}: S3 GetObject failed ({code or status})") from None
    except BotoCoreError as exc:
        raise DownloadError(f"{redact_parsed_url(url)}: S3 GetObject failed ({type(exc).__name__})") from None
    body = reply["Body"]
    try:
        # botocore keeps the urllib3 response it streams from in ``_raw_stream``; without it (moto)
        # a stalled read is bounded by the client's own read timeout instead.
        interrupt = _interrupter(getattr(body, "_raw_stream", None))
        return _copy(body.read, write, reply.get("ContentLength"), attempt, interrupt, url)
    finally:
        body.close()


def _parse_s3(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    bucket, key = parts.netloc, parts.path.lstrip("/")
    if not bucket or not key or parts.query or parts.fragment or "@" in bucket:
        raise BadRecording(f"recording URL {redact_parsed_url(url)} is not s3://bucket/key")
    return bucket, key


# --- shared pieces


def _copy(read, write, declared: int | None, attempt: _Attempt, interrupt, url: str) -> int:
    """Copy a body to ``write`` in chunks of at most CHUNK_BYTES, enforcing the cap, deadline and stop."""
    max_bytes = attempt.settings.max_bytes
    if declared is not None and declared > max_bytes:
        raise BadRecording(f"{redact_parsed_url(url)} is {declared} bytes, over the limit of {max_bytes}")
    total = 0
    with _watchdog(attempt, interrupt) as fired:
        try:
            while True:
                attempt.check(url)
                chunk = read(CHUNK_BYTES)
                if not chunk:
                    break
                total += len(chunk)
                if total > max_bytes:
                    raise BadRecording(f"{redact_parsed_url(url)} is over the limit of {max_bytes} bytes")
                write(chunk)
        except _TRANSPORT_ERRORS as exc:
            _raise_if_cut(fired, attempt, url)
            raise DownloadError(f"{redact_parsed_url(url)}: body interrupted ({describe_error(exc, url)})") from None
        if fired:  # a cut read can look like the clean end of a body with no declared length
            _raise_if_cut(fired, attempt, url)
    if declared is not None and total != declared:
        raise DownloadError(f"{redact_parsed_url(url)}: body ended after {total} of {declared} bytes")
    return total


def _raise_if_cut(fired: list[str], attempt: _Attempt, url: str) -> None:
    """Name the real cause when a read failed or ended because of a stop or the deadline."""
    if "stop" in fired and attempt.stop is not None:
        attempt.stop.raise_if_set()
    # The socket's own timeout is the time that was left, so it may beat the watchdog to the deadline.
    if fired or attempt.remaining_s() <= 0:
        raise attempt.deadline_error(url)


def _content_length(value: str | None) -> int | None:
    # A missing or malformed length counts as unknown: the running count still enforces the cap.
    return int(value) if value is not None and value.strip().isdigit() else None


def _interrupter(resp) -> Callable[[], None] | None:
    """urllib3's way to end a read blocked in another thread, when ``resp`` offers it."""
    if resp is None or not hasattr(resp, "shutdown") or getattr(resp, "connection", None) is None:
        return None

    def interrupt() -> None:
        try:
            resp.shutdown()
        except (OSError, ValueError, RuntimeError):
            pass  # already closed or released: the read has ended anyway

    return interrupt


@contextmanager
def _watchdog(attempt: _Attempt, interrupt: Callable[[], None] | None) -> Iterator[list[str]]:
    """Interrupt a body's read when the deadline passes or a stop is requested.

    The copy loop checks both between chunks, but a read can block for as long as the server stays
    silent; shutting the socket down from this thread makes that read return at once. Yields a list
    that receives "stop" or "deadline" once the read was interrupted.
    """
    done, fired = threading.Event(), []

    def watch() -> None:
        while not done.wait(WATCHDOG_POLL_S):
            stopping = attempt.stop is not None and attempt.stop.is_set()
            if stopping or attempt.remaining_s() <= 0:
                fired.append("stop" if stopping else "deadline")
                interrupt()
                return

    thread = threading.Thread(target=watch, name="download-watchdog", daemon=True)
    if interrupt is not None:
        thread.start()
    try:
        yield fired
    finally:
        done.set()
        if thread.is_alive():
            thread.join()


@contextmanager
def _part_file(dest: Path) -> Iterator[Callable[[bytes], None]]:
    """Yield a writer into ``dest.part``; rename it onto ``dest`` on success, remove it on any failure."""
    part = dest.with_name(dest.name + ".part")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted at the .part name must not redirect the write.
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise DownloadError(f"cannot write {part.name}: {_os_reason(exc)}") from None

    def write(data: bytes) -> None:
        try:
            file.write(data)
        except OSError as exc:
            raise DownloadError(f"writing {part.name} failed: {_os_reason(exc)}") from None

    try:
        with os.fdopen(fd, "wb") as file:
            yield write
            file.flush()
            os.fsync(file.fileno())
        os.replace(part, dest)
        # The rename is durable only once the directory entry is on disk.
        fsync_dir(dest.parent, strict=True)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise DownloadError(f"finishing {dest.name} failed: {_os_reason(exc)}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _os_reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__
