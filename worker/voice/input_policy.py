"""What one job may ask for beyond the schema: where its s3:// recordings may live, and how much input.

The worker reads s3:// recordings with its own credentials, so without a scope a message could name
any object those credentials reach (another user's recordings, or the trained models). The policy is
built once from the settings (``Settings.input_policy``) and handed to ``parse_job``; every rule here
is a pure function of the policy and the message. A leaf module: ``worker.voice.message`` imports it,
never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.recording_url import S3, RecordingUrl
from worker.core.redact import show
from worker.voice.languages import LanguageTable

# The most one SQS message can carry: anything bigger never came from the queue, and is not parsed.
SQS_MAX_BODY_BYTES = 1024 * 1024
PROFILE_PLACEHOLDER = "{profileId}"
DEFAULT_KEY_PREFIX = "recordings/{profileId}/"


def key_prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` (RECORDINGS_S3_KEY_PREFIX) could let a job read another profile's keys, or None."""
    rest = prefix.replace(PROFILE_PLACEHOLDER + "/", "")
    segments = prefix.split("/")[:-1]  # what follows the last "/" is a key's name prefix: may be empty
    # The "/" after the placeholder matters: without it profile "ab" could read the keys of profile "abc".
    if (PROFILE_PLACEHOLDER + "/" not in prefix or "{" in rest or "}" in rest
            or any(seg in ("", ".", "..") for seg in segments)):
        return ("must contain \"{profileId}/\" and no other placeholder and no empty, \".\" or \"..\" "
                "segment, so a job can only read its own profile's recordings")
    return None


@dataclass(frozen=True, slots=True)
class InputPolicy:
    """The limits ``parse_job`` enforces. ``InputPolicy()`` is what the settings' defaults give."""

    # None refuses every s3:// recording: there is no bucket a job may read from.
    recordings_bucket: str | None = None
    recordings_key_prefix: str = DEFAULT_KEY_PREFIX
    # None: no cap (SHAPE_ONLY); the body size cap always applies.
    max_recordings: int | None = 500
    max_text_chars: int | None = 2000
    # False only for SHAPE_ONLY: where s3:// recordings live is then not checked at all.
    scope_s3: bool = True
    # The languages the trainers accept (worker/voice/languages.json); None: any well-formed code (the
    # reference trainer reads every language alike).
    languages: LanguageTable | None = None

    def __post_init__(self) -> None:
        # The settings' rule, for a policy built by hand (tests, tools) rather than from the settings.
        if self.scope_s3 and (problem := key_prefix_problem(self.recordings_key_prefix)):
            raise ValueError(f"recordings_key_prefix={self.recordings_key_prefix!r} {problem}")

    def key_prefix_for(self, profile_id: str) -> str:
        return self.recordings_key_prefix.replace(PROFILE_PLACEHOLDER, profile_id)

    def recording_url_problem(self, url: RecordingUrl, profile_id: str | None) -> str | None:
        """Why this parsed recording URL is out of bounds for ``profile_id``'s job, or None.

        ``profile_id`` is None when the message's own profileId is unusable (reported on its own):
        the bucket and the key's segments are still checked, the per-profile prefix cannot be.
        """
        if not self.scope_s3 or url.scheme != S3:  # the parse lower-cased it: "S3://" is s3 too
            return None
        if self.recordings_bucket is None:
            return "s3:// recordings are refused: RECORDINGS_S3_BUCKET is not configured"
        bucket, key = url.bucket, url.key
        if bucket != self.recordings_bucket:
            return (f"s3:// recordings must be in bucket {self.recordings_bucket!r} "
                    f"(RECORDINGS_S3_BUCKET), got {show(bucket)}")
        if any(segment in ("", ".", "..") for segment in key.split("/")):
            # S3 keys are literal, but a client or proxy that normalises paths would not read them so.
            return "S3 key must not have empty, '.' or '..' path segments"
        if profile_id is None:
            return None
        prefix = self.key_prefix_for(profile_id)
        if not key.startswith(prefix):
            return (f"S3 key must start with {show(prefix)} "
                    "(RECORDINGS_S3_KEY_PREFIX for this job's profileId)")
        if key == prefix:
            return "S3 key names the recordings prefix alone, not a recording"
        return None

    def recordings_count_problem(self, count: int) -> str | None:
        if self.max_recordings is not None and count > self.max_recordings:
            return (f"must list at most {self.max_recordings} recordings (MAX_RECORDINGS_PER_JOB), "
                    f"got {count}")
        return None

    def language_problem(self, language: str) -> str | None:
        return None if self.languages is None else self.languages.problem(language)

    def text_length_problem(self, text: str) -> str | None:
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            return f"must be at most {self.max_text_chars} characters (MAX_TEXT_CHARS), got {len(text)}"
        return None


# The schema and the body size only: for tools whose output the worker validates again with its own
# policy (the reconciler re-sending a stored body). Never the worker's policy.
SHAPE_ONLY = InputPolicy(max_recordings=None, max_text_chars=None, scope_s3=False)


def body_size_problem(body: str | bytes) -> str | None:
    """Why ``body`` is too big to be an SQS message, or None; never encodes more than the cap allows."""
    if isinstance(body, str):
        # UTF-8 never takes fewer bytes than characters: a long text is too big without encoding it.
        size = len(body) if len(body) > SQS_MAX_BODY_BYTES else len(body.encode("utf-8", "surrogatepass"))
    else:
        size = len(body)
    if size > SQS_MAX_BODY_BYTES:
        return f"body: larger than {SQS_MAX_BODY_BYTES} bytes, the most one SQS message can carry"
    return None
