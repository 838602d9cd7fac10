"""Recording downloads against a real local HTTPS server (trustme CA) and moto-backed S3."""

from __future__ import annotations

import socket
import threading
import time
import traceback

import boto3
import pytest
from moto import mock_aws
from structlog.testing import capture_logs

from pipeline.downloads import fetch
from pipeline.errors import BadRecording, DownloadError
from pipeline.netguard import LOCAL_RUN_NETWORKS
from tests.pipeline.tls_server import (  # noqa: F401  (ca, ca_path, server, base, ds are fixtures)
    LOOPBACK,
    PAYLOAD,
    SECRET,
    base,
    ca,
    ca_path,
    ds,
    leftovers,
    resolver,
    server,
    with_changes,
)
from worker.core.errors import ConfigError, Stopped
from worker.core.stop import StopSignal

# --- success


def test_https_download_writes_the_body_and_renames_it(base, ds, tmp_path):
    """A 200 body is written in full to dest, no .part is left and the byte count is returned."""
    dest = tmp_path / "rec.wav"
    assert fetch(f"{base}/ok", dest, settings=ds, resolver=resolver) == len(PAYLOAD)
    assert dest.read_bytes() == PAYLOAD
    assert leftovers(tmp_path) == ["rec.wav"]


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
    assert leftovers(tmp_path) == []


def test_an_unknown_ca_is_rejected(base, ds, tmp_path):
    """Without the test CA the server's certificate is not trusted and nothing is written."""
    with pytest.raises(DownloadError):
        fetch(f"{base}/ok", tmp_path / "r.wav", settings=with_changes(ds, ca_certs=None), resolver=resolver)
    assert leftovers(tmp_path) == []


def test_a_stale_part_is_replaced_and_a_failure_keeps_the_old_file(base, ds, tmp_path):
    """A leftover .part from a crash is overwritten; a failed download leaves an existing dest alone."""
    dest = tmp_path / "rec.wav"
    (tmp_path / "rec.wav.part").write_bytes(b"junk from a crashed attempt" * 1000)
    fetch(f"{base}/bytes/10", dest, settings=ds, resolver=resolver)
    assert dest.read_bytes() == b"a" * 10
    with pytest.raises(BadRecording):
        fetch(f"{base}/status/404", dest, settings=ds, resolver=resolver)
    assert dest.read_bytes() == b"a" * 10
    assert leftovers(tmp_path) == ["rec.wav"]


# --- status codes


@pytest.mark.parametrize("status", [404, 410, 403, 400, 418])
def test_gone_forbidden_and_other_4xx_are_permanent(base, ds, tmp_path, status):
    """404/410/403 and other 4xx answers raise BadRecording and leave no file."""
    with pytest.raises(BadRecording, match=f"HTTP {status}"):
        fetch(f"{base}/status/{status}", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("status", [408, 429, 500, 503])
def test_timeouts_throttling_and_5xx_are_retryable(base, ds, tmp_path, status):
    """408/429/5xx raise DownloadError and leave no file."""
    with pytest.raises(DownloadError, match=f"HTTP {status}"):
        fetch(f"{base}/status/{status}", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert leftovers(tmp_path) == []


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
    assert leftovers(tmp_path) == []


def test_an_absolute_redirect_to_another_checked_host_is_followed(base, ds, tmp_path):
    """A Location naming another allowed host is resolved, checked and followed."""
    assert fetch(f"{base}/to/absolute", tmp_path / "r.wav", settings=ds, resolver=resolver) == len(PAYLOAD)


@pytest.mark.parametrize("where", ["http", "s3"])
def test_a_redirect_off_https_is_refused(base, server, ds, tmp_path, where):
    """A redirect to http:// or s3:// is refused: every hop must be https."""
    with pytest.raises(BadRecording, match="not https"):
        fetch(f"{base}/to/{where}", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert len(server.seen) == 1


@pytest.mark.parametrize("where", ["open-ipv6", "backslash", "bad-host"])
def test_a_redirect_target_is_parsed_like_the_recording(base, server, ds, tmp_path, where):
    """A Location the recording's own rules would refuse is refused as permanent, and never requested."""
    with pytest.raises(BadRecording, match="redirect refused"):
        fetch(f"{base}/to/{where}", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert len(server.seen) == 1
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("allowed", [LOOPBACK, LOCAL_RUN_NETWORKS])
def test_a_redirect_to_the_metadata_address_is_refused(base, ds, tmp_path, allowed):
    """A hop resolving to 169.254.169.254 is refused even when loopback/private hosts are allowed."""
    with pytest.raises(BadRecording, match="169.254.169.254"):
        fetch(f"{base}/to/metadata", tmp_path / "r.wav", settings=with_changes(ds, allowed_networks=allowed),
              resolver=resolver)
    assert leftovers(tmp_path) == []


# --- address policy


@pytest.mark.parametrize("host", ["localhost", "private.test", "mixed.test"])
def test_non_public_hosts_are_refused_before_connecting(server, ds, tmp_path, host):
    """With nothing allowed, a host resolving to 127.x or 10.x (even one address of several) is never contacted."""
    server.seen.clear()
    url = f"https://{host}:{server.server_address[1]}/ok"
    with pytest.raises(BadRecording, match=host):
        fetch(url, tmp_path / "r.wav", settings=with_changes(ds, allowed_networks=()), resolver=resolver)
    assert server.seen == []
    assert leftovers(tmp_path) == []


# --- size cap


@pytest.mark.parametrize(("route", "limit"), [("declared/5000", 4999), ("declared-lie/1000000000000", 10**7)])
def test_a_declared_length_over_the_cap_is_permanent(base, ds, tmp_path, route, limit):
    """Content-Length above max_bytes is refused from the header alone, before the body is read."""
    with pytest.raises(BadRecording, match="over the limit"):
        fetch(f"{base}/{route}", tmp_path / "r.wav", settings=with_changes(ds, max_bytes=limit), resolver=resolver)
    assert leftovers(tmp_path) == []


def test_a_chunked_body_over_the_cap_is_permanent(base, ds, tmp_path):
    """A body with no declared length is cut off as soon as it passes max_bytes."""
    with pytest.raises(BadRecording, match="over the limit"):
        fetch(f"{base}/chunked/5000", tmp_path / "r.wav", settings=with_changes(ds, max_bytes=2500), resolver=resolver)
    assert leftovers(tmp_path) == []


def test_a_body_of_exactly_the_cap_is_accepted(base, ds, tmp_path):
    """The cap is inclusive: max_bytes bytes, declared or chunked, are fine."""
    small = with_changes(ds, max_bytes=5000)
    assert fetch(f"{base}/declared/5000", tmp_path / "a.wav", settings=small, resolver=resolver) == 5000
    assert fetch(f"{base}/chunked/5000", tmp_path / "b.wav", settings=small, resolver=resolver) == 5000


@pytest.mark.parametrize("route", ["declared/5000", "chunked/5000"])
def test_the_job_budget_caps_a_file_below_its_own_limit(base, ds, tmp_path, route):
    """With less of the job's budget left than max_bytes, a longer body is refused as the job's limit."""
    with pytest.raises(BadRecording, match=r"job's total download limit \(MAX_JOB_DOWNLOAD_BYTES\) was hit, "
                                           r"4999 bytes were left"):
        fetch(f"{base}/{route}", tmp_path / "r.wav", settings=ds, resolver=resolver, remaining_job_bytes=4999)
    assert leftovers(tmp_path) == []
    assert fetch(f"{base}/{route}", tmp_path / "r.wav", settings=ds, resolver=resolver, remaining_job_bytes=5000) == 5000


def test_a_spent_job_budget_refuses_before_any_request(base, server, ds, tmp_path):
    """No budget left: the recording is refused without contacting the host."""
    with pytest.raises(BadRecording, match="total download limit"):
        fetch(f"{base}/ok", tmp_path / "r.wav", settings=ds, resolver=resolver, remaining_job_bytes=0)
    assert server.seen == []


# --- deadline, network failures, stop


def test_a_trickling_body_hits_the_whole_file_deadline(base, ds, tmp_path):
    """A server sending a byte every 10 ms never trips a read timeout, yet the per-file deadline ends it."""
    with pytest.raises(DownloadError, match="deadline"):
        fetch(f"{base}/trickle", tmp_path / "r.wav", settings=with_changes(ds, timeout_s=0.3), resolver=resolver)
    assert leftovers(tmp_path) == []


def test_a_stalled_body_hits_the_deadline(base, ds, tmp_path):
    """A server that stops sending mid-body is cut off at the deadline and the .part removed."""
    with pytest.raises(DownloadError, match="deadline"):
        fetch(f"{base}/stall", tmp_path / "r.wav", settings=with_changes(ds, timeout_s=0.3), resolver=resolver)
    assert leftovers(tmp_path) == []


def test_a_connection_reset_mid_body_is_retryable(base, ds, tmp_path):
    """A TCP reset after part of the body raises DownloadError and removes the .part."""
    with pytest.raises(DownloadError):
        fetch(f"{base}/reset", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert leftovers(tmp_path) == []


def test_a_body_shorter_than_declared_is_retryable(base, ds, tmp_path):
    """A clean close before Content-Length bytes arrived is a failed download, not a short file."""
    with pytest.raises(DownloadError):
        fetch(f"{base}/short", tmp_path / "r.wav", settings=ds, resolver=resolver)
    assert leftovers(tmp_path) == []


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
        fetch(f"{base}/{route}", tmp_path / "r.wav", settings=with_changes(ds, timeout_s=30), stop=stop,
              resolver=resolver)
    timer.join()
    assert caught.value.reason == "shutdown"
    assert time.monotonic() - started < 5  # the stall lasts 10 s and the deadline is 30 s
    assert leftovers(tmp_path) == []


def test_a_stop_set_before_the_start_does_no_work(base, server, ds, tmp_path):
    """An already-set stop raises Stopped before any request, directory or file is made."""
    stop = StopSignal()
    stop.set("cancelled")
    for url in (f"{base}/ok", "s3://recordings/user/1.wav"):
        with pytest.raises(Stopped):
            fetch(url, tmp_path / "new" / "r.wav", settings=ds, stop=stop, resolver=resolver)
    assert server.seen == []
    assert leftovers(tmp_path) == []


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
            fetch(url, tmp_path / "r.wav", settings=with_changes(ds, timeout_s=0.3), resolver=resolver)
        else:
            with pytest.raises(error) as caught:
                fetch(url, tmp_path / "r.wav", settings=with_changes(ds, timeout_s=0.3), resolver=resolver)
    said = _everything_said(caught, logs)
    assert logs, "the download should have logged something"
    assert "secret" not in said


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
    assert leftovers(tmp_path) == ["r.wav"]


@pytest.mark.parametrize("url", ["s3://recordings/user/missing.wav", "s3://no-such-bucket/user/1.wav"])
def test_s3_missing_key_or_bucket_is_permanent(s3, ds, tmp_path, url):
    """NoSuchKey and NoSuchBucket raise BadRecording and leave no file."""
    with pytest.raises(BadRecording):
        fetch(url, tmp_path / "r.wav", settings=ds, s3_client=s3)
    assert leftovers(tmp_path) == []


def test_s3_object_over_the_cap_is_permanent(s3, ds, tmp_path):
    """An object larger than max_bytes is refused and nothing is kept."""
    with pytest.raises(BadRecording, match="over the limit"):
        fetch("s3://recordings/user/1.wav", tmp_path / "r.wav", settings=with_changes(ds, max_bytes=1000), s3_client=s3)
    assert leftovers(tmp_path) == []


def test_the_deadline_is_checked_between_chunks(s3, ds, tmp_path):
    """Even when no read blocks (so no watchdog can help), the loop stops once the deadline has passed."""
    s3.put_object(Bucket="recordings", Key="user/big.wav", Body=b"b" * (5 * 1024 * 1024))
    ticks = iter(range(1000))
    with pytest.raises(DownloadError, match="deadline"):
        fetch("s3://recordings/user/big.wav", tmp_path / "r.wav", settings=with_changes(ds, timeout_s=2.5),
              s3_client=s3, clock=lambda: float(next(ticks)))
    assert leftovers(tmp_path) == []


def test_s3_without_a_client_is_a_wiring_error(ds, tmp_path):
    """An s3:// URL with no client is a configuration problem, not the recording's fault."""
    with pytest.raises(ConfigError):
        fetch("s3://recordings/user/1.wav", tmp_path / "r.wav", settings=ds)


@pytest.mark.parametrize("url", ["s3://recordings", "s3:///key", "s3://recordings/k?versionId=1", "ftp://x/y"])
def test_malformed_recording_urls_are_permanent(ds, tmp_path, url):
    """Anything that is not https:// or s3://bucket/key is refused as permanent."""
    with pytest.raises(BadRecording):
        fetch(url, tmp_path / "r.wav", settings=ds)
