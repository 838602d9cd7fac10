"""Redaction never shows credentials or query text, however the URL is malformed."""

from datetime import UTC

import pytest

from worker.core.logs import scrub
from worker.core.redact import redact_secrets, redact_text, redact_url, strip_control


@pytest.mark.parametrize("url,shown", [
    ("https://h.example/a.wav?X-Amz-Signature=s3cr3t", "https://h.example/a.wav"),
    ("https://user:pw@h.example/a", "https://h.example/a"),
    ("https://h?token=abc@def/p", "https://<redacted>"),
    ("https://u:p?w@h/a", "https://<redacted>"),
    ("s3://bucket/key#frag", "s3://bucket/key"),
])
def test_redacted_forms(url, shown):
    """Each URL is shown as scheme://host/path, or not at all when no reading is safe."""
    assert redact_url(url) == shown
    assert "s3cr3t" not in redact_url(url) and "abc" not in redact_url(url) and "pw" not in redact_url(url)


@pytest.mark.parametrize("text,shown", [
    ("mongodb://voice:hunter2@mongo.internal:27017/voice", "mongodb://***@mongo.internal:27017/voice"),
    ("uri mongodb+srv://u:p@ss@cluster0.x.net/db?w=1 failed", "uri mongodb+srv://***@cluster0.x.net/db?w=1 failed"),
    ("postgres://app:hunter2@db:5432/x", "postgres://***@db:5432/x"),
    ("redis://:hunter2@cache:6379/0", "redis://***@cache:6379/0"),
    ("https://hunter2@github.com/org/repo.git", "https://***@github.com/org/repo.git"),
])
def test_userinfo_of_any_scheme_is_masked(text, shown):
    """redact_secrets replaces the userinfo of a URL of any scheme with ***, keeping host and path."""
    assert redact_secrets(text) == shown


@pytest.mark.parametrize("text,shown", [
    ("key id AKIAIOSFODNN7EXAMPLE, session ASIAY34FZKBOKMUTVV7A", "key id ***, session ***"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "aws_secret_access_key = ***"),
    ("AWS_SESSION_TOKEN=FQoGZXIvYXdzEJr//////////wEaDM", "AWS_SESSION_TOKEN=***"),
    ('{"password": "hunter2", "user": "voice"}', '{"password": "***", "user": "voice"}'),
    ("GET /a.wav?X-Amz-Signature=abc123&X-Amz-Credential=AK%2F1 503", "GET /a.wav?X-Amz-Signature=***&X-Amz-Credential=*** 503"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9", "Authorization: Bearer ***"),
    ("step 3 max_tokens=512 speaker_key: 2 loss=0.31", "step 3 max_tokens=512 speaker_key: 2 loss=0.31"),
])
def test_well_known_secret_shapes_are_masked_and_ordinary_text_kept(text, shown):
    """AWS key ids, secret-named assignments and bearer tokens are masked; trainer metrics are not."""
    assert redact_secrets(text) == shown


def test_redact_text_cuts_urls_and_masks_secrets():
    """redact_text, used for a failed stage's message, leaves neither a query, userinfo nor a key id."""
    text = "fetch https://b.s3.amazonaws.com/k?X-Amz-Signature=s3cr3t via mongodb://u:pw@h/db key AKIAIOSFODNN7EXAMPLE"
    assert redact_text(text) == "fetch https://b.s3.amazonaws.com/k via mongodb://h/db key ***"


def test_log_scrub_masks_userinfo_of_any_scheme():
    """The log and DLQ scrubber no longer lets mongodb://user:pass@ or AWS keys through."""
    text = scrub("connect mongodb://voice:hunter2@mongo.internal/voice failed; AKIAIOSFODNN7EXAMPLE")
    assert "hunter2" not in text and "AKIAIOSFODNN7EXAMPLE" not in text and "mongo.internal/voice" in text


def test_a_recorded_error_and_a_dead_letter_never_carry_a_credential():
    """Whatever text an error carries, the job record and the DLQ attribute get it redacted."""
    from datetime import datetime

    from worker.core.errors import UnexpectedError
    from worker.core.queue import Message, dead_letter_attributes
    from worker.voice.records.rules import errored

    text = "unexpected ServerSelectionTimeoutError: mongodb://voice:hunter2@db.internal:27017/voice timed out"
    record = errored({"_id": "j"}, token=None, error_type="UnexpectedError", message=text, retryable=True,
                     now=datetime.now(UTC))
    attributes = dead_letter_attributes(Message("m", "-", "{}", 3, 0.0), UnexpectedError(text), "q")
    for stored in (record["error"]["message"], attributes["ErrorMessage"]["StringValue"]):
        assert "hunter2" not in stored and "db.internal" in stored


ESCAPES = "\x1b[2J\x1b[H" + "\x1b]0;owned\x07" + "boom" + "\x9b31m" + "\x1b]2;t\x1b\\" + "\x85"


@pytest.mark.parametrize("text,shown", [
    ("a\x1b[2Jb", "ab"),                                   # clear the screen
    ("x\x1b]0;retitled\x07y", "xy"),                       # OSC retitle, BEL-terminated
    ("x\x1b]2;retitled\x1b\\y", "xy"),                     # OSC retitle, ST-terminated
    ("stage failed\rjob 1: completed", "stage failed\njob 1: completed"),  # a CR-forged line
    ("c1\x9b2Jcsi and \x85nel", "c1csi and nel"),          # C1 CSI and a C1 control
    ("keep\ttabs\nand lines", "keep\ttabs\nand lines"),
    ("bell\x07 nul\x00 del\x7f \u202eflip", "bell nul del flip"),
])
def test_strip_control_drops_what_a_terminal_would_act_on(text, shown):
    """Escape sequences, C0/C1 controls and bidi overrides go; tabs and newlines stay; a CR becomes a newline."""
    assert strip_control(text) == shown


def test_strip_control_on_one_line_joins_everything():
    """With keep_lines false a stage's text becomes a single line: no CR or newline can start a forged one."""
    assert strip_control("a\r\nb\rc\td", keep_lines=False) == "a b c d"


def test_recorded_messages_logs_and_scrubbed_text_carry_no_control_characters():
    """redact_text (records, DLQ attributes) and scrub (logs, Sentry, dlq list) both strip them."""
    for shown in (redact_text(ESCAPES), scrub(ESCAPES)):
        assert shown == "boom"


@pytest.mark.parametrize("text,shown", [
    ("https://u:p'w@h.example/a", "https://h.example/a"),                    # a quote in the password
    ("https://h.example/a?name=O'Brien&sig=s3cr3t", "https://h.example/a"),  # a quote in the query
    ("https://u:p?w@h.example/a", "https://<redacted>"),                     # '?' before the '@'
    ("ftp://h.example/a?sig=s3cr3t", "ftp://h.example/a"),                   # any scheme
    ("mongodb://u:pw@h/db?w=s3cr3t", "mongodb://h/db"),
    ('{"url": "https://h.example/a?sig=s3cr3t", "n": 1}', '{"url": "https://h.example/a", "n": 1}'),
    ("(see <https://h.example/a?sig=s3cr3t>).", "(see <https://h.example/a>)."),
])
def test_logs_records_and_dead_letters_share_one_reading_of_a_url(text, shown):
    """The log scrub is redact_text: a URL runs to whitespace, and only its closing punctuation is kept."""
    assert scrub(text) == redact_text(text) == shown
