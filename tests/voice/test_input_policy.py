"""The input policy: s3:// recordings only from the configured bucket and the job's own profile prefix,
capped recordings, texts and body size, in parse_job, the handler, submit and the app's wiring."""

from __future__ import annotations

import json

import pytest

from tests.voice.conftest import JOB_ID, PROFILE_ID, message_body
from worker.core.errors import InvalidMessage
from worker.settings import load_settings
from worker.voice import message as message_module
from worker.voice.input_policy import SHAPE_ONLY, SQS_MAX_BODY_BYTES, InputPolicy
from worker.voice.message import job_id_hint, parse_job

RECORDINGS = "voice-recordings"
OWN_KEY = f"recordings/{PROFILE_ID}/take-1.wav"
SCOPED = InputPolicy(recordings_bucket=RECORDINGS)


def body_with(url: str = f"s3://{RECORDINGS}/{OWN_KEY}", text: str = "Hello there.", count: int = 1) -> str:
    return message_body(input=[{"recordingUrl": url, "originalText": text}] * count)


def only_problem(body: str, policy: InputPolicy) -> str:
    with pytest.raises(InvalidMessage) as info:
        parse_job(body, policy)
    assert len(info.value.problems) == 1, info.value.problems
    return info.value.problems[0]


# ---------------------------------------------------------------- A: where s3:// recordings may live


def test_policy_from_default_settings_is_the_default_policy():
    """InputPolicy() is exactly what the settings' defaults build, so a handler's default is never looser."""
    assert load_settings({}).input_policy() == InputPolicy()


def test_s3_recording_refused_when_no_recordings_bucket_is_configured():
    """With RECORDINGS_S3_BUCKET unset every s3:// recording is refused with a line saying so."""
    policy = load_settings({}).input_policy()
    assert only_problem(body_with(), policy) == (
        "input[0].recordingUrl: s3:// recordings are refused: RECORDINGS_S3_BUCKET is not configured")


def test_s3_recording_under_the_jobs_own_profile_prefix_is_accepted():
    """A recording in the configured bucket under recordings/<the message's profileId>/ parses."""
    policy = load_settings({"RECORDINGS_S3_BUCKET": RECORDINGS}).input_policy()
    job = parse_job(body_with(), policy)
    assert (job.recordings[0].url.bucket, job.recordings[0].url.key) == (RECORDINGS, OWN_KEY)


def test_https_recordings_are_not_scoped():
    """An https:// recording is fetched without the worker's credentials, so the S3 scope does not apply."""
    assert parse_job(message_body(), InputPolicy()).recordings[0].url.scheme == "https"


OUT_OF_SCOPE = {
    "other-bucket": (f"s3://voice-models/{OWN_KEY}", "s3:// recordings must be in bucket 'voice-recordings' "
                                                     "(RECORDINGS_S3_BUCKET), got 'voice-models'"),
    "uppercase-scheme": (f"S3://voice-models/{OWN_KEY}", "s3:// recordings must be in bucket"),
    "other-profile": (f"s3://{RECORDINGS}/recordings/665f1c2e9b1e8a0012ab9999/take-1.wav", "must start with"),
    "profile-id-extended": (f"s3://{RECORDINGS}/recordings/{PROFILE_ID}0/take-1.wav", "must start with"),
    "outside-prefix": (f"s3://{RECORDINGS}/models/production/{PROFILE_ID}/{JOB_ID}/full/model.pth",
                       "must start with"),
    "dotdot": (f"s3://{RECORDINGS}/recordings/{PROFILE_ID}/../665f1c2e9b1e8a0012ab9999/a.wav", "'..'"),
    "dot": (f"s3://{RECORDINGS}/recordings/{PROFILE_ID}/./a.wav", "'.'"),
    "empty-segment": (f"s3://{RECORDINGS}/recordings/{PROFILE_ID}//a.wav", "empty"),
    "prefix-alone": (f"s3://{RECORDINGS}/recordings/{PROFILE_ID}/", "empty"),
    "profile-dir-no-slash": (f"s3://{RECORDINGS}/recordings/{PROFILE_ID}", "must start with"),
}


@pytest.mark.parametrize(("url", "expected"), list(OUT_OF_SCOPE.values()), ids=list(OUT_OF_SCOPE))
def test_s3_recording_outside_the_jobs_scope_is_refused(url, expected):
    """Another bucket, another profile's prefix, a path trick or the prefix alone: one InvalidMessage line."""
    line = only_problem(body_with(url), SCOPED)
    assert line.startswith("input[0].recordingUrl: ") and expected in line


def test_prefix_alone_is_refused_for_a_prefix_that_ends_mid_name():
    """With a prefix like recordings/{profileId}/take- the key equal to the prefix names no recording."""
    policy = InputPolicy(recordings_bucket=RECORDINGS, recordings_key_prefix="recordings/{profileId}/take-")
    url = f"s3://{RECORDINGS}/recordings/{PROFILE_ID}/take-"
    assert only_problem(body_with(url), policy).endswith("names the recordings prefix alone, not a recording")
    assert parse_job(body_with(f"{url}1.wav"), policy).recordings


def test_key_prefix_setting_is_applied_with_the_profile_id():
    """RECORDINGS_S3_KEY_PREFIX decides the prefix, with {profileId} replaced by the message's profileId."""
    policy = load_settings({
        "RECORDINGS_S3_BUCKET": RECORDINGS, "RECORDINGS_S3_KEY_PREFIX": "tenants/acme/{profileId}/audio/"}).input_policy()
    assert parse_job(body_with(f"s3://{RECORDINGS}/tenants/acme/{PROFILE_ID}/audio/a.wav"), policy).recordings
    assert "'tenants/acme/" in only_problem(body_with(), policy)


def test_a_hand_built_policy_needs_the_profile_placeholder():
    """A policy whose prefix lacks "{profileId}/" cannot be built: every profile would share one prefix."""
    with pytest.raises(ValueError, match="profileId"):
        InputPolicy(recordings_bucket=RECORDINGS, recordings_key_prefix="recordings/")


def test_without_a_policy_parse_job_checks_the_shape_only():
    """The default policy (for tools the worker re-checks, such as the reconciler) leaves s3:// scope alone."""
    assert parse_job(body_with("s3://any-bucket/any/key.wav")).recordings
    assert parse_job(body_with(count=600)) is not None and SHAPE_ONLY.max_recordings is None


# ---------------------------------------------------------------- B: how much one message may ask for


def test_too_many_recordings_is_one_line_with_the_count():
    """More input entries than MAX_RECORDINGS_PER_JOB is refused with one line; exactly the cap is fine."""
    policy = load_settings({"MAX_RECORDINGS_PER_JOB": "3"}).input_policy()
    assert len(parse_job(message_body(input=[{"recordingUrl": "https://m.example.com/a.wav",
                                              "originalText": "Hi."}] * 3), policy).recordings) == 3
    body = message_body(input=[{"recordingUrl": "https://m.example.com/a.wav", "originalText": " "}] * 4)
    assert only_problem(body, policy) == "input: must list at most 3 recordings (MAX_RECORDINGS_PER_JOB), got 4"


def test_default_recordings_cap_is_500():
    """The default policy refuses 501 recordings and accepts 500."""
    entry = {"recordingUrl": "https://m.example.com/a.wav", "originalText": "Hi."}
    assert len(parse_job(message_body(input=[entry] * 500), InputPolicy()).recordings) == 500
    assert "got 501" in only_problem(message_body(input=[entry] * 501), InputPolicy())


def test_too_long_text_is_refused_without_echoing_it():
    """An originalText over MAX_TEXT_CHARS gets one line with its length, never the text itself."""
    policy = load_settings({"MAX_TEXT_CHARS": "10"}).input_policy()
    assert parse_job(message_body(input=[{"recordingUrl": "https://m.example.com/a.wav",
                                          "originalText": "x" * 10}]), policy)
    text = "confidential" * 3
    body = message_body(input=[{"recordingUrl": "https://m.example.com/a.wav", "originalText": text}])
    line = only_problem(body, policy)
    assert line == "input[0].originalText: must be at most 10 characters (MAX_TEXT_CHARS), got 36"
    assert "confidential" not in line


def test_default_text_cap_is_2000_characters():
    """The default policy refuses a 2001-character originalText."""
    assert "got 2001" in only_problem(body_with("https://m.example.com/a.wav", "y" * 2001), InputPolicy())


@pytest.mark.parametrize("kind", ["text", "bytes", "multibyte-text"])
def test_body_over_the_sqs_limit_is_refused_before_parsing(kind, monkeypatch):
    """A body over 1 MiB (bytes, not characters) is InvalidMessage without being handed to json.loads."""
    padding = {"text": "a" * SQS_MAX_BODY_BYTES, "bytes": "a" * SQS_MAX_BODY_BYTES,
               "multibyte-text": "\u00e9" * (SQS_MAX_BODY_BYTES // 2 + 1)}[kind]
    body = message_body()[:-1] + f', "padding": "{padding}"}}'  # unescaped, as a producer may send it
    if kind == "bytes":
        body = body.encode()
    assert kind != "multibyte-text" or len(body) < SQS_MAX_BODY_BYTES  # over in bytes only

    def no_parse(*_a, **_kw):
        raise AssertionError("an oversized body was parsed")

    monkeypatch.setattr(message_module.json, "loads", no_parse)
    assert only_problem(body, InputPolicy()) == (
        f"body: larger than {SQS_MAX_BODY_BYTES} bytes, the most one SQS message can carry")
    assert job_id_hint(body) is None


def test_body_just_under_the_sqs_limit_is_parsed():
    """A body of exactly 1 MiB is parsed as usual (the cap is SQS's, not lower)."""
    body = message_body(padding="")
    body = message_body(padding="a" * (SQS_MAX_BODY_BYTES - len(body.encode())))
    assert len(body.encode()) == SQS_MAX_BODY_BYTES
    assert parse_job(body, InputPolicy()).job_id == JOB_ID


# ---------------------------------------------------------------- the policy where messages arrive


def test_handler_dead_letters_another_profiles_recording_without_work(queues, make_worker, store, s3, train,
                                                                      tmp_path, raw_store):
    """The handler applies its injected policy: another profile's s3:// key is dead-lettered, untrained."""
    from tests.voice.conftest import BUCKET
    from worker.voice.artifacts import ArtifactUploader
    from worker.voice.job import HandlerConfig, VoiceJobHandler

    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w", lease_s=2,
                                            policy=SCOPED),
                              store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)
    worker, _ = make_worker(handler)
    queues.send(body_with(f"s3://{RECORDINGS}/recordings/665f1c2e9b1e8a0012ab9999/take-1.wav"))
    assert worker.run_once() == "dead_letter"
    assert train.runs == 0
    assert raw_store.get_job(JOB_ID)["status"] == "pending", "a refused body changed the job it names"
    [dead] = queues.receive_now(queues.dlq_url)
    assert "must start with" in dead["MessageAttributes"]["ErrorMessage"]["StringValue"]


def test_handler_without_a_policy_refuses_s3_recordings(queues, make_worker, handler, train):
    """A handler built without a policy is not more open than the default settings: s3:// is refused."""
    worker, _ = make_worker(handler)
    queues.send(body_with())
    assert worker.run_once() == "dead_letter" and train.runs == 0


def test_the_app_gives_the_handler_the_settings_policy_and_file_retention(queues, tmp_path):
    """build_app hands the handler settings.input_policy() and KEEP_WORK_FILES."""
    from worker.app import build_app

    settings = load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        "RECORDINGS_S3_BUCKET": RECORDINGS, "MAX_TEXT_CHARS": "7", "KEEP_WORK_FILES": "true"})
    app = build_app(settings)
    try:
        handler = app.worker._handler
        assert handler.config.policy == settings.input_policy()
        assert handler.config.policy.recordings_bucket == RECORDINGS and handler.config.keep_work_files is True
    finally:
        app.close()


def test_submit_with_the_worker_policy_refuses_before_recording_or_sending(queues, tmp_path):
    """submit(policy=...) refuses what the worker would refuse: no record is created and nothing is sent."""
    from worker.voice.records.sqlite import SqliteStore
    from worker.voice.submit import submit

    payload = json.loads(body_with(f"s3://{RECORDINGS}/recordings/665f1c2e9b1e8a0012ab9999/a.wav"))
    for key in ("jobId", "_doc"):
        payload.pop(key)
    with SqliteStore(str(tmp_path / "records.db")) as store:
        with pytest.raises(InvalidMessage, match="must start with"):
            submit(store, queues.sqs, queues.url, payload, policy=SCOPED)
        assert store.get_profile(PROFILE_ID) is None
    assert queues.receive_now() == []
