"""EC2 spot interruption notices: the one place the instance metadata service (IMDS) is called.

EC2 gives a spot instance two minutes' notice before it reclaims it, readable on the instance at
``/latest/meta-data/spot/instance-action`` (404 until a notice exists). Nothing else tells a worker
under systemd: the host is simply gone two minutes later. ``SpotWatch`` reads the notice every
``SPOT_INTERRUPTION_CHECK_SECONDS`` and, at the first one, starts the same shutdown as SIGTERM: no
more receives, the running stage gets its checkpoint signal at once, and the message is released
when the grace runs out (set ``SHUTDOWN_GRACE_SECONDS`` below the two minutes). On ECS with
``ECS_ENABLE_SPOT_INSTANCE_DRAINING`` the agent sends SIGTERM itself; the watch only makes it earlier.

IMDSv2 only: a session token from ``PUT /latest/api/token``, sent with each read; an instance that
requires IMDSv2 (the safe default) refuses plain reads. http.client rather than urllib: urllib would
honour ``HTTP_PROXY`` and send the request to a proxy, and the metadata address is link-local.

A metadata service that does not answer (not on EC2, a hop limit of 1 inside a container, a
timeout) is one warning and the watch asks again next time; it never stops the worker.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog

from worker.core.redact import strip_control

log = structlog.get_logger(__name__)

TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_S = 21600  # the longest IMDS grants; renewed a minute before it ends
TIMEOUT_S = 2.0
MAX_ANSWER_BYTES = 64 * 1024
# What a token may hold to go back in a header: visible ASCII (http.client refuses a line break, and
# anything outside Latin-1, with a ValueError of its own).
_TOKEN = re.compile(r"[!-~]{1,1024}")
_MAX_SHOWN_CHARS = 100


@dataclass(frozen=True)
class Endpoint:
    """Where IMDS listens: parsed once, from ``IMDS_ENDPOINT``, when the settings load."""

    host: str
    port: int = 80


def parse_endpoint(url: str) -> Endpoint:
    """``http://host[:port]`` as an ``Endpoint``; ValueError with the rule otherwise."""
    rule = "must be http://host[:port], the port from 1 to 65535 (the instance metadata service)"
    if not re.fullmatch(r"[!-~]+", url):  # urlsplit would silently drop a tab or a line break
        raise ValueError(rule)
    try:
        parts = urlsplit(url)
        port = parts.port if parts.port is not None else 80
    except ValueError:  # an out-of-range or non-numeric port, a broken [IPv6] literal
        raise ValueError(rule) from None
    if (parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query
            or parts.fragment or parts.username is not None or not 1 <= port <= 65535):
        raise ValueError(rule)
    return Endpoint(parts.hostname, port)


DEFAULT_ENDPOINT = parse_endpoint("http://169.254.169.254")


class MetadataUnavailable(Exception):
    """IMDS did not answer usefully; internal to this adapter (the watch logs it and asks again)."""


@dataclass(frozen=True)
class SpotNotice:
    action: str  # "terminate", "stop" or "hibernate"
    time: str  # when EC2 acts, as IMDS gives it (ISO 8601, UTC)


def parse_notice(body: bytes) -> SpotNotice:
    """The notice in IMDS's JSON; any other body, however garbled, is ``MetadataUnavailable``."""
    try:
        data = json.loads(body)
    # RecursionError: a body of nested brackets, under the read cap, is deeper than the decoder goes.
    except (ValueError, RecursionError):
        raise MetadataUnavailable("the spot notice is not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("action"), str):
        raise MetadataUnavailable("the spot notice has no action")
    # Only text is shown: the str() of a deeply nested value could itself hit the recursion limit.
    when = data.get("time")
    return SpotNotice(action=_shown(data["action"]), time=_shown(when) if isinstance(when, str) else "")


def _shown(text: str) -> str:
    return strip_control(text, keep_lines=False)[:_MAX_SHOWN_CHARS]


class InstanceMetadata:
    """IMDSv2 reads with a cached session token."""

    def __init__(self, endpoint: Endpoint = DEFAULT_ENDPOINT, timeout_s: float = TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self._host, self._port = endpoint.host, endpoint.port
        self._timeout_s = timeout_s
        self._clock = clock
        self._token: str | None = None
        self._token_until = 0.0

    def spot_notice(self) -> SpotNotice | None:
        """The pending interruption, or None when there is none; ``MetadataUnavailable`` otherwise."""
        status, body = self._get(NOTICE_PATH)
        if status == 401:  # the token expired early (IMDS restarted): one fresh try
            self._token = None
            status, body = self._get(NOTICE_PATH)
        if status == 404:
            return None
        if status != 200:
            raise MetadataUnavailable(f"HTTP {status} for the spot notice")
        return parse_notice(body)

    def _get(self, path: str) -> tuple[int, bytes]:
        return self._request("GET", path, {"X-aws-ec2-metadata-token": self._session_token()})

    def _session_token(self) -> str:
        if self._token is None or self._clock() >= self._token_until:
            status, body = self._request("PUT", TOKEN_PATH,
                                         {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            if status != 200 or not body:
                raise MetadataUnavailable(f"HTTP {status} for an IMDSv2 token")
            token = body.decode("ascii", errors="replace").strip()
            if not _TOKEN.fullmatch(token):
                raise MetadataUnavailable("the IMDSv2 token is not printable ASCII")
            self._token = token
            self._token_until = self._clock() + TOKEN_TTL_S - 60
        return self._token

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            connection.request(method, path, headers=headers)
            response = connection.getresponse()
            return response.status, response.read(MAX_ANSWER_BYTES)
        # ValueError: a header http.client will not send, a host it cannot encode.
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise MetadataUnavailable(f"{type(exc).__name__}: {_shown(str(exc))}") from None
        finally:
            connection.close()


class SpotWatch:
    """A thread that calls ``on_notice`` once, at the first spot interruption notice."""

    def __init__(self, metadata: InstanceMetadata, interval_s: float, on_notice: Callable[[], None]):
        self._metadata = metadata
        self._interval_s = interval_s
        self._on_notice = on_notice
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="spot-watch", daemon=True)
        self._warned = False

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join()

    def check(self) -> bool:
        """One look at the notice; True once it was seen and the shutdown started."""
        try:
            notice = self._metadata.spot_notice()
        except MetadataUnavailable as exc:
            # Once at warning level: a worker off EC2 with the watch on would otherwise fill the log.
            (log.debug if self._warned else log.warning)("spot_watch.metadata_unavailable", error=str(exc))
            self._warned = True
            return False
        if notice is None:
            return False
        log.warning("worker.spot_interruption", action=notice.action, at=notice.time,
                    note="EC2 reclaims this instance: shutting down as for SIGTERM")
        self._on_notice()
        return True

    def _watch(self) -> None:
        while not self._closed.wait(self._interval_s):
            try:
                if self.check():
                    return
            except Exception as exc:  # noqa: BLE001 - a watch that died would miss the notice it is for
                # The next look tries again, the shutdown too if it was the one that failed: a notice
                # request may come twice (Shutdown.request).
                # The type alone: the traceback carries the text, and a str() that fails must not fail here.
                log.exception("spot_watch.check_failed", error=type(exc).__name__)
