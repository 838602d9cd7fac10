"""Settings are validated once, at start, with one readable line per problem."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import MISSING

import pytest

from worker.core.core_config import Backoff, LeaseTimings
from worker.core.errors import ConfigError
from worker.core.faults import CrashPoint
from worker.settings import ENV_NAMES, FIELD_OF_ENV, daemon_problems, daemon_targets, load_settings

BAD = [
    ({"SQS_VISIBILITY_TIMEOUT_SECONDS": "60", "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "60000"},
     "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=60000 must be shorter than SQS_VISIBILITY_TIMEOUT_SECONDS=60"),
    ({"SQS_WAIT_TIME_SECONDS": "21"}, "SQS_WAIT_TIME_SECONDS=21: must be at most 20"),
    ({"SQS_WAIT_TIME_SECONDS": "-1"}, "SQS_WAIT_TIME_SECONDS=-1: must be at least 0"),
    ({"MAX_FAILED_ATTEMPTS": "0"}, "MAX_FAILED_ATTEMPTS=0: must be at least 1"),
    ({"SQS_RETRY_VISIBILITY_BASE_SECONDS": "1000"},
     "SQS_RETRY_VISIBILITY_BASE_SECONDS=1000 must not exceed SQS_RETRY_VISIBILITY_MAX_SECONDS=900"),
    ({"SQS_VISIBILITY_TIMEOUT_SECONDS": "43201"},
     "SQS_VISIBILITY_TIMEOUT_SECONDS=43201: must be at most 43200"),
    ({"JOB_TIME_LIMIT_SECONDS": "43000"},
     "JOB_TIME_LIMIT_SECONDS=43000 plus SQS_VISIBILITY_TIMEOUT_SECONDS=300 exceeds the 43200 s"),
    ({"SQS_VISIBILITY_TIMEOUT_SECONDS": "soon"},
     "SQS_VISIBILITY_TIMEOUT_SECONDS=soon: must be a whole number"),
    ({"LOG_FORMAT": "xml"}, "LOG_FORMAT=xml: must be one of json, console"),
    ({"MONGO_URI": "mongodb://h", "STORE_URL": "sqlite:///x.db"}, "MONGO_URI and STORE_URL are both set"),
    ({"STORE_URL": "postgres://x"}, "STORE_URL must look like sqlite:///path/to/file.db"),
    ({"STORE_URL": "sqlite:///"}, "STORE_URL must look like sqlite:///path/to/file.db, got 'sqlite:///'"),
    ({"STORE_URL": "sqlite:///x.db?mode=ro"}, "STORE_URL must look like sqlite:///path/to/file.db"),
    ({"METRICS_DIMENSIONS": "Environment"}, "METRICS_DIMENSIONS: 'Environment' is not Name=Value"),
    ({"STAGE_ENV_PASSTHROUGH": "HF_HOME,9X"}, "STAGE_ENV_PASSTHROUGH: '9X' is not an environment variable name"),
    ({"VOICE_WORKER_CRASH_AT": "later"}, "VOICE_WORKER_CRASH_AT=later is not one of after_receive, "),
    ({"RECORDINGS_S3_KEY_PREFIX": "recordings/{profileId}"},
     "RECORDINGS_S3_KEY_PREFIX='recordings/{profileId}' must contain \"{profileId}/\""),
    ({"RECORDINGS_S3_KEY_PREFIX": "x}/{profileId}/"}, "RECORDINGS_S3_KEY_PREFIX='x}/{profileId}/' must contain"),
    ({"RECORDINGS_S3_KEY_PREFIX": "a//{profileId}/"}, "RECORDINGS_S3_KEY_PREFIX='a//{profileId}/' must contain"),
    ({"WORK_ROOT": "/w", "MODELS_ROOT": "/w/models"}, "MODELS_ROOT=/w/models must not be WORK_ROOT or a directory below"),
    ({"WORK_ROOT": "/w", "MODELS_ROOT": "/w"}, "MODELS_ROOT=/w must not be WORK_ROOT"),
    ({"WORK_ROOT": "/w/work", "MODELS_ROOT": "/w"}, "MODELS_ROOT=/w must not hold WORK_ROOT=/w/work"),
]


@pytest.mark.parametrize("env,line", BAD, ids=[b[1].split("=")[0].split(" ")[0] for b in BAD])
def test_each_bad_setting_has_its_own_line(env, line):
    """Each invalid setting or combination is rejected with its own readable line."""
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(line)


def test_models_root_defaults_below_work_root_and_may_live_elsewhere():
    """MODELS_ROOT defaults to <WORK_ROOT>/.models; a dot name below WORK_ROOT or a path outside it is fine."""
    assert load_settings({"WORK_ROOT": "/w"}).models_root_path == "/w/.models"
    assert load_settings({"WORK_ROOT": "/w", "MODELS_ROOT": "/w/.published"}).models_root_path == "/w/.published"
    assert load_settings({"WORK_ROOT": "/w", "MODELS_ROOT": "/srv/models"}).models_root_path == "/srv/models"


def test_several_problems_give_several_lines():
    """Three independent cross-setting problems give three lines."""
    with pytest.raises(ConfigError) as info:
        load_settings({
            "SQS_VISIBILITY_TIMEOUT_SECONDS": "30", "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "30000",
            "SQS_RETRY_VISIBILITY_BASE_SECONDS": "1000", "JOB_TIME_LIMIT_SECONDS": "43200",
        })
    assert len(info.value.problems) == 3


def test_defaults_match_the_design():
    """With nothing set, the documented defaults apply."""
    s = load_settings({})
    assert (s.sqs_visibility_timeout_s, s.heartbeat_interval_s, s.sqs_wait_time_s) == (300, 60.0, 20)
    assert (s.sqs_retry_visibility_base_s, s.sqs_retry_visibility_max_s) == (30, 900)
    assert (s.job_time_limit_s, s.mongo_connect_max_attempts, s.download_timeout_s) == (21600, 7, 60.0)


def test_the_daemon_needs_a_queue_a_store_and_a_bucket():
    """The long-running worker refuses to start without a queue, a store and a bucket, one line each."""
    assert len(daemon_problems(load_settings({}))) == 3
    ok = load_settings({"SQS_QUEUE_URL": "https://sqs.eu-west-1.amazonaws.com/1/q",
                        "STORE_URL": "sqlite:///x.db", "S3_BUCKET": "b"})
    assert daemon_problems(ok) == []


def test_the_process_environment_does_not_leak_into_explicit_settings(monkeypatch):
    """load_settings(env) reads only the mapping it is given."""
    monkeypatch.setenv("SQS_WAIT_TIME_SECONDS", "99")
    assert load_settings({}).sqs_wait_time_s == 20
    with pytest.raises(ConfigError):
        load_settings()


def test_bad_settings_stop_the_process_before_any_aws_call(tmp_path):
    """`python -m worker run` with bad settings prints one line per problem and exits 2, without touching AWS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQS_", "MONGO_", "STORE_", "S3_"))}
    env.update({
        "SQS_QUEUE_URL": "http://127.0.0.1:9/000000000000/q",  # nothing listens on port 9
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "SQS_VISIBILITY_TIMEOUT_SECONDS": "30", "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "30000",
        "SQS_WAIT_TIME_SECONDS": "30",
    })
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "worker", "run"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert any(line.startswith("SQS_WAIT_TIME_SECONDS=30") for line in lines)
    assert time.monotonic() - started < 20
    assert "Traceback" not in proc.stderr


def test_importing_modules_starts_nothing():
    """Importing every worker module starts no thread, opens no client and installs no signal handler."""
    code = (
        "import signal, threading, importlib, pkgutil, worker\n"
        "before = signal.getsignal(signal.SIGTERM)\n"
        "for m in pkgutil.walk_packages(worker.__path__, 'worker.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert signal.getsignal(signal.SIGTERM) is before\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_time_limit_plus_the_longest_backoff_must_fit_twelve_hours():
    """A backoff set at the end of a maximal attempt must still fit SQS's 12 hours from receipt."""
    with pytest.raises(ConfigError) as info:
        load_settings({"JOB_TIME_LIMIT_SECONDS": "42500", "SQS_VISIBILITY_TIMEOUT_SECONDS": "300",
                       "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "60000"})
    assert info.value.problems[0].startswith("JOB_TIME_LIMIT_SECONDS=42500 plus SQS_RETRY_VISIBILITY_MAX_SECONDS=900")


@pytest.mark.parametrize("url,path", [
    ("sqlite:///var/records.db", "var/records.db"),
    ("sqlite:////srv/voice/records.db", "/srv/voice/records.db"),
])
def test_store_url_is_kept_as_the_sqlite_path(url, path):
    """STORE_URL=sqlite:///x is the relative path x, sqlite:////x the absolute path /x."""
    assert load_settings({"STORE_URL": url}).sqlite_path == path


def test_list_valued_settings_are_parsed_once_into_their_values():
    """METRICS_DIMENSIONS, STAGE_ENV_PASSTHROUGH and VOICE_WORKER_CRASH_AT are held parsed, not as text."""
    s = load_settings({"METRICS_DIMENSIONS": "Environment=production, Queue=jobs",
                       "STAGE_ENV_PASSTHROUGH": " HF_HOME,,TORCH_HOME ", "VOICE_WORKER_CRASH_AT": "after_upload"})
    assert s.metrics_dimensions == {"Environment": "production", "Queue": "jobs"}
    assert s.stage_env_passthrough == ("HF_HOME", "TORCH_HOME")
    assert s.crash_at is CrashPoint.AFTER_UPLOAD
    assert (load_settings({}).metrics_dimensions, load_settings({}).stage_env_passthrough) == ({}, ())


def test_the_loop_gets_its_timings_and_backoff_from_the_settings():
    """The loop's config carries the long poll, the lease's clocks (with the hard cap's wind-down) and the backoff."""
    config = load_settings({"SQS_WAIT_TIME_SECONDS": "5", "SHUTDOWN_GRACE_SECONDS": "4",
                            "SQS_RETRY_VISIBILITY_BASE_SECONDS": "7"}).loop_config()
    assert config.wait_s == 5
    assert config.lease == LeaseTimings(visibility_timeout_s=300, interval_s=60.0, time_limit_s=21_600,
                                        shutdown_grace_s=4.0, wind_down_s=4.0 + 60.0)
    assert config.backoff == Backoff(base_s=7, max_s=900)


def test_aws_clients_get_the_region_of_an_aws_queue_url():
    """Without AWS_REGION the region comes from an AWS queue URL; AWS_REGION wins over it."""
    url = "https://sqs.eu-west-1.amazonaws.com/1/q"
    assert load_settings({"SQS_QUEUE_URL": url}).aws_config().region == "eu-west-1"
    assert load_settings({"SQS_QUEUE_URL": url, "AWS_REGION": "us-east-2"}).aws_config().region == "us-east-2"
    assert load_settings({"SQS_QUEUE_URL": "http://localhost:4566/1/q"}).aws_config().region is None


def test_the_daemon_targets_are_plain_strings_or_a_config_error():
    """daemon_targets gives the queue URL and bucket once all three needs are met, else the same lines."""
    ok = load_settings({"SQS_QUEUE_URL": "https://sqs.eu-west-1.amazonaws.com/1/q",
                        "STORE_URL": "sqlite:///x.db", "S3_BUCKET": "b"})
    assert (daemon_targets(ok).queue_url, daemon_targets(ok).bucket) == (ok.sqs_queue_url, "b")
    with pytest.raises(ConfigError) as info:
        daemon_targets(load_settings({"S3_BUCKET": "b"}))
    assert info.value.problems == daemon_problems(load_settings({"S3_BUCKET": "b"}))


@pytest.mark.parametrize("text,value", [("true", True), ("Yes", True), ("1", True), ("on", True),
                                        ("false", False), ("OFF", False), ("0", False), ("n", False)])
def test_a_switch_reads_the_usual_words_for_on_and_off(text, value):
    """Boolean settings accept true/false, yes/no, on/off and 1/0 in any case."""
    assert load_settings({"KEEP_WORK_FILES": text}).keep_work_files is value


@pytest.mark.parametrize("env,line", [
    ({"KEEP_WORK_FILES": "maybe"}, "KEEP_WORK_FILES=maybe: must be true or false"),
    ({"SHUTDOWN_GRACE_SECONDS": "nan"}, "SHUTDOWN_GRACE_SECONDS=nan: must be a finite number"),
    ({"DOWNLOAD_TIMEOUT_SECONDS": "inf"}, "DOWNLOAD_TIMEOUT_SECONDS=inf: must be a finite number"),
    ({"DOWNLOAD_TIMEOUT_SECONDS": "0"}, "DOWNLOAD_TIMEOUT_SECONDS=0: must be more than 0"),
    ({"SQS_WAIT_TIME_SECONDS": "1.5"}, "SQS_WAIT_TIME_SECONDS=1.5: must be a whole number"),
    ({"SHUTDOWN_GRACE_SECONDS": "\u0665"}, "SHUTDOWN_GRACE_SECONDS=\u0665: must be a number"),
    ({"METRICS_NAMESPACE": "x" * 256}, "METRICS_NAMESPACE=" + "x" * 256 + ": must be 1-255 characters"),
    # The connect's sleeps grow with the attempt (delay x attempt): the count bounds them too.
    ({"MONGO_CONNECT_MAX_ATTEMPTS": "101"}, "MONGO_CONNECT_MAX_ATTEMPTS=101: must be at most 100"),
])
def test_numbers_switches_and_text_are_checked_against_their_own_rules(env, line):
    """A value of the wrong kind or out of its bounds gets a line naming the variable and the rule."""
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert info.value.problems == [line]


def test_numbers_keep_their_kind_and_the_bounds_are_inclusive():
    """Whole numbers stay ints, others floats; a value equal to a bound passes."""
    s = load_settings({"SQS_WAIT_TIME_SECONDS": " 20 ", "SHUTDOWN_GRACE_SECONDS": "0", "MAX_CLOCK_SKEW_SECONDS": "900",
                       "SQS_VISIBILITY_TIMEOUT_SECONDS": "600.0", "MAX_TEXT_CHARS": "1_000"})
    assert (s.sqs_wait_time_s, s.shutdown_grace_s, s.max_clock_skew_s) == (20, 0.0, 900.0)
    assert s.sqs_visibility_timeout_s == 600 and isinstance(s.sqs_visibility_timeout_s, int)
    assert s.max_text_chars == 1000
    assert isinstance(s.sqs_wait_time_s, int) and isinstance(s.shutdown_grace_s, float)


def test_secrets_stay_out_of_the_settings_repr():
    """The store URI and the Sentry DSN, which carry credentials, are not in the settings' repr."""
    s = load_settings({"MONGO_URI": "mongodb://user:hunter2@db", "SENTRY_DSN": "https://key@sentry.example/1"})
    assert s.mongo_uri == "mongodb://user:hunter2@db"
    assert "hunter2" not in repr(s) and "key@sentry" not in repr(s)


PYDANTIC_WORDING = ("Input should", "Value error", "pydantic", "validation error", "For further information")


def test_no_problem_line_carries_pydantic_wording():
    """Settings are a pydantic model, but every line is ours: each names a variable, none has pydantic's text."""
    with pytest.raises(ConfigError) as info:
        load_settings({name: "\u0665 x\n" for name in ENV_NAMES})
    lines = info.value.problems
    assert len(lines) >= 30
    assert all(line.split("=")[0].split(":")[0].split(" ")[0] in ENV_NAMES and "\n" not in line for line in lines)
    assert not [line for line in lines if any(words in line for words in PYDANTIC_WORDING)]


def test_values_that_are_not_text_get_our_lines_and_a_secret_stays_hidden():
    """What pydantic refuses itself (a value handed in as a number) is worded as ours; a secret's value never shows."""
    with pytest.raises(ConfigError) as info:
        load_settings({"SQS_WAIT_TIME_SECONDS": 2.5, "MONGO_URI": 12345, "KEEP_WORK_FILES": 3,  # type: ignore[dict-item]
                       "LOG_LEVEL": "verbose"})
    assert info.value.problems == ["SQS_WAIT_TIME_SECONDS=2.5: must be a whole number", "MONGO_URI: must be text",
                                   "KEEP_WORK_FILES=3: must be true or false",
                                   "LOG_LEVEL=verbose: must be one of DEBUG, INFO, WARNING, ERROR"]


def test_the_settings_cannot_be_changed_once_loaded():
    """The settings object is frozen: a part of the worker cannot change what another part reads."""
    s = load_settings({})
    with pytest.raises(ValueError):
        s.sqs_wait_time_s = 5
    assert s.sqs_wait_time_s == 20


def test_each_variable_names_its_field_and_default():
    """FIELD_OF_ENV gives each variable's field and default, which is what loads when it is unset."""
    defaults = load_settings({})
    for name, setting in FIELD_OF_ENV.items():
        if setting.default is not MISSING:
            assert getattr(defaults, setting.name) == setting.default, name
        else:
            assert setting.default_factory is not MISSING, name
    assert [name for name, setting in FIELD_OF_ENV.items() if setting.secret] == ["MONGO_URI", "SENTRY_DSN"]


@pytest.mark.parametrize("text", [" yes", "on\t", "\u00a0true\u2003"])
def test_a_switch_may_have_spaces_around_its_word(text):
    """Spaces around a switch's word are read past, as before the settings were a pydantic model."""
    assert load_settings({"KEEP_WORK_FILES": text}).keep_work_files is True


@pytest.mark.parametrize("text", ["1._5", "+_6", "6E_2", "1__0"])
def test_a_number_is_what_float_reads(text):
    """Underscores float() refuses are refused, though pydantic's own float would read them."""
    with pytest.raises(ConfigError) as info:
        load_settings({"SHUTDOWN_GRACE_SECONDS": text})
    assert info.value.problems == [f"SHUTDOWN_GRACE_SECONDS={text}: must be a number"]


DURATIONS = [name for name in ENV_NAMES if name.endswith(("_SECONDS", "_MS"))]


def test_the_durations_are_every_seconds_and_milliseconds_setting():
    """The bound checks below cover every duration, the ones the issue named among them."""
    assert {"SPOT_INTERRUPTION_CHECK_SECONDS", "DOWNLOAD_TIMEOUT_SECONDS", "SHUTDOWN_GRACE_SECONDS",
            "LIVENESS_MAX_AGE_SECONDS", "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS",
            "MONGO_CONNECT_RETRY_DELAY_MS"} <= set(DURATIONS)


@pytest.mark.parametrize("name", DURATIONS)
def test_every_duration_has_an_upper_bound_that_waits_accept(name):
    """A duration past its bound is one line naming the bound, and no bound is more than Event.wait takes."""
    huge = "1" + "0" * 30
    with pytest.raises(ConfigError) as info:
        load_settings({name: huge})
    [line] = info.value.problems
    assert line.startswith(f"{name}={huge}: must be at most ")
    bound_s = float(line.rsplit(" ", 1)[1]) / (1000 if name.endswith("_MS") else 1)
    assert bound_s <= threading.TIMEOUT_MAX


@pytest.mark.parametrize("name,bound", [("SPOT_INTERRUPTION_CHECK_SECONDS", "120"),
                                        ("DOWNLOAD_TIMEOUT_SECONDS", "43200"), ("SHUTDOWN_GRACE_SECONDS", "43200")])
def test_the_durations_that_loaded_and_could_not_work_are_refused(name, bound):
    """1e300 s, which a wait cannot take (OverflowError in the spot watch), is refused at load."""
    with pytest.raises(ConfigError) as info:
        load_settings({name: "1e300"})
    assert info.value.problems == [f"{name}=1e300: must be at most {bound}"]
    assert getattr(load_settings({name: bound}), FIELD_OF_ENV[name].name) == float(bound)


@pytest.mark.parametrize("name", ["SQS_QUEUE_URL", "AWS_ENDPOINT_URL", "ECS_AGENT_URI", "IMDS_ENDPOINT"])
@pytest.mark.parametrize("value", ["http://127.0.0.1:99999", "http://127.0.0.1:0", "http://127.0.0.1:80x",
                                   "http://[::1", "http://127.0.0.1:8080\n", "http://127.0.0.1:80\t80",
                                   "http://user@127.0.0.1:8080", "http://127.0.0.1:8080?x=1", "http://", "127.0.0.1"])
def test_a_url_setting_that_cannot_be_used_is_one_settings_line(name, value):
    """Each URL setting is parsed when the settings load: a port out of range or a stray character is a line."""
    with pytest.raises(ConfigError) as info:
        load_settings({name: value})
    [line] = info.value.problems
    assert line.startswith(f"{name}=") and "\n" not in line


@pytest.mark.parametrize("name,value", [
    ("SQS_QUEUE_URL", "https://sqs.eu-west-1.amazonaws.com/123456789012/jobs"),
    ("SQS_QUEUE_URL", "http://127.0.0.1:4566/000000000000/jobs"),
    ("AWS_ENDPOINT_URL", "http://localhost:4566"), ("AWS_ENDPOINT_URL", "https://[::1]:4566/"),
    ("ECS_AGENT_URI", "http://169.254.170.2/api/0f1e2d3c-task"),
])
def test_a_usable_url_setting_is_kept_as_given(name, value):
    """The queue, the AWS endpoint and the ECS agent URL load unchanged when they parse."""
    assert getattr(load_settings({name: value}), FIELD_OF_ENV[name].name) == value


@pytest.mark.parametrize("env,line", [
    ({"SQS_WAIT_TIME_SECONDS": "\u2003 5"}, "SQS_WAIT_TIME_SECONDS='\\u2003 5': must be a whole number"),
    ({"SQS_WAIT_TIME_SECONDS": "5\u00a0"}, "SQS_WAIT_TIME_SECONDS='5\\xa0': must be a whole number"),
    ({"MAX_TEXT_CHARS": "9" * 5000}, f"MAX_TEXT_CHARS={'9' * 5000}: must be a whole number of at most 40 digits"),
])
def test_whole_numbers_are_read_in_ascii_and_within_a_sane_length(env, line):
    """A whole number may be surrounded by ASCII spaces only, and thousands of digits get a line of ours."""
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert info.value.problems == [line]


def test_a_value_with_a_line_break_is_quoted_in_its_one_line():
    """A problem line shows a value holding a line break quoted, so one problem stays one line."""
    target = "arn:aws:sns:us-east-1:123456789012:voice\n"
    with pytest.raises(ConfigError) as info:
        load_settings({"EVENTS_TARGET": target})
    [line] = info.value.problems
    assert line.startswith("EVENTS_TARGET='arn:aws:sns:us-east-1:123456789012:voice\\n': must be an SNS topic")


@pytest.mark.parametrize("typed", ["debug", "Debug", "DEBUG"])
def test_a_log_level_in_any_case_is_taken(typed):
    """LOG_LEVEL=debug is what people type, and it means DEBUG (issue #27's papercut)."""
    assert load_settings({"LOG_LEVEL": typed}).log_level == "DEBUG"
