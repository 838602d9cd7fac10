"""The address policy, third-party error text, and the status/S3 error classification (no network)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.downloads import classify_status, s3_error_is_permanent
from pipeline.errors import BadRecording, DownloadError
from pipeline.netguard import checked_addresses, default_resolver, describe_error, refusal_reason
from pipeline.recording_url import parse_recording_url
from tests.pipeline.tls_server import LOOPBACK, SECRET, resolver
from worker.settings import load_settings


@pytest.mark.parametrize(
    ("status", "expected"),
    [(200, None), (204, None), (304, BadRecording), (400, BadRecording), (403, BadRecording),
     (404, BadRecording), (410, BadRecording), (408, DownloadError), (429, DownloadError),
     (500, DownloadError), (599, DownloadError)],
)
def test_classify_status(status, expected):
    """Each final status maps to the documented fate."""
    assert classify_status(status) is expected


def test_a_host_with_one_private_address_is_refused_even_if_another_is_allowed():
    """Every resolved address must pass, not just the first."""
    with pytest.raises(BadRecording, match="10.0.0.7"):
        checked_addresses("mixed.test", 443, LOOPBACK, resolver)


def test_the_default_resolver_returns_plain_addresses():
    """The system resolver's answer is reduced to unique address strings the policy can parse."""
    assert default_resolver("127.0.0.1", 443) == ["127.0.0.1"]


def test_settings_open_private_ranges_only_on_request():
    """DOWNLOAD_ALLOW_PRIVATE_HOSTS opens loopback/private ranges (never link-local); unset, nothing is open."""
    closed = load_settings({"DOWNLOAD_TIMEOUT_SECONDS": "5"}).download_settings()
    opened = load_settings({"DOWNLOAD_ALLOW_PRIVATE_HOSTS": "true"}).download_settings()
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


def test_third_party_error_text_is_scrubbed():
    """A library message quoting the request target loses its query string and fragment."""
    url = parse_recording_url(f"https://localhost/a.wav?{SECRET}#frag-secret")
    quoted = OSError(f"bad target '/a.wav?{SECRET}' (#frag-secret)")
    described = describe_error(quoted, url)
    assert described.startswith("OSError: bad target '/a.wav?")
    assert "secret" not in described


@pytest.mark.parametrize(
    ("code", "status", "permanent"),
    [("NoSuchKey", 404, True), ("NoSuchBucket", 404, True), ("AccessDenied", 403, True), ("", 404, True),
     ("InternalError", 500, False), ("SlowDown", 503, False), ("RequestTimeout", 400, False)],
)
def test_s3_error_classification(code, status, permanent):
    """Only gone/forbidden S3 answers are permanent; the rest are worth a retry."""
    assert s3_error_is_permanent(code, status) is permanent
