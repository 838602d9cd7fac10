"""Hostile message bodies: hypothesis strategies and a curated corpus.

Most generated bodies start from a valid job and break one or a few fields, so they get past the
JSON parser and probe the schema, the path building and the download guards; the rest are random
JSON, random text and deep nesting. A valid recording (``RECORDING``) lets some bodies go all the way
through training, so "ack" is exercised too.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

JOB_ID = "665f1c2e9b1e8a0012ab34cd"
PROFILE_ID = "665f1c2e9b1e8a0012ab34ce"
RECORDINGS_BUCKET = "prop-recordings"
# Under RECORDINGS_S3_KEY_PREFIX's default for PROFILE_ID; the probe copies the clip there per profile.
RECORDINGS_PREFIX = f"recordings/{PROFILE_ID}/"
RECORDING = f"s3://{RECORDINGS_BUCKET}/{RECORDINGS_PREFIX}clip.wav"

# The characters SQS accepts in a body (others are refused at send time and never reach a worker).
SQS_TEXT = st.characters(codec="utf-8", exclude_categories=("Cs",)).filter(
    lambda c: c in "\t\n\r" or "\x20" <= c <= "\ud7ff" or "\ue000" <= c <= "\ufffd" or c >= "\U00010000")

PATH_TRICKS = [
    "..", ".", "../..", "../../etc", "/etc/passwd", "a/../../b", "a/b", "a\\b", "..\\..\\x", "~", "~root",
    "%2e%2e", "%2e%2e%2fetc", "\u2024\u2024", "\uff0e\uff0e", "a\x00b", "a\nb", "voice-1\n", " voice", "voice ",
    "-rf", "--help", "x" * 129, "CON", "nul", ".hidden", "a" * 128, "voice:1", "voice|1", "vo\u0301ice",
    "\u202eevil", "*", "?", "$HOME", "`id`", "$(id)", "voice/..", "//server/share",
]
URLS = [
    "https://10.0.0.1/rec.wav", "https://127.0.0.1/rec.wav", "https://[::1]/rec.wav", "https://localhost/rec.wav",
    "https://169.254.169.254/latest/meta-data/iam", "https://[fe80::1%25eth0]/x", "https://0.0.0.0/x",
    "https://2130706433/x", "https://0x7f.1/x", "https://[::ffff:127.0.0.1]/x", "https://[64:ff9b::a00:1]/x",
    "https://100.64.0.1/x", "https://192.168.1.1:8443/x", "https://metadata.google.internal/x",
    "https://user:secret@media.example.com/rec.wav", "https://user@media.example.com/rec.wav",
    "https://media.example.com:0/x", "https://media.example.com:65536/x", "https://media.example.com:22/x",
    "https://media.example.com:abc/x", "https://media.example.com:/x", "http://media.example.com/rec.wav",
    "file:///etc/passwd", "ftp://media.example.com/x", "gopher://127.0.0.1:25/x", "data:audio/wav;base64,AAAA",
    "javascript:alert(1)", "HTTPS://media.example.com/rec.wav", "S3://bucket/key", "s3://bucket/../../key",
    "s3://Bucket_Name/key", "s3:///key", "s3://bucket", "s3://bucket/", "s3://bucket/key?versionId=1",
    "s3://127.0.0.1/key", "https://exämple.com/x", "https://media.example.com/%2e%2e/%2e%2e/etc/passwd",
    "https://media.example.com/rec.wav?X-Amz-Signature=secret", "https://media.example.com\\@evil.com/x",
    "https://evil.com#@media.example.com/x", "https:///rec.wav", "https://", "", " https://a.com/x",
    "https://a.com/x\n", "https://" + "a" * 300 + ".com/x",
    f"s3://{RECORDINGS_BUCKET}/{RECORDINGS_PREFIX}missing.wav",
    f"s3://{RECORDINGS_BUCKET}/{RECORDINGS_PREFIX}not-audio.txt", "s3://no-such-bucket-here/clip.wav",
    # Out of the job's scope: the bucket root, another profile's prefix, a climb out of its own.
    f"s3://{RECORDINGS_BUCKET}/clip.wav",
    f"s3://{RECORDINGS_BUCKET}/recordings/665f1c2e9b1e8a0012ab9999/clip.wav",
    f"s3://{RECORDINGS_BUCKET}/{RECORDINGS_PREFIX}../665f1c2e9b1e8a0012ab9999/clip.wav",
    f"S3://{RECORDINGS_BUCKET}/{RECORDINGS_PREFIX}/clip.wav",
]


def valid_body(**overrides) -> dict:
    body = {
        "_doc": {"_id": JOB_ID}, "jobId": JOB_ID, "profileId": PROFILE_ID, "environment": "production",
        "metadata": {"directoryName": "user-123-voice-1", "language": "en"},
        "input": [{"recordingUrl": RECORDING, "originalText": "Hello there."}],
    }
    body.update(overrides)
    return body


json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(SQS_TEXT, max_size=20)
any_json = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(SQS_TEXT, max_size=8), inner, max_size=4), max_leaves=12)
huge_text = st.integers(10_000, 40_000).map(lambda n: "\u00e9" * n)
names = (st.sampled_from(PATH_TRICKS) | st.text(SQS_TEXT, max_size=12) | huge_text
         | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True))
field_values = names | any_json
urls = st.sampled_from(URLS) | st.just(RECORDING) | st.text(SQS_TEXT, max_size=40)
texts = st.sampled_from(["", "   ", "\x00", "a|b\nc\\d", "\u2028x\u2029", "Hello."]) | st.text(SQS_TEXT, max_size=30) | huge_text


@st.composite
def mutated_bodies(draw) -> dict:
    """A valid job with a few fields replaced, removed or given company."""
    body = valid_body()
    body["metadata"] = dict(body["metadata"])
    body["input"] = [dict(body["input"][0])]
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["jobId", "profileId", "environment", "_doc", "directoryName", "language",
                                      "metadata", "input", "url", "text", "extra", "drop", "more_inputs"]))
        if where in ("jobId", "profileId", "_doc", "metadata", "input"):
            body[where] = draw(field_values)
        elif where == "environment":
            body[where] = draw(st.sampled_from(["development", "staging", "prod", "production/../x", ""]) | field_values)
        elif where in ("directoryName", "language") and isinstance(body.get("metadata"), dict):
            body["metadata"][where] = draw(field_values)
        elif where == "url" and _first_input(body) is not None:
            _first_input(body)["recordingUrl"] = draw(urls | any_json)
        elif where == "text" and _first_input(body) is not None:
            _first_input(body)["originalText"] = draw(texts | any_json)
        elif where == "extra":
            body[draw(st.text(SQS_TEXT, min_size=1, max_size=10))] = draw(any_json)
        elif where == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif where == "more_inputs" and isinstance(body.get("input"), list):
            body["input"] = body["input"] + draw(st.lists(
                st.fixed_dictionaries({"recordingUrl": urls, "originalText": texts}), max_size=3))
    return body


@st.composite
def valid_variants(draw) -> dict:
    """Bodies that should train: safe names, any language code, unicode text, extra fields, several inputs."""
    safe = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", fullmatch=True)
    recording = st.fixed_dictionaries({"recordingUrl": st.just(RECORDING),
                                       "originalText": st.text(SQS_TEXT, min_size=1, max_size=60).filter(str.strip)})
    body = valid_body(environment=draw(st.sampled_from(["development", "staging", "production"])),
                      metadata={"directoryName": draw(safe),
                                "language": draw(st.from_regex(r"[a-z]{2,3}(-[A-Za-z0-9]{1,8}){0,2}", fullmatch=True))},
                      input=draw(st.lists(recording, min_size=1, max_size=3)))
    body.update(draw(st.dictionaries(st.text(SQS_TEXT, min_size=1, max_size=8).filter(lambda k: k not in body),
                                     any_json, max_size=2)))
    return body


def _first_input(body: dict) -> dict | None:
    items = body.get("input")
    return items[0] if isinstance(items, list) and items and isinstance(items[0], dict) else None


def deep(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


message_bodies = st.one_of(
    mutated_bodies().map(json.dumps),
    mutated_bodies().map(lambda b: json.dumps(b, ensure_ascii=False)),
    any_json.map(json.dumps),
    st.text(SQS_TEXT, max_size=200),
    st.integers(50, 50_000).map(deep),
    st.integers(50, 20_000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    valid_variants().map(lambda b: json.dumps(b, ensure_ascii=False)),
)

CORPUS = [
    "", " ", "null", "true", "0", "-1e999", "NaN", '"a string"', "[]", "{}", "{", '{"jobId": }', "\ufeff{}",
    deep(100_000), '{"a":' * 5_000 + "1" + "}" * 5_000,
    json.dumps(valid_body()),
    json.dumps(valid_body(jobId=None)), json.dumps(valid_body(jobId=12345)), json.dumps(valid_body(jobId=["x"])),
    json.dumps(valid_body(jobId="../../../../tmp/pwned")), json.dumps(valid_body(profileId="..")),
    json.dumps(valid_body(_doc="not an object")), json.dumps(valid_body(input=[])), json.dumps(valid_body(input={})),
    json.dumps(valid_body(environment="../../etc")), json.dumps(valid_body(environment=None)),
    json.dumps(valid_body(metadata={"directoryName": "../../escape"})),
    json.dumps(valid_body(metadata={"directoryName": "/abs/path"})),
    json.dumps(valid_body(metadata={"directoryName": "ok", "language": "--steps=1"})),
    json.dumps(valid_body(metadata={"directoryName": "x" * 100_000})),
    json.dumps(valid_body(input=[{"recordingUrl": RECORDING, "originalText": "x" * 200_000}])),
    json.dumps(valid_body(input=[{"recordingUrl": RECORDING, "originalText": "line\nbreak|pipe\\"}])),
    json.dumps(valid_body(input=[{"recordingUrl": RECORDING}])),
    json.dumps(valid_body(input=[{"recordingUrl": RECORDING, "originalText": "ok"}] * 50)),
    json.dumps(valid_body(__proto__={"polluted": True}, constructor={"prototype": 1})),
    *(json.dumps(valid_body(input=[{"recordingUrl": url, "originalText": "Hi."}])) for url in URLS),
    *(json.dumps(valid_body(metadata={"directoryName": name})) for name in PATH_TRICKS),
]
