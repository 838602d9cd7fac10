"""A recording URL, parsed once: ``parse_recording_url`` and the frozen ``RecordingUrl`` it returns.

``parse_job`` parses each ``recordingUrl`` here, the input policy scopes the parsed value, and the
downloader fetches it (and parses each redirect hop with the same function): one reading of a URL,
so what was checked is what is fetched. It lives in the pipeline, the lower of the two layers that
use it: the job (``worker.voice``) may import the pipeline, the pipeline only the core, and the core
is the generic queue worker, which knows nothing of recordings.

The grammar, and the words of each refusal (they reach the sender in an ``InvalidMessage``):

- ``https://host[:port]/path[?query][#fragment]``: a host name of letters, digits and hyphens, or an
  IP address (IPv6 bracketed), an optional port 1-65535, and a path that is not just ``/``;
- ``s3://bucket/key``: a valid bucket name and a non-empty key, with no ``?`` or ``#`` (keys may hold
  them, but URL parsers would cut them off);
- anywhere: no whitespace or control characters, no ``user:password@``, and no backslashes. Parsers
  disagree on a backslash: ``urllib.parse`` reads ``https://a\\@b/`` as host ``b``, a WHATWG parser
  (browsers, many proxies and SDKs) as host ``a`` with the backslash a path separator. The message's
  hand-written parser refused them, the strictest of the four readings there were (it, the input
  policy's split, and the downloader's ``urlsplit`` for https and for s3); that rule is the one rule.

Presigned URLs carry credentials in their query string, so only ``redacted`` (scheme, host, port
and path) is ever shown: ``str()`` and ``repr()`` give that form, never ``text`` or ``query``.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from dataclasses import dataclass, field

from pipeline.errors import BadRecording
from worker.core.redact import redact_url, show

HTTPS = "https"
S3 = "s3"
HTTPS_PORT = 443

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_ASCII_SPACE_OR_CONTROL = re.compile(r"[\x00-\x20\x7f]")
S3_QUERY = "must not contain '?' or '#': an s3:// URL has no query or fragment"


@dataclass(frozen=True, slots=True)
class RecordingUrl:
    """One parsed recording URL. Build it with ``parse_recording_url``, which checks every rule."""

    text: str = field(repr=False)  # as the sender wrote it (a redirect is resolved against it); never shown
    scheme: str  # "https" or "s3", lower-cased ("S3://" is read like "s3://")
    host: str  # https: lower-cased name or IP address, without brackets; s3: the bucket
    port: int | None  # https: as written, None when absent; s3: None
    path: str  # https: the path; s3: "/" and the key, as written (S3 keys are literal)
    query: str = field(default="", repr=False)  # https only, without the '?'
    fragment: str = field(default="", repr=False)  # never sent; kept so that error text can lose it

    @property
    def bucket(self) -> str:
        return self._s3_part(self.host)

    @property
    def key(self) -> str:
        return self._s3_part(self.path[1:])

    @property
    def redacted(self) -> str:
        """``scheme://host[:port]/path``: the only form of a recording URL that is ever shown."""
        port = "" if self.port is None else f":{self.port}"
        return f"{self.scheme}://{self._bracketed_host}{port}{self.path}"

    @property
    def host_header(self) -> str:
        """The Host header: the name as TLS checks it, with the port unless it is 443."""
        port = "" if self.connect_port == HTTPS_PORT else f":{self.port}"
        return self._bracketed_host + port

    @property
    def connect_port(self) -> int:
        return HTTPS_PORT if self.port is None else self.port

    @property
    def request_target(self) -> str:
        """The path and query sent in the request line: on the wire, never in a log."""
        return self.path + (f"?{self.query}" if self.query else "")

    @property
    def secrets(self) -> tuple[str, ...]:
        """What a third party's error text may quote and must lose: the query and the fragment."""
        return tuple(part for part in (self.query, self.fragment) if part)

    @property
    def _bracketed_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    def __str__(self) -> str:
        return self.redacted

    def _s3_part(self, part: str) -> str:
        if self.scheme != S3:
            raise ValueError(f"{self.redacted} is not an s3:// URL")
        return part


def parse_recording_url(text: str) -> RecordingUrl:
    """The recording ``text`` names, or ``BadRecording`` saying why it names none.

    The message is the rule broken ("must not contain backslashes"), ready to follow a field name or
    "recording URL"; it never echoes a query, fragment or userinfo.
    """
    if _has_space_or_control(text):
        raise BadRecording("must not contain whitespace or control characters")
    if "\\" in text:
        raise BadRecording("must not contain backslashes")  # see the module docstring
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in (HTTPS, S3):
        raise BadRecording(f"must be https://host/path or s3://bucket/key, got {show(redact_url(text))}")
    # RFC 3986: the authority ends at the first '/', '?' or '#'.
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority, after = rest[:end], rest[end:]
    if "@" in authority:
        raise BadRecording("must not contain user credentials (user:password@)")
    if scheme.lower() == S3:
        return _s3_url(text, authority, after)
    return _https_url(text, authority, after)


def _https_url(text: str, authority: str, after: str) -> RecordingUrl:
    if not authority:
        raise BadRecording("has no host")
    host, port = _split_port(authority)
    if port is not None and not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise BadRecording(f"has an invalid port in {show(redact_url('https://' + authority))}")
    if not _valid_host(host):
        raise BadRecording(f"has an invalid host {show(host)}")
    before_fragment, _, fragment = after.partition("#")
    path, _, query = before_fragment.partition("?")
    if path in ("", "/"):
        raise BadRecording(f"has no path to a recording: {show(redact_url('https://' + authority + '/'))}")
    return RecordingUrl(text=text, scheme=HTTPS, host=host.lower().removeprefix("[").removesuffix("]"),
                        port=None if port is None else int(port), path=path, query=query, fragment=fragment)


def _s3_url(text: str, bucket: str, after: str) -> RecordingUrl:
    if not _valid_bucket(bucket):
        raise BadRecording(f"has an invalid S3 bucket name {show(bucket)}")
    if "?" in after or "#" in after:
        raise BadRecording(S3_QUERY)
    if after in ("", "/"):
        raise BadRecording("has an empty S3 key")
    return RecordingUrl(text=text, scheme=S3, host=bucket, port=None, path=after)


def _has_space_or_control(text: str) -> bool:
    if text.isascii():  # the common case, without a per-character Unicode lookup
        return _ASCII_SPACE_OR_CONTROL.search(text) is not None
    return any(ch.isspace() or unicodedata.category(ch).startswith("C") for ch in text)


def _split_port(authority: str) -> tuple[str, str | None]:
    if authority.startswith("["):  # an IPv6 literal: its colons are not the port separator
        host, bracket, after = authority.partition("]")
        return host + bracket, (after[1:] if after.startswith(":") else after or None)
    host, sep, port = authority.partition(":")
    return host, (port if sep else None)


def _valid_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            return bool(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            return False
    labels = host.removesuffix(".").split(".")
    return len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)


def _valid_bucket(bucket: str) -> bool:
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        return False
    return not re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket)  # no IP-address-shaped names
