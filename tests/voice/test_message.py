"""The job message: one readable line per violation, extras kept, names always safe."""

from __future__ import annotations

import json
import math
import re
import unicodedata
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.recording_url import parse_recording_url
from worker.core.errors import InvalidMessage
from worker.core.names import SAFE_NAME
from worker.core.redact import redact_url
from worker.voice.input_policy import SHAPE_ONLY, InputPolicy
from worker.voice.message import (
    Job,
    Recording,
    job_id_hint,
    parse_job,
)

SECRET = "SIGSECRET123"
DELETE = object()


def valid_body() -> dict:
    return {
        "_doc": {"_id": "665f1c2e9b1e8a0012ab34cd", "owner": "u1"},
        "jobId": "665f1c2e9b1e8a0012ab34cd",
        "profileId": "665f1c2e9b1e8a0012ab34ce",
        "environment": "staging",
        "metadata": {"directoryName": "user-123-voice-1", "language": "pt-BR", "gender": "f"},
        "input": [
            {"recordingUrl": "https://media.example.com/rec/1.wav", "originalText": "Hello there."},
            {"recordingUrl": "s3://voice-media/rec/2.wav", "originalText": "General Kenobi.", "n": 2},
        ],
        "callbackUrl": "https://example.com/hook",
    }


def changed(path: tuple, value) -> dict:
    """A valid body with the field at ``path`` set to ``value`` (or removed, for DELETE)."""
    body = valid_body()
    target = body
    for part in path[:-1]:
        target = target[part]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


def problems_of(body, policy: InputPolicy = SHAPE_ONLY) -> list[str]:
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    with pytest.raises(InvalidMessage) as info:
        parse_job(raw, policy)
    return info.value.problems


def only_problem(body) -> str:
    problems = problems_of(body)
    assert len(problems) == 1, problems
    return problems[0]


# ---------------------------------------------------------------- valid messages


def test_valid_message_round_trips_with_extra_fields_kept():
    """A valid body becomes a Job with every field mapped and unknown fields kept in ``body``."""
    body = valid_body()
    job = parse_job(json.dumps(body))
    assert (job.job_id, job.profile_id) == ("665f1c2e9b1e8a0012ab34cd", "665f1c2e9b1e8a0012ab34ce")
    assert (job.environment, job.directory_name, job.language) == ("staging", "user-123-voice-1", "pt-BR")
    assert job.recordings == (
        Recording(url=parse_recording_url("https://media.example.com/rec/1.wav"), text="Hello there."),
        Recording(url=parse_recording_url("s3://voice-media/rec/2.wav"), text="General Kenobi."),
    )
    assert job.doc == body["_doc"]
    assert job.body == body  # callbackUrl, metadata.gender and input[1].n all kept


def test_bytes_body_is_accepted():
    """An SQS body handed over as UTF-8 bytes parses like the same text."""
    assert parse_job(json.dumps(valid_body()).encode()).job_id == "665f1c2e9b1e8a0012ab34cd"


@pytest.mark.parametrize("absent", [DELETE, None], ids=["missing", "null"])
def test_defaults_for_environment_and_language(absent):
    """Without environment or language (missing or null) a job gets production and en."""
    body = changed(("environment",), absent)
    body["metadata"] = changed(("metadata", "language"), absent)["metadata"]
    job = parse_job(json.dumps(body))
    assert (job.environment, job.language) == ("production", "en")


def test_job_is_frozen():
    """A parsed Job cannot be changed after validation."""
    job = parse_job(json.dumps(valid_body()))
    with pytest.raises(AttributeError):
        job.job_id = "other"  # type: ignore[misc]


def test_job_constructed_directly_still_rejects_unsafe_names():
    """Building a Job by hand cannot smuggle a path-traversing name past the rules."""
    with pytest.raises(ValueError, match="jobId"):
        Job(job_id="../x", profile_id="p", directory_name="d", recordings=(Recording(parse_recording_url("https://h/a"), "t"),))


def test_a_recording_holds_a_parsed_url_never_raw_text():
    """A Recording built by hand from a plain string is refused: only parse_recording_url makes its URL."""
    with pytest.raises(TypeError, match="RecordingUrl"):
        Recording("https://h/a", "t")  # type: ignore[arg-type]


def test_name_of_128_chars_accepted():
    """The longest allowed name (128 characters) is accepted."""
    assert parse_job(json.dumps(changed(("jobId",), "a" * 128))).job_id == "a" * 128


@pytest.mark.parametrize(
    "url",
    [
        "https://media.example.com/a.wav?X-Amz-Signature=abc&X-Amz-Credential=k",
        "https://media.example.com:8443/rec/a.wav",
        "HTTPS://media.example.com/a.wav",
        "https://[2001:db8::1]/a.wav",
        "https://10.0.0.5/a.wav",
        "s3://voice.media-1/deep/key/a.wav",
    ],
)
def test_good_recording_urls(url):
    """Presigned, ported, IPv6, IP and dotted-bucket URLs are all accepted, their text unchanged."""
    assert parse_job(json.dumps(changed(("input", 0, "recordingUrl"), url))).recordings[0].url.text == url


# ---------------------------------------------------------------- one malformed case, one line

JSON_ERR = "body is not valid JSON: "
BLANK = "must not be empty or only whitespace"
CASES = {
    "not-json": ("{not json", JSON_ERR + "Expecting property name enclosed in double quotes: "
                 "line 1 column 2 (char 1)"),
    "not-utf8": (b'{"a": "\xff"}', JSON_ERR + "'utf-8' codec can't decode byte 0xff in position 7: "
                 "invalid start byte"),
    "too-deep": ("[" * 200_000, JSON_ERR + "nested too deeply"),
    "nan": ('{"a": NaN}', JSON_ERR + "NaN is not allowed in JSON"),
    "array-body": ("[1, 2]", "body: must be a JSON object, got array"),
    "string-body": ('"x"', "body: must be a JSON object, got string"),
    "no-doc": (changed(("_doc",), DELETE), "_doc: is required"),
    "no-jobId": (changed(("jobId",), DELETE), "jobId: is required"),
    "no-profileId": (changed(("profileId",), DELETE), "profileId: is required"),
    "no-metadata": (changed(("metadata",), DELETE), "metadata: is required"),
    "no-input": (changed(("input",), DELETE), "input: is required"),
    "no-directoryName": (changed(("metadata", "directoryName"), DELETE),
                         "metadata.directoryName: is required"),
    "doc-string": (changed(("_doc",), "665f"), "_doc: must be an object, got string"),
    "jobId-number": (changed(("jobId",), 12345), "jobId: must be a string, got number"),
    "metadata-array": (changed(("metadata",), []), "metadata: must be an object, got array"),
    "input-object": (changed(("input",), {}), "input: must be an array, got object"),
    "input-empty": (changed(("input",), []), "input: must not be empty"),
    "input-item-string": (changed(("input", 1), "https://h.example/a"),
                          "input[1]: must be an object, got string"),
    "text-missing": (changed(("input", 1, "originalText"), DELETE), "input[1].originalText: is required"),
    "text-blank": (changed(("input", 0, "originalText"), " \t\n "), f"input[0].originalText: {BLANK}"),
    "text-empty": (changed(("input", 1, "originalText"), ""), f"input[1].originalText: {BLANK}"),
    "env-unknown": (changed(("environment",), "prod"),
                    "environment: must be one of development, staging, production, got 'prod'"),
    "env-bool": (changed(("environment",), True), "environment: must be a string, got boolean"),
    "language-option": (changed(("metadata", "language"), "-o"),
                        "metadata.language: must be a language code like 'en' or 'pt-BR', got '-o'"),
}

NAME_RULE = "must be 1-128 letters, digits, '.', '_' or '-', starting alphanumeric, got "
NAME_FIELDS = {
    "jobId": ("jobId",),
    "profileId": ("profileId",),
    "metadata.directoryName": ("metadata", "directoryName"),
}
BAD_NAMES = {  # value -> how the error line echoes it
    "traversal": ("../etc", "'../etc'"),
    "slash": ("a/b", "'a/b'"),
    "backslash": ("a\\b", "'a\\\\b'"),
    "dot": (".", "'.'"),
    "dotdot": ("..", "'..'"),
    "hidden": (".hidden", "'.hidden'"),
    "empty": ("", "''"),
    "option": ("-rf", "'-rf'"),
    "newline": ("abc\n", "'abc\\n'"),
    "nul": ("a\x00b", "'a\\x00b'"),
    "unicode": ("名前", "'名前'"),
    "129-chars": ("x" * 129, f"'{'x' * 79}…'"),
    "url": (f"https://h.example/x?token={SECRET}", "'https://h.example/x'"),
}

URL_FORM = "must be https://host/path or s3://bucket/key, got "
CREDENTIALS = "must not contain user credentials (user:password@)"
SPACE = "must not contain whitespace or control characters"
NO_PATH = "has no path to a recording: 'https://media.example.com/'"
S3_QUERY = "must not contain '?' or '#': an s3:// URL has no query or fragment"
URL_CASES = {
    "http": ("http://media.example.com/a.wav", URL_FORM + "'http://media.example.com/a.wav'"),
    "ftp-presigned": (f"ftp://u:pw@h.example/a.wav?sig={SECRET}", URL_FORM + "'ftp://h.example/a.wav'"),
    "no-scheme": (f"/local/file.wav?sig={SECRET}", URL_FORM + "'/local/file.wav'"),
    "userinfo": ("https://user:pw@media.example.com/a.wav", CREDENTIALS),
    "user-only": ("https://user@media.example.com/a.wav", CREDENTIALS),
    "no-host": ("https:///a.wav", "has no host"),
    "no-path": ("https://media.example.com", NO_PATH),
    "root-path": (f"https://media.example.com/?sig={SECRET}", NO_PATH),
    "query-before-path": ("https://media.example.com?a=/x.wav", NO_PATH),
    "bad-host": ("https://bad_host!/a.wav", "has an invalid host 'bad_host!'"),
    "open-ipv6": ("https://[::1/a.wav", "has an invalid host '[::1'"),
    "bad-port": ("https://media.example.com:99999/a.wav",
                 "has an invalid port in 'https://media.example.com:99999'"),
    "space": ("https://media.example.com/a b.wav", SPACE),
    "bell": ("https://media.example.com/a\x07.wav", SPACE),
    "leading-space": (" https://media.example.com/a.wav", SPACE),
    "backslash": ("https://media.example.com\\@evil.com/a.wav", "must not contain backslashes"),
    "s3-uppercase": ("s3://Voice_Media/a.wav", "has an invalid S3 bucket name 'Voice_Media'"),
    "s3-short": ("s3://ab/a.wav", "has an invalid S3 bucket name 'ab'"),
    "s3-ip": ("s3://192.168.1.1/a.wav", "has an invalid S3 bucket name '192.168.1.1'"),
    "s3-no-bucket": ("s3:///a.wav", "has an invalid S3 bucket name ''"),
    "s3-fragment": ("s3://voice-media#x/a.wav", S3_QUERY),
    "s3-query": ("s3://voice-media/a.wav?versionId=1", S3_QUERY),
    "s3-no-key": ("s3://voice-media", "has an empty S3 key"),
    "s3-empty-key": ("s3://voice-media/", "has an empty S3 key"),
}


@pytest.mark.parametrize(("body", "expected"), list(CASES.values()), ids=list(CASES))
def test_malformed_message_gives_its_own_line(body, expected):
    """Each malformed case gets exactly one line that names the field and the rule."""
    assert only_problem(body) == expected


@pytest.mark.parametrize(("url", "expected"), list(URL_CASES.values()), ids=list(URL_CASES))
def test_bad_recording_url(url, expected):
    """Each malformed recordingUrl gets one line naming its index and reason, never its query."""
    line = only_problem(changed(("input", 1, "recordingUrl"), url))
    assert line == f"input[1].recordingUrl: {expected}"
    assert SECRET not in line and "pw" not in line


@pytest.mark.parametrize(("value", "echo"), list(BAD_NAMES.values()), ids=list(BAD_NAMES))
@pytest.mark.parametrize("field", list(NAME_FIELDS))
def test_unsafe_name_rejected(field, value, echo):
    """jobId, profileId and directoryName must each be one safe path component (echo shortened, redacted)."""
    assert only_problem(changed(NAME_FIELDS[field], value)) == f"{field}: {NAME_RULE}{echo}"


# ---------------------------------------------------------------- many violations


def test_several_violations_give_several_lines():
    """Every violation is reported, each on its own line, in document order."""
    body = valid_body()
    body["jobId"] = "../../etc"
    del body["profileId"]
    body["environment"] = "qa"
    body["input"][0]["recordingUrl"] = "http://media.example.com/a.wav"
    body["input"][1]["originalText"] = " "
    problems = problems_of(body)
    assert [p.split(":")[0] for p in problems] == [
        "jobId",
        "profileId",
        "environment",
        "input[0].recordingUrl",
        "input[1].originalText",
    ]


def test_huge_input_gives_a_bounded_error():
    """Two thousand bad recordings (a body SQS can carry) produce a capped list of short lines, not a huge error."""
    body = changed(("input",), [{"recordingUrl": "x" * 300, "originalText": ""}] * 2_000)
    problems = problems_of(body)
    assert len(problems) == 21
    assert problems[-1] == "… and 3980 more problems"
    assert len("; ".join(problems)) < 5000


def test_over_long_input_is_refused_before_its_entries_are_checked():
    """More entries than the policy allows is one line for the list, none for its (bad) entries."""
    body = changed(("input",), [{"recordingUrl": "ftp://x/y", "originalText": ""}] * 3)
    assert problems_of(body, InputPolicy(max_recordings=2)) == [
        "input: must list at most 2 recordings (MAX_RECORDINGS_PER_JOB), got 3"]


def test_policy_scopes_each_parsed_recording_url():
    """Each s3:// URL is scoped to the bucket and, when profileId is safe, to that profile's prefix."""
    policy = InputPolicy(recordings_bucket="voice-media")
    body = changed(("input", 0, "recordingUrl"), "s3://other-bucket/recordings/a.wav")
    assert problems_of(body, policy) == [
        "input[0].recordingUrl: s3:// recordings must be in bucket 'voice-media' (RECORDINGS_S3_BUCKET), "
        "got 'other-bucket'",
        "input[1].recordingUrl: S3 key must start with 'recordings/665f1c2e9b1e8a0012ab34ce/' "
        "(RECORDINGS_S3_KEY_PREFIX for this job's profileId)",
    ]
    body["profileId"] = "../x"
    assert [p.split(":")[0] for p in problems_of(body, policy)] == ["profileId", "input[0].recordingUrl"]


def test_errors_have_no_pydantic_noise():
    """Lines are re-worded: no 'Value error,' prefix, no pydantic wording or documentation URL."""
    body = changed(("input", 0, "recordingUrl"), "ftp://x/y")
    body["jobId"] = 7
    text = "\n".join(problems_of(body))
    assert "Value error" not in text and "pydantic" not in text and "Input should" not in text


# ---------------------------------------------------------------- job_id_hint and redact_url


def test_job_id_hint_from_invalid_body():
    """An invalid body that still has a safe jobId yields it, so the error can be recorded."""
    assert job_id_hint(json.dumps(changed(("input",), []))) == "665f1c2e9b1e8a0012ab34cd"


@pytest.mark.parametrize(
    "body",
    ["{bad", "[1]", '{"jobId": "../x"}', '{"jobId": 5}', "{}", b"\xff", "[" * 200_000, '{"jobId": "a\\n"}'],
)
def test_job_id_hint_none_when_unusable(body):
    """No hint (and no exception) when the body has no safe jobId."""
    assert job_id_hint(body) is None


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://u:p@h.example:8443/a/b.wav?sig=x#f", "https://h.example:8443/a/b.wav"),
        ("s3://bucket/key/a.wav", "s3://bucket/key/a.wav"),
        ("https://h.example?x=1/y", "https://h.example"),
        ("https://u:p?w@h.example/a", "https://<redacted>"),  # ambiguous: shown as nothing
        ("user:pw@host/a?token=1", "host/a"),
        ("https://[::1/a?x", "https://[::1/a"),
    ],
)
def test_redact_url(url, expected):
    """redact_url keeps scheme, host, port and path, and drops userinfo, query and fragment."""
    assert redact_url(url) == expected


# ---------------------------------------------------------------- properties

_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
_json_values = st.recursive(
    _scalars | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _mostly(valid, invalid):
    """Valid nine times in ten, so whole bodies are often valid and the Job branch is exercised."""
    return st.integers(0, 9).flatmap(lambda roll: invalid if roll == 0 else valid)


_path_texts = st.text(
    st.characters(blacklist_categories=("C", "Z"), blacklist_characters="\\?#"), min_size=1, max_size=12
)
_hosts = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?(\.[a-z]{2,6}){0,2}", fullmatch=True)
_buckets = st.from_regex(r"[a-z0-9][a-z0-9-]{1,20}[a-z0-9]", fullmatch=True)
_signed = "?X-Amz-Signature=" + SECRET
_urls = _mostly(
    st.builds(lambda h, p: f"https://{h}/{p}{_signed}", _hosts, _path_texts)
    | st.builds(lambda b, k: f"s3://{b}/{k}", _buckets, _path_texts),
    st.builds(lambda h, p: f"https://{h}/{p}{_signed}", st.text(max_size=12), st.text(max_size=12))
    | st.builds(lambda u, h, p: f"https://{u}@{h}/{p}{_signed}", st.text(max_size=6), _hosts, _path_texts)
    | st.builds(lambda h, p: f"ftp://{h}/{p}{_signed}", _hosts, st.text(max_size=12))
    | st.builds(lambda b, k: f"s3://{b}/{k}", st.text(max_size=12), st.text(max_size=12))
    | _json_values,
)
_names = _mostly(st.from_regex(SAFE_NAME, fullmatch=True), st.text(max_size=12) | _json_values)
_texts = _mostly(st.text(min_size=1, max_size=8).filter(str.strip), st.text(max_size=8) | _json_values)
_recordings = st.fixed_dictionaries(
    {"recordingUrl": _urls, "originalText": _texts}, optional={"x": _json_values}
)
_metadata = st.fixed_dictionaries(
    {"directoryName": _names},
    optional={"language": _mostly(st.sampled_from(["en", "pt-BR", "zh_Hans"]), _json_values)},
)
_bodies = st.fixed_dictionaries(
    {
        "_doc": _mostly(st.dictionaries(st.text(max_size=5), _json_values, max_size=2), _json_values),
        "jobId": _names,
        "profileId": _names,
        "metadata": _mostly(_metadata, _json_values),
        "input": _mostly(st.lists(_recordings, min_size=1, max_size=3), _json_values),
    },
    optional={
        "environment": _mostly(st.sampled_from(["development", "staging", "production"]), _json_values),
        "extra": _json_values,
    },
)


def _assert_job_or_invalid(raw: str | bytes) -> Job | None:
    try:
        job = parse_job(raw)
    except InvalidMessage as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
        assert SECRET not in str(exc)
        return None
    for name in (job.job_id, job.profile_id, job.directory_name):
        assert re.fullmatch(SAFE_NAME, name) and name not in (".", "..")
        assert "/" not in name and "\\" not in name and "\n" not in name
    assert job.environment in ("development", "staging", "production")
    assert job.recordings and all(r.text.strip() for r in job.recordings)
    for recording in job.recordings:
        assert not re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]", recording.text)
        assert any(not ch.isspace() and unicodedata.category(ch) != "Cf" for ch in recording.text)
    json.dumps(job.body, allow_nan=False)  # what is kept with the job is JSON any reader takes back
    for recording in job.recordings:
        # The standard library's parser must read every accepted URL as we did, with no credentials.
        url, parts = recording.url, urlsplit(recording.url.text)
        assert (url.scheme, url.host, url.port, url.path) == (parts.scheme.lower(), parts.hostname, parts.port,
                                                              parts.path)
        assert not parts.username and url.query == parts.query
        if url.scheme == "s3":
            assert (url.bucket, url.key) == (parts.netloc, parts.path[1:]) and url.key
    return job


@settings(max_examples=300, deadline=None)
@given(_bodies)
def test_property_structured_bodies(body):
    """Near-valid bodies with random field values only ever give a safe Job or InvalidMessage."""
    job = _assert_job_or_invalid(json.dumps(body))
    if job is not None:
        assert job.body == body
    if isinstance(body["jobId"], str):
        assert job_id_hint(json.dumps(body)) in (None, body["jobId"])


@settings(max_examples=200, deadline=None)
@given(_json_values)
def test_property_any_json_value(value):
    """Any JSON value as the body gives a Job or InvalidMessage, never another exception."""
    _assert_job_or_invalid(json.dumps(value))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=64))
def test_property_any_bytes_or_text(raw):
    """Arbitrary bytes or text give a Job or InvalidMessage, and job_id_hint never raises."""
    _assert_job_or_invalid(raw)
    hint = job_id_hint(raw)
    assert hint is None or re.fullmatch(SAFE_NAME, hint)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_property_valid_body_with_one_field_broken(data):
    """Replacing any one field of a valid body by a random value never escapes InvalidMessage."""
    path = data.draw(
        st.sampled_from(
            [("jobId",), ("profileId",), ("environment",), ("metadata", "directoryName"),
             ("metadata", "language"), ("input", 0, "recordingUrl"), ("input", 1, "originalText"),
             ("_doc",), ("metadata",), ("input",), ("input", 0)]
        )
    )
    _assert_job_or_invalid(json.dumps(changed(path, data.draw(_json_values | st.text(max_size=40)))))


def test_a_transcript_with_a_lone_surrogate_is_refused_in_words():
    """Text JSON can carry but UTF-8 cannot (a lone surrogate) is refused, not left to fail the dataset step."""
    body = json.dumps(changed(("input", 0, "originalText"), "caf\ud800e"))
    assert problems_of(body) == ["input[0].originalText: must be valid Unicode text (it holds a lone surrogate)"]
    assert parse_job(json.dumps(changed(("input", 0, "originalText"), "café 你好"))).recordings[0].text == "café 你好"


# ---------------------------------------------------------------- numbers and text the trainer cannot use

OUT_OF_RANGE = JSON_ERR + "number {} is out of range: it would be {}, which is not allowed"
CONTROL = "must not contain control characters other than tab, newline and carriage return, got {} at index {}"
INVISIBLE = "must not be empty or only whitespace and invisible characters, got only "


def with_literal(path: tuple, literal: str) -> str:
    """A valid body as JSON text, with ``literal`` written verbatim at ``path`` (JSON that json.dumps cannot make)."""
    text = json.dumps(changed(path, "@@literal@@"))
    assert text.count('"@@literal@@"') == 1
    return text.replace('"@@literal@@"', literal)


@pytest.mark.parametrize("path", [("extra",), ("_doc", "n"), ("metadata", "gender"), ("input", 1, "n"),
                                  ("callbackUrl",), ("jobId",)],
                         ids=lambda path: ".".join(map(str, path)))
@pytest.mark.parametrize(("literal", "shown", "infinity"), [
    ("1e999", "'1e999'", "Infinity"),
    ("-1e999", "'-1e999'", "-Infinity"),
    ("1E400", "'1E400'", "Infinity"),
    ("2.5e308", "'2.5e308'", "Infinity"),
    ('{"deep": [1, [1e999]]}', "'1e999'", "Infinity"),
], ids=["1e999", "negative", "upper-e", "just-over", "nested"])
def test_a_number_that_overflows_to_infinity_is_refused_wherever_it_is(path, literal, shown, infinity):
    """A number too large for a double, in any field (known, unknown or nested), is one line, not an Infinity kept."""
    assert only_problem(with_literal(path, literal)) == OUT_OF_RANGE.format(shown, infinity)


def test_an_overflowing_number_of_many_digits_is_echoed_shortened():
    """The refusal's echo of a huge literal is cut to the usual length."""
    literal = "9" * 400 + ".0"
    [line] = problems_of(with_literal(("extra",), literal))
    assert line.startswith(JSON_ERR + "number '999") and "…" in line and len(line) < 200


@pytest.mark.parametrize("literal", ["1.7976931348623157e308", "-1e308", "1e-999", "1" + "0" * 400, "-0.0"])
def test_large_and_tiny_finite_numbers_are_kept_and_dump_back_as_strict_json(literal):
    """Finite numbers at the edges of a double (and an exact big integer) are accepted; the kept body dumps as strict JSON."""
    job = parse_job(with_literal(("input", 1, "n"), literal))
    text = json.dumps(job.body, allow_nan=False)
    assert parse_job(text).body == job.body


@pytest.mark.parametrize(("text", "shown"), [
    ("\u200b", "U+200B"),
    (" \u200b\t\u200c\n\u200d\u2060\ufeff ", "U+200B, U+200C, U+200D, U+2060, U+FEFF"),
    ("\ufeff", "U+FEFF"),
    ("\u00ad\u2060\u00ad", "U+00AD, U+2060"),
    ("\u200b\u200c\u200d\u2060\ufeff\u180e\u200e", "U+200B, U+200C, U+200D, U+2060, U+FEFF, …"),
], ids=["zero-width-space", "all-kinds-with-whitespace", "bom", "soft-hyphen", "more-than-five"])
def test_a_transcript_of_only_invisible_characters_is_empty(text, shown):
    """originalText that is only whitespace and invisible format characters (Cf) is refused as empty, naming them."""
    assert only_problem(changed(("input", 1, "originalText"), text)) == f"input[1].originalText: {INVISIBLE}{shown}"


@pytest.mark.parametrize("text", ["می\u200cخواهم", "👩\u200d👩\u200d👧 family", "\ufeffHello.", "co\u00adop"],
                         ids=["zwnj-persian", "zwj-emoji", "leading-bom", "soft-hyphen"])
def test_invisible_characters_inside_visible_text_are_kept(text):
    """A joiner or soft hyphen inside words is part of the text: it is accepted unchanged."""
    assert parse_job(json.dumps(changed(("input", 0, "originalText"), text))).recordings[0].text == text


@pytest.mark.parametrize(("text", "expected"), [
    ("Hello\x00there.", ("U+0000", 5)),
    ("\x1b[31mred\x1b[0m", ("U+001B", 0)),
    ("bell\x07", ("U+0007", 4)),
    ("tab\x0bvertical", ("U+000B", 3)),
    ("form\x0cfeed", ("U+000C", 4)),
    ("del\x7f", ("U+007F", 3)),
    ("next\x85line", ("U+0085", 4)),
    ("csi\x9b31m", ("U+009B", 3)),
    ("\u200b\x00", ("U+0000", 1)),
], ids=["nul", "esc", "bel", "vt", "ff", "del", "c1-nel", "c1-csi", "invisible-and-nul"])
def test_control_characters_in_a_transcript_are_refused(text, expected):
    """NUL, ESC and the other C0/C1 controls (but tab, newline and CR) are refused, naming the first and where it is."""
    line = only_problem(changed(("input", 0, "originalText"), text))
    assert line == "input[0].originalText: " + CONTROL.format(*expected)


def test_tab_newline_and_carriage_return_are_ordinary_text():
    """Tab, newline and carriage return inside a transcript are accepted unchanged."""
    text = "Line one.\r\n\tLine two.\n"
    assert parse_job(json.dumps(changed(("input", 0, "originalText"), text))).recordings[0].text == text


@settings(max_examples=150, deadline=None)
@given(st.from_regex(r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,3})?[eE][-+]?[0-9]{1,4}", fullmatch=True))
def test_property_any_number_literal_is_finite_or_refused(literal):
    """Any JSON number, anywhere, gives a Job whose body dumps as strict JSON, or one out-of-range line."""
    try:
        job = parse_job(with_literal(("_doc", "n"), literal))
    except InvalidMessage as exc:
        assert len(exc.problems) == 1 and "is out of range: it would be" in exc.problems[0]
        assert math.isinf(float(literal))
        return
    json.dumps(job.body, allow_nan=False)


# ---------------------------------------------------------------- hostile bodies, refused quickly

SCOPED = InputPolicy(recordings_bucket="voice-media")
PREFIX = "recordings/665f1c2e9b1e8a0012ab34ce/"
NAME_ECHO = "must be 1-128 letters, digits, '.', '_' or '-', starting alphanumeric, got "


def in_scope(path: tuple = ("extra",), value=None, literal: str | None = None) -> str:
    """A body valid under SCOPED but for ``value`` (or the JSON ``literal``) at ``path``."""
    body = valid_body()
    body["input"][1]["recordingUrl"] = f"s3://voice-media/{PREFIX}2.wav"
    target = body
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = "@@literal@@" if literal is not None else value
    text = json.dumps(body)
    return text.replace('"@@literal@@"', literal) if literal is not None else text


DIGITS = "Exceeds the limit (4300 digits) for integer string conversion"
URL0 = ("input", 0, "recordingUrl")
HOSTILE = {
    "deep-array-100k": ("[" * 100_000 + "]" * 100_000, JSON_ERR + "nested too deeply"),
    "deep-object-100k": ('{"a":' * 100_000 + "1" + "}" * 100_000, JSON_ERR + "nested too deeply"),
    "deep-in-doc-100k": (in_scope(("_doc", "n"), literal="[" * 100_000 + "]" * 100_000), JSON_ERR + "nested too deeply"),
    "deep-unclosed-200k": ("[" * 200_000, JSON_ERR + "nested too deeply"),
    "deep-in-extra-5000": (in_scope(literal="[" * 5000 + "]" * 5000), JSON_ERR + "nested too deeply"),
    "int-5000-extra": (in_scope(literal="1" * 5000), JSON_ERR + DIGITS),
    "int-5000-doc": (in_scope(("_doc", "n"), literal="9" * 5000), JSON_ERR + DIGITS),
    "int-5000-jobId": (in_scope(("jobId",), literal="1" * 5000), JSON_ERR + DIGITS),
    "int-5000-nested": (in_scope(("input", 1, "n"), literal="[" + "7" * 5000 + "]"), JSON_ERR + DIGITS),
    "port-5000-digits": (in_scope(URL0, "https://h.example:" + "9" * 5000 + "/a.wav"),
                         "input[0].recordingUrl: has an invalid port in 'https://h.example:999"),
    "1e999": (in_scope(literal="1e999"), OUT_OF_RANGE.format("'1e999'", "Infinity")),
    "-1e999": (in_scope(("_doc", "n"), literal="-1e999"), OUT_OF_RANGE.format("'-1e999'", "-Infinity")),
    "nan": (in_scope(literal="NaN"), JSON_ERR + "NaN is not allowed in JSON"),
    "infinity": (in_scope(("_doc", "n"), literal="Infinity"), JSON_ERR + "Infinity is not allowed in JSON"),
    "-infinity": (in_scope(("input", 0, "n"), literal="-Infinity"), JSON_ERR + "-Infinity is not allowed in JSON"),
    "nan-as-jobId": (in_scope(("jobId",), literal="NaN"), JSON_ERR + "NaN is not allowed in JSON"),
    "surrogate-jobId": (in_scope(("jobId",), "a\ud800"), "jobId: " + NAME_ECHO + "'a\\ud800'"),
    "surrogate-profileId": (in_scope(("profileId",), "\udfff"), "profileId: " + NAME_ECHO + "'\\udfff'"),
    "surrogate-dir": (in_scope(("metadata", "directoryName"), "x\ud83d"), "metadata.directoryName: " + NAME_ECHO),
    "surrogate-language": (in_scope(("metadata", "language"), "e\ud800"),
                           "metadata.language: must be a language code like 'en' or 'pt-BR', got 'e\\ud800'"),
    "surrogate-env": (in_scope(("environment",), "\ud800"), "environment: must be one of development, staging, "
                      "production, got '\\ud800'"),
    "surrogate-text": (in_scope(("input", 0, "originalText"), "caf\ud800e"),
                       "input[0].originalText: must be valid Unicode text (it holds a lone surrogate)"),
    "surrogate-url": (in_scope(URL0, "https://h.example/\ud800.wav"), f"input[0].recordingUrl: {SPACE}"),
    "bom-body": ("\ufeff" + json.dumps(valid_body()), JSON_ERR + "Unexpected UTF-8 BOM (decode using utf-8-sig)"),
    "bom-env": (in_scope(("environment",), "\ufeffproduction"), "environment: must be one of development"),
    "bom-jobId": (in_scope(("jobId",), "\ufeffabc"), "jobId: " + NAME_ECHO + "'\\ufeffabc'"),
    "bom-only-text": (in_scope(("input", 0, "originalText"), "\ufeff"), f"input[0].originalText: {INVISIBLE}U+FEFF"),
    "bom-url": (in_scope(URL0, "\ufeffhttps://h.example/a.wav"), f"input[0].recordingUrl: {SPACE}"),
    "bom-bucket": (in_scope(URL0, f"s3://\ufeffvoice-media/{PREFIX}a.wav"), f"input[0].recordingUrl: {SPACE}"),
    "fullwidth-jobId": (in_scope(("jobId",), "ａｂｃ"), "jobId: " + NAME_ECHO + "'ａｂｃ'"),
    "fullwidth-slash-dir": (in_scope(("metadata", "directoryName"), "dir／x"),
                            "metadata.directoryName: " + NAME_ECHO + "'dir／x'"),
    "fullwidth-slash-url": (in_scope(URL0, "https://h.example／a.wav"),
                            "input[0].recordingUrl: has an invalid host 'h.example／a.wav'"),
    "fullwidth-scheme": (in_scope(URL0, "ｈｔｔｐｓ://h.example/a.wav"), "input[0].recordingUrl: " + URL_FORM),
    "fullwidth-host": (in_scope(URL0, "https://ｈ.example/a.wav"), "input[0].recordingUrl: has an invalid host"),
    "fullwidth-port": (in_scope(URL0, "https://h.example:４４３/a.wav"), "input[0].recordingUrl: has an invalid port"),
    "fullwidth-language": (in_scope(("metadata", "language"), "ｅｎ"), "metadata.language: must be a language code"),
    "fullwidth-env": (in_scope(("environment",), "ｐｒｏｄｕｃｔｉｏｎ"), "environment: must be one of"),
    "%2F-jobId": (in_scope(("jobId",), "a%2Fb"), "jobId: " + NAME_ECHO + "'a%2Fb'"),
    "%2F-dir": (in_scope(("metadata", "directoryName"), "..%2F..%2Fetc"), "metadata.directoryName: " + NAME_ECHO),
    "%2F-host": (in_scope(URL0, "https://h.example%2Fevil.com/a.wav"),
                 "input[0].recordingUrl: has an invalid host 'h.example%2Fevil.com'"),
    "%2F-bucket": (in_scope(URL0, "s3://voice-media%2Fx/recordings/a.wav"),
                   "input[0].recordingUrl: has an invalid S3 bucket name 'voice-media%2Fx'"),
    "%2F-key-scope": (in_scope(URL0, "s3://voice-media/recordings%2F665f1c2e9b1e8a0012ab34ce%2Fa.wav"),
                      f"input[0].recordingUrl: S3 key must start with '{PREFIX}'"),
    "dotdot-key": (in_scope(URL0, f"s3://voice-media/{PREFIX}../other/a.wav"),
                   "input[0].recordingUrl: S3 key must not have empty, '.' or '..' path segments"),
    "not-utf8": (b'{"jobId": "\xff"}', JSON_ERR + "'utf-8' codec can't decode byte 0xff"),
    "truncated": (in_scope()[:-1], JSON_ERR + "Expecting ',' delimiter"),
    "array-body": ("[1, 2]", "body: must be a JSON object, got array"),
    "null-body": ("null", "body: must be a JSON object, got null"),
    "too-big": (in_scope(value="x" * (1024 * 1024)), "body: larger than 1048576 bytes"),
    "2000-bad-recordings": (json.dumps(changed(("input",), [{"recordingUrl": "x" * 300, "originalText": ""}] * 2000)),
                            "input: must list at most 500 recordings (MAX_RECORDINGS_PER_JOB), got 2000"),
    "escape-in-text": (in_scope(("input", 0, "originalText"), "\x1b[31mred"),
                       "input[0].originalText: " + CONTROL.format("U+001B", 0)),
}


def test_the_hostile_bodies_are_fifty():
    """The table below is the measured set: 50 malformed bodies (and its valid base body passes SCOPED)."""
    assert len(HOSTILE) == 50
    assert parse_job(in_scope(), SCOPED).recordings[1].url.key == f"{PREFIX}2.wav"


def test_fifty_hostile_bodies_are_each_refused_in_one_line_and_quickly():
    """Deep nesting, 5,000-digit numbers, NaN and 1e999, lone surrogates, BOMs, fullwidth and %2F escapes:
    each body is one problem line naming its fault, and all fifty take well under a second (about 5 ms
    when measured; the bound leaves room for a loaded machine)."""
    import time

    start = time.perf_counter()
    lines = {}
    for name, (body, _expected) in HOSTILE.items():
        with pytest.raises(InvalidMessage) as info:
            parse_job(body, SCOPED)
        lines[name] = info.value.problems
    elapsed = time.perf_counter() - start
    wrong = {name: found for name, found in lines.items()
             if len(found) != 1 or not found[0].startswith(HOSTILE[name][1])}
    assert not wrong, wrong
    assert elapsed < 2.0, f"{elapsed:.2f} s for 50 hostile bodies"


def test_the_message_model_is_strict_also_for_values_json_never_gives():
    """The model converts nothing: bytes are not a string, a tuple not an array, a number not a name
    (json.loads gives neither bytes nor tuples, so only a direct caller of the model can tell)."""
    from pydantic import ValidationError

    from worker.voice.message import JobMessage

    body = valid_body()
    body["jobId"], body["input"], body["metadata"]["directoryName"] = b"abc", tuple(body["input"]), 7
    with pytest.raises(ValidationError) as info:
        JobMessage.model_validate(body)
    assert [(e["loc"], e["type"]) for e in info.value.errors()] == [
        (("jobId",), "string_type"), (("metadata", "directoryName"), "string_type"), (("input",), "list_type")]
