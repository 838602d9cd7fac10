"""URL redaction: the forms of a URL that may appear in an error message, a record or a log line.

Recording URLs may be presigned (credentials in the query string) or carry userinfo, so what is
shown of a URL is its scheme, host, port and path: never its userinfo, query or fragment.

The verbs: ``redact_url`` reads any text that looks like a URL, however broken, because it echoes
what a client sent; ``redact_urls_in_text`` applies it to every URL in free text; ``show`` is the
short, quoted echo of a rejected value; ``withhold`` cuts known secrets (a parsed URL's query) out
of a third party's text; ``redact_secrets`` and ``redact_text`` are below. A recording URL that
parsed shows itself (``pipeline.recording_url.RecordingUrl.redacted``): the host it will connect to.

Free text that did not come from us (a stage's log tail, a library's error) may hold credentials in
other shapes too; ``redact_secrets`` masks the well-known ones: userinfo in a URL of any scheme
(``mongodb+srv://user:pass@`` becomes ``mongodb+srv://***@``), AWS access key ids, bearer tokens,
and the value of any ``name=value`` / ``name: value`` whose name says secret, password, credential,
token, signature or api/access/private key. ``redact_text`` does both, for text that leaves the
worker (a failed stage's message), after ``strip_control``. It masks shapes, not the worker's own
secret values: stages never receive those (``pipeline.stage_env``), so a stage cannot print them,
and a list of them here would be one more place that holds them.

Text from a stage also reaches terminals (``status``, console logs, ``dlq list``), so
``strip_control`` drops what a terminal would act on instead of showing: escape sequences (clear the
screen, retitle the window, recolour), C0 and C1 control characters, and a carriage return, which
would move the cursor back to overwrite a line with a forged one (it becomes a line break instead).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

MAX_SHOWN_CHARS = 80
_QUERY_START = re.compile(r"[?#]")
# A URL in free text runs to the next whitespace, quotes and brackets included: a password or a query
# may hold a quote, and cutting there would leave the rest of it in view. Closing punctuation at its
# very end (a quote, a bracket, a comma) is the surrounding text's, and is put back after redaction.
_URL_IN_TEXT = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://\S*")
_AFTER_URL = "\"'<>)]}.,;:!"
MASK = "***"
# Greedy up to the last '@' before the host, so a password holding an unescaped '@' is covered too.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#\"'<>]*@")
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")
# A name containing secret/password/credential, or ending in token, signature or an api/access/...
# key ("max_tokens=512" and "speaker_key: 3" are left alone).
_ASSIGNMENT = re.compile(
    r"(?i)\b([\w.-]*(?:secret|passw(?:or)?d|credential)[\w.-]*"
    r"|[\w.-]*(?:token|signature|(?:api|access|private|session|auth|signing)[_-]?key))"
    r"(?![\w.-])([\"']?\s*[:=]\s*[\"']?)([^\s\"'&,;]+)"
)


# CSI sequences (ESC [ or the C1 CSI, up to a final byte); OSC, DCS, SOS, PM and APC strings up to
# their terminator (BEL or ST; unterminated: the rest, as a terminal would swallow it); any other
# escape (ESC c, ESC 7, ESC ( B).
_ESCAPE_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?"
)
# C0 but tab and newline, DEL, C1, and the bidirectional overrides that reorder what a line shows.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CARRIAGE_RETURN = re.compile(r"\r\n?")


def strip_control(text: str, *, keep_lines: bool = True) -> str:
    """``text`` as a terminal would show it, minus anything a terminal would act on. Never raises.

    Escape sequences and control characters are dropped; a carriage return becomes a line break.
    With ``keep_lines`` false, line breaks and tabs become spaces too: one line, whatever it held.
    """
    try:
        text = _CONTROL.sub("", _CARRIAGE_RETURN.sub("\n", _ESCAPE_SEQUENCE.sub("", str(text))))
        return text if keep_lines else text.replace("\n", " ").replace("\t", " ")
    except Exception:  # noqa: BLE001 - like redaction, never the thing that fails
        return "<text withheld: control characters>"


def redact_url(url: str) -> str:
    """``scheme://host[:port]/path``: no userinfo, query or fragment. Never raises."""
    try:
        scheme, sep, rest = str(url).partition("://")
        if not sep:
            scheme, rest = "", str(url)
        start = f"{scheme}://" if sep else ""
        authority, slash, path = rest.partition("/")
        if "@" in authority and _QUERY_START.search(authority):
            # Credentials or a query holding '@' (https://u:p?w@h, https://h?t=a@b): no reading of
            # it is safe to show.
            return start + "<redacted>"
        # Anything before an '@' in the authority is (meant as) credentials, even if malformed.
        authority = authority.rpartition("@")[2]
        if _QUERY_START.search(authority):  # the query began before any path
            return start + _QUERY_START.split(authority, maxsplit=1)[0]
        return start + authority + slash + _QUERY_START.split(path, maxsplit=1)[0]
    except Exception:  # noqa: BLE001 - redaction must never be the thing that fails
        return "<url>"


def redact_urls_in_text(text: str) -> str:
    """Every URL inside free text (e.g. a botocore error) reduced by ``redact_url``."""
    return _URL_IN_TEXT.sub(_redact_found_url, text)


def _redact_found_url(match: re.Match) -> str:
    found = match.group(0)
    url = found.rstrip(_AFTER_URL)  # rstrip, not a regex look-ahead: linear however long the run
    return redact_url(url) + found[len(url):]


def withhold(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` (a URL's query and fragment, say) replaced by ``<redacted>``.

    Third-party exception messages sometimes quote the request target; this makes them safe to keep.
    The longest secret goes first, so one that contains another is cut out whole.
    """
    for secret in sorted(set(secrets) - {""}, key=len, reverse=True):
        text = text.replace(secret, "<redacted>")
    return text


def show(value: object) -> str:
    """A short, quoted, escaped echo of a rejected value, with any URL in it redacted."""
    text = redact_urls_in_text(value if isinstance(value, str) else json.dumps(value, default=str))
    if len(text) > MAX_SHOWN_CHARS:
        text = text[: MAX_SHOWN_CHARS - 1] + "…"
    return repr(text)


def redact_secrets(text: str) -> str:
    """``text`` with credential-shaped parts masked (see the module docstring). Never raises."""
    try:
        text = _USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)
        text = _AWS_KEY_ID.sub(MASK, text)
        text = _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", text)
        return _ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    except Exception:  # noqa: BLE001 - redaction must never be the thing that fails
        return "<text withheld: redaction failed>"


def redact_text(text: str) -> str:
    """Free text made safe to store and report: no control characters, URLs cut to
    scheme://host/path, secrets masked. Stripped first, so an escape cannot split a secret's shape."""
    return redact_secrets(redact_urls_in_text(strip_control(text)))
