"""One recording URL value: parsed once, by one set of rules, and never shown with its secrets."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import BadRecording
from pipeline.recording_url import RecordingUrl, parse_recording_url

SECRET = "X-Amz-Signature=SIGSECRET"


def test_an_https_url_is_split_into_what_the_connection_needs():
    """Scheme and host are lower-cased, the port kept as written, the path and query as they were."""
    url = parse_recording_url(f"HTTPS://Media.Example.com:8443/rec/a.wav?{SECRET}#part")
    assert (url.scheme, url.host, url.port, url.path) == ("https", "media.example.com", 8443, "/rec/a.wav")
    assert (url.query, url.fragment, url.connect_port) == (SECRET, "part", 8443)
    assert url.request_target == f"/rec/a.wav?{SECRET}"  # the fragment is never sent
    assert url.host_header == "media.example.com:8443"


@pytest.mark.parametrize(("text", "host", "host_header", "redacted"), [
    ("https://h.example/a.wav", "h.example", "h.example", "https://h.example/a.wav"),
    ("https://h.example:443/a.wav", "h.example", "h.example", "https://h.example:443/a.wav"),
    ("https://[2001:DB8::1]:8443/a.wav", "2001:db8::1", "[2001:db8::1]:8443", "https://[2001:db8::1]:8443/a.wav"),
    ("https://10.0.0.5/a.wav?x=1", "10.0.0.5", "10.0.0.5", "https://10.0.0.5/a.wav"),
])
def test_hosts_ports_and_the_shown_form(text, host, host_header, redacted):
    """IPv6 loses its brackets for the connection and keeps them in the Host header; 443 is left out of it."""
    url = parse_recording_url(text)
    assert (url.host, url.host_header, url.redacted) == (host, host_header, redacted)


def test_an_s3_url_is_a_bucket_and_a_literal_key():
    """s3://bucket/key gives the bucket and the key as written, a doubled slash included."""
    url = parse_recording_url("S3://voice.media-1/deep//key/a.wav")
    assert (url.scheme, url.bucket, url.key, url.redacted) == ("s3", "voice.media-1", "deep//key/a.wav",
                                                               "s3://voice.media-1/deep//key/a.wav")
    assert parse_recording_url("s3://voice-media//a.wav").key == "/a.wav"  # the downloader once fetched "a.wav"


def test_an_https_url_has_no_bucket():
    """Asking an https:// URL for its bucket or key is a programming error, not a silent empty string."""
    with pytest.raises(ValueError, match="not an s3:// URL"):
        _ = parse_recording_url("https://h.example/a.wav").bucket


@pytest.mark.parametrize("text", [
    "https://media.example.com\\@evil.com/a.wav",  # urllib.parse: host evil.com; WHATWG: media.example.com
    "https://media.example.com/a\\b.wav",
    "s3://voice-media/a\\b.wav",
])
def test_a_backslash_anywhere_is_refused(text):
    """Parsers disagree on what a backslash means, so no URL holding one is read at all."""
    with pytest.raises(BadRecording, match="^must not contain backslashes$"):
        parse_recording_url(text)


@pytest.mark.parametrize(("text", "rule"), [
    # What the downloader's https parser (urlsplit) refused, refused here too.
    ("http://localhost/ok", "must be https://host/path or s3://bucket/key"),
    ("ftp://localhost/ok", "must be https://host/path or s3://bucket/key"),
    ("https:///ok", "has no host"),
    ("https://user:pw@localhost/ok", "must not contain user credentials"),
    ("https://bad_host!/ok", "has an invalid host"),
    ("https://localhost:99999/ok", "has an invalid port"),
    ("https://localhost:" + "9" * 5000 + "/ok", "has an invalid port"),  # not int()'s digit-limit text
    ("https://[::1/ok", "has an invalid host"),
    # What it let through and the message refused: now one answer, the strict one.
    ("https://under_score.example/a.wav", "has an invalid host"),
    ("https://media.example.com", "has no path to a recording"),
    ("https://media.example.com:/a.wav", "has an invalid port"),
    ("https://media.example.com/a b.wav", "must not contain whitespace or control characters"),
    ("https://media.example.com/a\t.wav", "must not contain whitespace or control characters"),
    # What the downloader's s3 splitter refused.
    ("s3://recordings", "has an empty S3 key"),
    ("s3:///key", "has an invalid S3 bucket name"),
    ("s3://recordings/k?versionId=1", "must not contain '?' or '#'"),
    ("s3://u@recordings/k", "must not contain user credentials"),
])
def test_every_former_parser_now_gives_the_same_answer(text, rule):
    """Each edge case the four parsers read differently is refused once, with the message's words."""
    with pytest.raises(BadRecording) as caught:
        parse_recording_url(text)
    assert str(caught.value).startswith(rule)
    assert "pw" not in str(caught.value)


def test_neither_str_nor_repr_shows_the_query_or_the_text():
    """A RecordingUrl that ends up in an f-string, a log field or a traceback shows only its redacted form."""
    url = parse_recording_url(f"https://h.example/a.wav?{SECRET}#frag")
    for shown in (str(url), repr(url), f"{url}", repr((url,))):
        assert "SIGSECRET" not in shown and "frag" not in shown
    assert str(url) == "https://h.example/a.wav"


_hosts = st.from_regex(r"[a-zA-Z0-9]([a-zA-Z0-9-]{0,10}[a-zA-Z0-9])?(\.[a-zA-Z]{2,6}){0,2}", fullmatch=True)
_paths = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e, blacklist_characters="\\?#"),
                 min_size=1, max_size=12)
_queries = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e, blacklist_characters="\\#"), max_size=12)


@settings(max_examples=50)
@given(_hosts, st.none() | st.integers(1, 65535), _paths, _queries)
def test_the_standard_library_reads_every_accepted_url_the_same_way(host, port, path, query):
    """For any URL the parse accepts, urlsplit sees the same scheme, host, port, path and query."""
    text = f"https://{host}{'' if port is None else f':{port}'}/{path}" + (f"?{query}" if query else "")
    url = parse_recording_url(text)
    parts = urlsplit(text)
    assert isinstance(url, RecordingUrl)
    assert (url.scheme, url.host, url.port, url.path, url.query) == (
        parts.scheme, parts.hostname, parts.port, parts.path, parts.query)
