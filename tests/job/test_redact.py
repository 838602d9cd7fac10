"""Redaction never shows credentials or query text, however the URL is malformed."""

import pytest

from worker.redact import redact_url


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
