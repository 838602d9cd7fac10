"""Fetch one recording to disk: https:// (hardened) or s3:// (through the worker's S3 client).

The URL comes parsed (``pipeline.recording_url``, in ``parse_job``), and each redirect hop is parsed
by the same function: what the input policy checked is what is fetched.

What a download guarantees, whatever happens:
- the bytes land in ``<dest>.part`` and are renamed onto ``dest`` only once complete and fsynced, and
  the ``.part`` is removed on every failure, so a file at ``dest`` is always a whole download;
- memory stays bounded: the body is copied in chunks of at most ``CHUNK_BYTES``;
- one deadline (``timeout_s``) covers the whole request, and it and the stop signal cut every phase:
  DNS, connect, TLS handshake, sending, waiting for the status line and headers, the body, and for
  s3 botocore's retries (``pipeline.download_guard``);
- a job-wide byte budget (``remaining_job_bytes``) caps a file further than ``max_bytes`` does;
- each https hop is checked by ``netguard`` and connected to by the checked IP (SNI and the Host
  header still carry the real name), and redirects are followed here, never by urllib3;
- a connection is kept alive only for the same checked address, port and name (``Connections``, one
  per ``Downloader``, so per job): a later file or hop reuses it only when its own check gave that
  address; a connection that was cut, failed, or carried a body not read to its end is closed; a
  host is resolved and checked once per job;
- errors come out as the project's own types: ``BadRecording`` when retrying cannot help (gone,
  refused, too large), ``DownloadError`` when it might (network, 5xx, throttling, deadline, disk),
  ``Stopped`` when the stop signal was set; their messages never hold a query string.
"""

from __future__ import annotations

import functools
import http.client
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urljoin

import structlog
import urllib3
from botocore.exceptions import BotoCoreError, ClientError

from pipeline import netguard
from pipeline.download_guard import Cut, CutReason, Guard, guard_of_this_thread
from pipeline.errors import BadRecording, DownloadError
from pipeline.netguard import IPNetwork, Resolver, describe_error
from pipeline.part_file import part_file
from pipeline.recording_url import HTTPS, S3, RecordingUrl, parse_recording_url
from worker.core.errors import ConfigError, Stopped, WorkerError
from worker.core.faults import NEVER, CrashPoints
from worker.core.redact import redact_url
from worker.core.stop import StopSignal

log = structlog.get_logger(__name__)

CHUNK_BYTES = 1024 * 1024
_TRANSPORT_ERRORS = (BotoCoreError, urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# Socket timeouts are only a backstop, set a little past the deadline: ending a download at its
# deadline is the guard's job, whose error names the deadline whatever phase was cut.
SOCKET_TIMEOUT_SLACK_S = 1.0
_S3_SEND_EVENT = "before-send.s3.GetObject"
_S3_HOOK_ID = "voice-worker.download-guard"


@dataclass(frozen=True)
class DownloadSettings:
    """How one recording may be fetched; the worker's comes from ``Settings.download_settings``."""

    timeout_s: float = 60.0  # whole-file deadline, per file (DOWNLOAD_TIMEOUT_SECONDS)
    max_bytes: int = 2 * 1024**3  # DOWNLOAD_MAX_BYTES
    max_redirects: int = 3
    allowed_networks: tuple[IPNetwork, ...] = ()  # local runs and tests only
    ca_certs: str | None = None  # CA bundle path; None = the system's trust store
    concurrency: int = 8  # a job's recordings fetched at once (DOWNLOAD_CONCURRENCY)


class Reservation(Protocol):
    """A file's share of the job's byte budget, taken once its length is known (``pipeline.download_pool``)."""

    def take(self, declared: int | None, check: Callable[[], None]) -> int | None:
        """The most bytes the file may have, given its declared length (None: unknown); may wait, calling
        ``check`` (which raises when the download is cut) while it does. None: no job-wide budget."""
        ...

    def off_the_wire(self) -> None:
        """The body is all written and its connection handed back: syncing and renaming the file need
        no network slot, so the step may start its next file meanwhile."""
        ...


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


class Connections:
    """Kept-alive HTTPS connections, one pool per (checked address, port, TLS name).

    Keyed by the address that was checked (with the name, which TLS verified), never by the name
    alone: a hop reuses a connection only when its own resolution and check gave that very address,
    so no DNS answer can steer a request onto a connection made for another address. Safe to share
    between threads.
    """

    def __init__(self, settings: DownloadSettings):
        self._settings = settings
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, int, str], urllib3.HTTPSConnectionPool] = {}
        self._checked: dict[tuple[str, int], list[str]] = {}

    def checked_addresses(self, host: str, port: int, check: Callable[[], list[str]]) -> list[str]:
        """``host``'s addresses as ``check`` resolved and checked them, once per job and host.

        Caching the answer weakens nothing: every connection still goes to an address that passed
        the check, whatever DNS says later. A refusal or a failure is not kept: it is raised again.
        """
        key = (host, port)
        with self._lock:
            known = self._checked.get(key)
        if known is None:
            known = check()
            with self._lock:
                self._checked.setdefault(key, known)
        return list(known)

    def pool(self, address: str, target: RecordingUrl) -> urllib3.HTTPSConnectionPool:
        key = (address, target.connect_port, target.host)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                # block=False: a download never waits for a connection; past maxsize one is made
                # and closed after use. The name only travels in SNI, the certificate check and the
                # Host header.
                pool = self._pools[key] = urllib3.HTTPSConnectionPool(
                    address, target.connect_port, maxsize=max(self._settings.concurrency, 1), block=False,
                    retries=False, cert_reqs="CERT_REQUIRED", ca_certs=self._settings.ca_certs,
                    server_hostname=target.host, assert_hostname=target.host,
                )
            return pool

    def close(self) -> None:
        """Close every kept-alive connection (the job's downloads are done)."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


@dataclass(frozen=True)
class Downloader:
    """``fetch`` with one job's fixed arguments bound: the pipeline's ``Fetcher`` (``pipeline.run``).

    ``pipeline.run.PipelineTrainer`` makes one per job, with that job's stop signal; the job's files
    share its kept-alive connections, which ``close`` ends once the download step is over. ``stop``
    given to a call replaces the bound one for that file (the step's per-file signal).
    """

    settings: DownloadSettings
    s3_client: Any = None
    stop: StopSignal | None = None
    crash_points: CrashPoints = NEVER
    connections: Connections | None = field(default=None, compare=False)
    resolver: Resolver | None = None  # tests only; None: the system resolver
    sync_dir: bool = True  # False: the caller syncs the directory once the files are in (the step)

    def __post_init__(self) -> None:
        if self.connections is None:
            object.__setattr__(self, "connections", Connections(self.settings))

    def __call__(self, url: RecordingUrl | str, dest: Path, *, remaining_job_bytes: int | None = None,
                 stop: StopSignal | None = None, reservation: Reservation | None = None) -> int:
        self.crash_points.reached("during_download")
        return fetch(url, dest, settings=self.settings, s3_client=self.s3_client,
                     stop=self.stop if stop is None else stop, remaining_job_bytes=remaining_job_bytes,
                     connections=self.connections, resolver=self.resolver, reservation=reservation,
                     sync_dir=self.sync_dir)

    def close(self) -> None:
        assert self.connections is not None
        self.connections.close()


def fetch(
    url: RecordingUrl | str,
    dest: Path,
    *,
    settings: DownloadSettings,
    s3_client=None,
    stop: StopSignal | None = None,
    resolver: Resolver | None = None,
    clock: Callable[[], float] = time.monotonic,
    remaining_job_bytes: int | None = None,
    connections: Connections | None = None,
    reservation: Reservation | None = None,
    sync_dir: bool = True,
) -> int:
    """Download ``url`` to ``dest`` (replacing it atomically) and return the number of bytes written.

    ``url`` is the value ``parse_job`` made; a str (tools, tests) is parsed here by the same function,
    and one that does not parse is a BadRecording.
    ``remaining_job_bytes``: what the job may still download (MAX_JOB_DOWNLOAD_BYTES less what its
    other recordings took); going past it is a permanent BadRecording, like ``max_bytes``.
    ``connections``: kept-alive connections to reuse and leave open; None: this call's own, closed
    when it returns. ``reservation``: the job's budget, asked for this file's share once its length
    is known (instead of a fixed ``remaining_job_bytes``). ``sync_dir=False``: the rename onto
    ``dest`` is left for the caller to make durable (``pipeline.part_file``).
    """
    dest = Path(dest)
    shown = url.redacted if isinstance(url, RecordingUrl) else redact_url(url)
    if stop is not None:
        stop.raise_if_set()
    attempt = _Attempt(settings, stop, clock() + settings.timeout_s, clock)
    cap = _ByteLimit.of(settings.max_bytes, remaining_job_bytes, reservation)
    log.info("download.started", url=shown)
    try:
        target = url if isinstance(url, RecordingUrl) else _parsed(url)
        if cap.limit <= 0:
            raise cap.refusal(target)
        try:
            with Guard(attempt.remaining_s, stop) as guard, part_file(dest, sync_dir=sync_dir) as write:
                if target.scheme == S3:
                    size = _fetch_s3(target, write, guard, cap, s3_client)
                elif connections is None:
                    own = Connections(settings)
                    try:
                        size = _fetch_https(target, write, guard, cap, settings, resolver, own)
                    finally:
                        own.close()
                else:
                    size = _fetch_https(target, write, guard, cap, settings, resolver, connections)
                if reservation is not None:
                    # Before part_file's fsync and rename, which the file still waits for: it is
                    # renamed only once its data is on disk, whoever uses its network slot meanwhile.
                    reservation.off_the_wire()
        except Cut as cut:
            raise attempt.cut_error(target, cut.reason) from None
    except Stopped as exc:
        log.info("download.stopped", url=shown, reason=exc.reason)
        raise
    except WorkerError as exc:
        log.warning("download.failed", url=shown, error_type=exc.error_type, error=str(exc))
        raise
    elapsed_s = settings.timeout_s - attempt.remaining_s()
    log.info("download.completed", url=shown, bytes=size, elapsed_s=round(elapsed_s, 3))
    return size


def _parsed(text: str) -> RecordingUrl:
    try:
        return parse_recording_url(text)
    except BadRecording as exc:
        raise BadRecording(f"recording URL {exc}") from None


@dataclass(frozen=True)
class _Attempt:
    """One file's budget: its settings, its deadline and the stop signal it answers to."""

    settings: DownloadSettings
    stop: StopSignal | None
    deadline: float
    clock: Callable[[], float]

    def remaining_s(self) -> float:
        return self.deadline - self.clock()

    def cut_error(self, url: RecordingUrl, reason: CutReason) -> WorkerError:
        """The error a guard firing for ``reason`` means: Stopped (with the stop's reason) or the deadline."""
        if reason == CutReason.STOP and self.stop is not None:
            self.stop.raise_if_set()
        return DownloadError(f"{url.redacted}: download deadline of {self.settings.timeout_s} s exceeded")


@dataclass(frozen=True)
class _ByteLimit:
    """The most bytes this file may have: its own limit, or less when the job's budget is nearly spent."""

    limit: int
    job_wide: bool
    reservation: Reservation | None = None  # the job's share still to be taken, once the length is known

    @classmethod
    def of(cls, max_bytes: int, remaining_job_bytes: int | None, reservation: Reservation | None = None) -> _ByteLimit:
        if remaining_job_bytes is not None and remaining_job_bytes < max_bytes:
            return cls(max(remaining_job_bytes, 0), job_wide=True, reservation=reservation)
        return cls(max_bytes, job_wide=False, reservation=reservation)

    def sized(self, declared: int | None, guard: Guard) -> _ByteLimit:
        """This cap once the body's length is known: lowered to the job's share when one is taken."""
        if self.reservation is None:
            return self
        share = self.reservation.take(declared, guard.check)
        return self if share is None else _ByteLimit.of(self.limit, share)

    def refusal(self, url: RecordingUrl, declared: int | None = None) -> BadRecording:
        shown = url.redacted
        if self.job_wide:
            return BadRecording(f"{shown}: the job's total download limit (MAX_JOB_DOWNLOAD_BYTES) was hit, "
                                f"{self.limit} bytes were left for this recording")
        if declared is not None:
            return BadRecording(f"{shown} is {declared} bytes, over the limit of {self.limit}")
        return BadRecording(f"{shown} is over the limit of {self.limit} bytes")


# --- https


def _fetch_https(url: RecordingUrl, write: Callable[[bytes], None], guard: Guard, cap: _ByteLimit,
                 settings: DownloadSettings, resolver: Resolver | None, connections: Connections) -> int:
    current = url
    with guard.own_sockets():
        for hop in range(settings.max_redirects + 1):
            guard.check()
            addresses = connections.checked_addresses(current.host, current.connect_port, functools.partial(
                guard.call, functools.partial(netguard.checked_addresses, current.host, current.connect_port,
                                              settings.allowed_networks, resolver)))
            resp = _open(current, addresses, guard, connections)
            whole = False
            try:
                # A cut can end the headers early, and what arrived before it is no answer.
                guard.check()
                if resp.status in REDIRECT_STATUSES:
                    location = resp.headers.get("Location")
                    if not location:
                        raise BadRecording(f"{current.redacted} answered HTTP {resp.status} without a Location")
                    if hop == settings.max_redirects:
                        raise BadRecording(f"{current.redacted}: more than {settings.max_redirects} redirects, refused")
                    following = _redirect_target(current, location)
                    log.info("download.redirect", status=resp.status, url=current.redacted, to=following.redacted)
                    current = following
                    continue
                error = classify_status(resp.status)
                if error is not None:
                    raise error(f"{current.redacted} answered HTTP {resp.status}")
                declared = _content_length(resp.headers.get("Content-Length"))
                # read, not read1: one call fills a whole chunk in C instead of a pass through
                # urllib3 and our loop per 16 KiB TLS record (a third less client CPU); a cut still
                # ends it at once, since the guard shuts the socket down under it.
                size = _copy(resp.read, write, declared, guard, cap, current)
                whole = True
                return size
            finally:
                # Forgotten by the guard first: once back in the pool, the connection is another
                # download's, which a late firing of this guard must not cut.
                guard.release()
                # Kept only when whole and uncut (an answer with "Connection: close" has already
                # let go of its socket, and the pool will open a new one). Otherwise close, never
                # drain: a redirect or an error page may come with a huge body.
                if not whole or guard.fired is not None:
                    resp.close()
                resp.release_conn()
    raise AssertionError("unreachable: the last hop either returns or raises")


def _redirect_target(current: RecordingUrl, location: str) -> RecordingUrl:
    """The next hop: ``location`` read against ``current``, parsed like the recording was, https only."""
    try:
        target = parse_recording_url(urljoin(current.text, location.strip()))
    except ValueError:  # urljoin's own refusal ("Invalid IPv6 URL"); BadRecording is not one
        raise BadRecording(f"{current.redacted}: redirect refused, the target does not parse") from None
    except BadRecording as exc:
        raise BadRecording(f"{current.redacted}: redirect refused, the target is not https://host/path "
                           f"({exc})") from None
    if target.scheme != HTTPS:
        raise BadRecording(f"{current.redacted}: redirect refused, the target {target.redacted} is not https")
    return target


def _open(target: RecordingUrl, addresses: list[str], guard: Guard, connections: Connections):
    """Send the GET to the first checked address that accepts a connection."""
    headers = {"Host": target.host_header, "Accept-Encoding": "identity", "User-Agent": "voice-worker"}
    refused = "no address"
    for address in addresses:
        guard.check()
        # The pool is keyed by the checked IP, so no second DNS answer can steer the connection.
        pool = connections.pool(address, target)
        try:
            resp = pool.urlopen(
                "GET", target.request_target, headers=headers, redirect=False, retries=False,
                timeout=urllib3.Timeout(total=guard.remaining_s() + SOCKET_TIMEOUT_SLACK_S),
                preload_content=False, decode_content=False, release_conn=False, assert_same_host=False,
            )
        except (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError) as exc:
            guard.check()
            refused = describe_error(exc, target)  # nothing was sent: the next address may answer
            continue
        except (ValueError, http.client.InvalidURL) as exc:
            # http.client refuses control characters in the target, and its message quotes the target.
            raise BadRecording(f"{target.redacted}: unusable request ({type(exc).__name__})") from None
        except _TRANSPORT_ERRORS as exc:
            guard.check()
            raise DownloadError(f"{target.redacted}: {describe_error(exc, target)}") from None
        return resp
    raise DownloadError(f"{target.redacted}: could not connect ({refused})")


# --- s3


def _fetch_s3(url: RecordingUrl, write: Callable[[bytes], None], guard: Guard, cap: _ByteLimit, s3_client) -> int:
    bucket, key = url.bucket, url.key
    if s3_client is None:
        raise ConfigError("an s3:// recording needs an S3 client, and none was given")
    # Idempotent (by unique_id), and inert for every call made outside a guarded thread.
    s3_client.meta.events.register(_S3_SEND_EVENT, _guard_s3_send, unique_id=_S3_HOOK_ID)
    try:
        # In a helper thread, so that botocore's own retries and backoff sleeps cannot outlast a cut.
        reply = guard.call(lambda: s3_client.get_object(Bucket=bucket, Key=key),
                           discard=lambda late: late["Body"].close())
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        error = BadRecording if s3_error_is_permanent(code, status) else DownloadError
        raise error(f"{url.redacted}: S3 GetObject failed ({code or status})") from None
    except _TRANSPORT_ERRORS as exc:
        guard.check()
        raise DownloadError(f"{url.redacted}: S3 GetObject failed ({type(exc).__name__})") from None
    body = reply["Body"]
    try:
        # The body streams over the socket the helper thread sent on, which the guard already holds.
        return _copy(body.read, write, reply.get("ContentLength"), guard, cap, url)
    finally:
        body.close()


def _guard_s3_send(request, **_kwargs) -> None:
    """botocore calls this before each attempt (the first and every retry) of a GetObject."""
    guard = guard_of_this_thread()
    if guard is None:
        return None
    # Cut is no error botocore knows, so it is raised as is instead of being retried.
    guard.check()
    # A backstop should a socket ever escape the guard: no single read may outlast the deadline.
    context = getattr(request, "context", None)
    if context is not None:
        context["read_timeout"] = max(guard.remaining_s(), 0.001) + SOCKET_TIMEOUT_SLACK_S
    return None


# --- shared pieces


def _copy(read, write, declared: int | None, guard: Guard, cap: _ByteLimit, url: RecordingUrl) -> int:
    """Copy a body to ``write`` in chunks of at most CHUNK_BYTES, enforcing the cap, deadline and stop."""
    if declared is not None and declared > cap.limit:
        raise cap.refusal(url, declared)
    cap = cap.sized(declared, guard)
    if declared is not None and declared > cap.limit:
        raise cap.refusal(url, declared)
    total = 0
    try:
        while True:
            guard.check()
            chunk = read(CHUNK_BYTES)
            if not chunk:
                break
            total += len(chunk)
            if total > cap.limit:
                raise cap.refusal(url)
            write(chunk)
    except _TRANSPORT_ERRORS as exc:
        guard.check()
        raise DownloadError(f"{url.redacted}: body interrupted ({describe_error(exc, url)})") from None
    # A cut read can look like the clean end of a body with no declared length.
    guard.check()
    if declared is not None and total != declared:
        raise DownloadError(f"{url.redacted}: body ended after {total} of {declared} bytes")
    return total


def _content_length(value: str | None) -> int | None:
    # A missing or malformed length counts as unknown: the running count still enforces the cap.
    return int(value) if value is not None and value.strip().isdigit() else None
