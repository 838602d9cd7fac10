"""Settings: one validated, frozen object built once at start-up from the environment and passed in.

Nothing else in the project reads ``os.environ``. ``load_settings`` raises ``ConfigError`` with one
line per problem, before any AWS or store call, so a bad deployment fails loudly at start. Each
variable is parsed here, once (``METRICS_DIMENSIONS`` is a dict, ``STORE_URL`` the SQLite path);
the parts of the worker get small values built from these settings (``loop_config``,
``aws_config``, ``store_config``, ...) and never see the settings object or parse a variable again.

The parsing is this module's own, not pydantic's: every variable is one scalar or a comma format of
ours, and the rules between them were ours already, so pydantic only turned text into numbers. It
cost the idle daemon about 6 MiB (its import, its core, the schema it builds), an eighth of what a
bare boto3 consumer holds (benchmarks/idle_rss.py).
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pipeline.limits import JobLimits, usable_cpus
from worker.core.config import (
    DEFAULT_MAX_FAILED_ATTEMPTS,
    AwsConfig,
    Backoff,
    LeaseTimings,
    LoopConfig,
    MetricsConfig,
    region_for,
)
from worker.core.errors import ConfigError
from worker.core.events import target_problem
from worker.core.faults import POINTS, CrashPoint
from worker.core.healthcheck import MAX_AGE_LIMIT_S
from worker.core.imds import DEFAULT_ENDPOINT, Endpoint, parse_endpoint
from worker.core.metrics import parse_dimensions
from worker.core.names import SAFE_NAME
from worker.core.queue import MAX_VISIBILITY_S
from worker.voice.input_policy import InputPolicy, key_prefix_problem

if TYPE_CHECKING:
    from pipeline.downloads import DownloadSettings
    from pipeline.remote_work import RemoteWorkConfig
    from worker.voice.records import StoreConfig

# SQS refuses to keep a message invisible for more than 12 hours from its receipt.
SQS_MAX_VISIBILITY_S = MAX_VISIBILITY_S
SQS_MAX_WAIT_S = 20
SQLITE_URL_PREFIX = "sqlite:///"

# Every duration has an upper bound: each is past anything a deployment has a use for, and far below
# what time.sleep, Event.wait and select accept (threading.TIMEOUT_MAX, about 292 years), so no value
# that loads can fail where it is used. The waits a job makes (its time limit, the shutdown grace, a
# download's deadline, the checkpoint mirror's interval) are bounded by SQS_MAX_VISIBILITY_S: nothing
# outlasts the 12 hours a message can stay ours.
# SQS keeps a message for 14 days at most: a job record stale or pending for longer has no message left.
SQS_MAX_RETENTION_S = 14 * 86_400
# A week of speech, in one recording or in one job, is past any dataset a job trains on.
MAX_AUDIO_S = 7 * 86_400
# EC2 gives two minutes' notice before it reclaims a spot instance: looking less often can miss it.
SPOT_NOTICE_S = 120
# MongoDB's first connect waits delay x attempt after each failed attempt, so both are bounded.
MONGO_MAX_RETRY_DELAY_MS = 60_000
MONGO_MAX_CONNECT_ATTEMPTS = 100
# A whole number longer than this is refused before int() (which stops at 4300 digits with a line
# about Python, not about the setting).
_MAX_DIGITS = 40


# ---------------------------------------------------------------- parsing one variable

Parse = Callable[[str], Any]


class Lines(ValueError):
    """A variable's problems as whole lines that name it already (not ``NAME=value: ...``)."""

    def __init__(self, *lines: str):
        super().__init__("\n".join(lines))
        self.lines = list(lines)


def _bounded(value: float, ge: float | None, gt: float | None, le: float | None) -> Any:
    if ge is not None and value < ge:
        raise ValueError(f"must be at least {ge}")
    if gt is not None and value <= gt:
        raise ValueError(f"must be more than {gt}")
    if le is not None and value > le:
        raise ValueError(f"must be at most {le}")
    return value


def integer(*, ge: int | None = None, gt: int | None = None, le: int | None = None) -> Parse:
    def parse(text: str) -> int:
        # "60.0" and "1_000" read as pydantic read them: a deployment's values keep working. ASCII only:
        # "\s" would otherwise take any Unicode space.
        whole = re.fullmatch(r"\s*([+-]?[0-9](?:_?[0-9])*)(?:\.0+)?\s*", text, re.ASCII)
        if not whole:
            raise ValueError("must be a whole number")
        if len(whole.group(1)) > _MAX_DIGITS:
            raise ValueError(f"must be a whole number of at most {_MAX_DIGITS} digits")
        return _bounded(int(whole.group(1)), ge, gt, le)

    return parse


def number(*, ge: float | None = None, gt: float | None = None, le: float | None = None) -> Parse:
    def parse(text: str) -> float:
        if not text.isascii():  # float() also reads other scripts' digits
            raise ValueError("must be a number")
        try:
            value = float(text)
        except ValueError:
            raise ValueError("must be a number") from None
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return _bounded(value, ge, gt, le)

    return parse


_TRUE, _FALSE = ("1", "true", "t", "yes", "y", "on"), ("0", "false", "f", "no", "n", "off")


def boolean(text: str) -> bool:
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError("must be true or false")
    return word in _TRUE


def text(*, min_chars: int, max_chars: int) -> Parse:
    def parse(value: str) -> str:
        if not min_chars <= len(value) <= max_chars:
            raise ValueError(f"must be {min_chars}-{max_chars} characters")
        return value

    return parse


def one_of(*choices: str) -> Parse:
    def parse(value: str) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def _as_is(value: str) -> str:
    return value


def env(name: str, default: Any = None, parse: Parse = _as_is, *, factory: Callable[[], Any] | None = None,
        secret: bool = False) -> Any:
    """A setting read from environment variable ``name``: its text through ``parse``, or the default
    when unset or empty. A secret's value is neither shown in a problem line nor in the repr."""
    meta = {"env": name, "parse": parse, "secret": secret}
    if factory is not None:
        return field(default_factory=factory, metadata=meta, repr=not secret)
    return field(default=default, metadata=meta, repr=not secret)


def _default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _events_target(target: str) -> str:
    if problem := target_problem(target):
        raise ValueError(problem)
    return target


def url(*schemes: str) -> Parse:
    """A URL, with one of ``schemes`` when given: checked here once, so that a bad one (a port past
    65535) is a settings line, not an error where a client is made or each time it is called."""
    kind = f"an {' or '.join(f'{scheme}://' for scheme in schemes)} URL" if schemes else "a URL with a scheme"
    rule = f"must be {kind}, a host, no user, query or fragment, and a port (if any) from 1 to 65535"

    def parse(value: str) -> str:
        if not re.fullmatch(r"[!-~]+", value):  # urlsplit would silently drop a tab or a line break
            raise ValueError(rule)
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:  # an out-of-range or non-numeric port, a broken [IPv6] literal
            raise ValueError(rule) from None
        if (not parts.scheme or schemes and parts.scheme not in schemes or not parts.hostname or port == 0
                or parts.username is not None or parts.query or parts.fragment):
            raise ValueError(rule)
        return value

    return parse


def _sqlite_path(url: str) -> str:
    path = url.removeprefix(SQLITE_URL_PREFIX) if url.startswith(SQLITE_URL_PREFIX) else ""
    if not path or "?" in path or "\x00" in path:
        raise Lines(f"STORE_URL must look like sqlite:///path/to/file.db, got {url!r}")
    return path


def _stage_env_names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if bad := [f"STAGE_ENV_PASSTHROUGH: {name!r} is not an environment variable name"
               for name in names if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)]:
        raise Lines(*bad)
    return names


def _dimensions(value: str) -> dict[str, str]:
    try:
        return parse_dimensions(value)
    except ValueError as exc:
        raise Lines(f"METRICS_DIMENSIONS: {exc}") from None


def _key_prefix(prefix: str) -> str:
    if problem := key_prefix_problem(prefix):
        raise Lines(f"RECORDINGS_S3_KEY_PREFIX={prefix!r} {problem}")
    return prefix


def _crash_point(name: str) -> CrashPoint:
    if name not in POINTS:
        raise Lines(f"VOICE_WORKER_CRASH_AT={name} is not one of {', '.join(POINTS)}")
    return CrashPoint(name)


# ---------------------------------------------------------------- the settings


@dataclass(frozen=True, slots=True)
class Settings:
    # Built by load_settings from the mapping it is handed (tests and the CLI stay hermetic from the
    # process environment); an empty value means unset. Constructed directly (tests), nothing is parsed.

    # --- queue
    sqs_queue_url: str | None = env("SQS_QUEUE_URL", None, url())
    sqs_visibility_timeout_s: int = env("SQS_VISIBILITY_TIMEOUT_SECONDS", 300, integer(ge=1, le=SQS_MAX_VISIBILITY_S))
    sqs_visibility_heartbeat_interval_ms: int = env("SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS", 60_000,
                                                    integer(ge=1, le=SQS_MAX_VISIBILITY_S * 1000))
    sqs_retry_visibility_base_s: int = env("SQS_RETRY_VISIBILITY_BASE_SECONDS", 30,
                                           integer(ge=0, le=SQS_MAX_VISIBILITY_S))
    sqs_retry_visibility_max_s: int = env("SQS_RETRY_VISIBILITY_MAX_SECONDS", 900,
                                          integer(ge=0, le=SQS_MAX_VISIBILITY_S))
    sqs_wait_time_s: int = env("SQS_WAIT_TIME_SECONDS", 20, integer(ge=0, le=SQS_MAX_WAIT_S))
    # Recorded retryable failures before the worker dead-letters a job; releases and crashes spend none.
    max_failed_attempts: int = env("MAX_FAILED_ATTEMPTS", DEFAULT_MAX_FAILED_ATTEMPTS, integer(ge=1))

    # --- records
    mongo_uri: str | None = env("MONGO_URI", secret=True)
    mongo_database: str = env("MONGO_DATABASE", "voice")
    mongo_jobs_collection: str = env("MONGO_JOBS_COLLECTION", "voiceclonings")
    mongo_profiles_collection: str = env("MONGO_PROFILES_COLLECTION", "useraudioprofiles")
    mongo_connect_max_attempts: int = env("MONGO_CONNECT_MAX_ATTEMPTS", 7,
                                          integer(ge=1, le=MONGO_MAX_CONNECT_ATTEMPTS))
    mongo_connect_retry_delay_ms: int = env("MONGO_CONNECT_RETRY_DELAY_MS", 1000,
                                            integer(ge=0, le=MONGO_MAX_RETRY_DELAY_MS))
    # STORE_URL=sqlite:///path/to/file.db, kept as the file's path.
    sqlite_path: str | None = env("STORE_URL", None, _sqlite_path)

    # --- artifacts and files
    s3_bucket: str | None = env("S3_BUCKET")
    s3_prefix: str = env("S3_PREFIX", "")
    work_root: str = env("WORK_ROOT", "var/work")
    pipeline_config: str = env("PIPELINE_CONFIG", "config/pipeline.toml")
    # What a config's {trainer_python} stands for: the interpreter of the trainers' own virtualenv
    # (trainers/), never the worker's. Checked at start when the config uses it.
    trainer_python: str = env("TRAINER_PYTHON", "")
    # Mirror each attempt's checkpoints and finished stages to S3 this often (pipeline/remote_work.py),
    # so a retry on another host resumes instead of starting over. 0: off. Off anyway on a shared work root.
    checkpoint_s3_sync_s: float = env("CHECKPOINT_S3_SYNC_SECONDS", 0.0,
                                      number(ge=0, le=SQS_MAX_VISIBILITY_S))
    # Stages get a secret-free environment: a built-in allow-list (pipeline/stage_env.py) plus these names.
    stage_env_passthrough: tuple[str, ...] = env("STAGE_ENV_PASSTHROUGH", parse=_stage_env_names, factory=tuple)
    # After the commit a job's work directory is emptied except its logs/; true keeps every file.
    keep_work_files: bool = env("KEEP_WORK_FILES", False, boolean)
    # Where the five artifacts are published for the profile's modelPaths (unset: <WORK_ROOT>/.models).
    models_root: str | None = env("MODELS_ROOT")

    # --- time
    job_time_limit_s: int = env("JOB_TIME_LIMIT_SECONDS", 21_600, integer(ge=1, le=SQS_MAX_VISIBILITY_S))
    shutdown_grace_s: float = env("SHUTDOWN_GRACE_SECONDS", 60.0, number(ge=0, le=SQS_MAX_VISIBILITY_S))
    # The reconciler: a processing job whose lease ended this long ago lost its worker (unset: the job
    # time limit + visibility timeout + longest backoff + 1 h); a pending job never enqueued this long
    # after its creation is enqueued again, once.
    reconcile_stale_after_s: int | None = env("RECONCILE_STALE_AFTER_SECONDS", None,
                                              integer(ge=1, le=SQS_MAX_RETENTION_S))
    reconcile_pending_after_s: int = env("RECONCILE_PENDING_AFTER_SECONDS", 1800,
                                         integer(ge=1, le=SQS_MAX_RETENTION_S))
    # Leases are judged on the store's clock; a host whose clock is further off than this from the
    # store's refuses to start (AWS refuses requests signed more than 15 min off, hence the cap).
    max_clock_skew_s: float = env("MAX_CLOCK_SKEW_SECONDS", 10.0, number(gt=0, le=900))

    # --- downloads
    download_timeout_s: float = env("DOWNLOAD_TIMEOUT_SECONDS", 60.0, number(gt=0, le=SQS_MAX_VISIBILITY_S))
    download_max_bytes: int = env("DOWNLOAD_MAX_BYTES", 2 * 1024**3, integer(ge=1))
    # Recordings on the wire at once for a job (each takes its declared length of MAX_JOB_DOWNLOAD_BYTES,
    # or DOWNLOAD_MAX_BYTES when it declares none).
    download_concurrency: int = env("DOWNLOAD_CONCURRENCY", 8, integer(ge=1, le=64))
    # Local runs only: lets recordings come from loopback/private hosts (never in production).
    download_allow_private_hosts: bool = env("DOWNLOAD_ALLOW_PRIVATE_HOSTS", False, boolean)
    # s3:// recordings must be in this bucket (unset: s3:// recordings are refused), under this key
    # prefix, in which {profileId} stands for the message's profileId: no job reads another's files.
    recordings_s3_bucket: str | None = env("RECORDINGS_S3_BUCKET")
    recordings_s3_key_prefix: str = env("RECORDINGS_S3_KEY_PREFIX", "recordings/{profileId}/", _key_prefix)

    # --- limits: what one job may ask for; past a limit the job fails permanently
    max_recordings_per_job: int = env("MAX_RECORDINGS_PER_JOB", 500, integer(ge=1, le=100_000))
    max_text_chars: int = env("MAX_TEXT_CHARS", 2000, integer(ge=1))
    max_job_download_bytes: int = env("MAX_JOB_DOWNLOAD_BYTES", 8 * 1024**3, integer(ge=1))
    max_recording_seconds: float = env("MAX_RECORDING_SECONDS", 1800.0, number(gt=0, le=MAX_AUDIO_S))
    max_job_audio_seconds: float = env("MAX_JOB_AUDIO_SECONDS", 36_000.0, number(gt=0, le=MAX_AUDIO_S))

    # --- dataset
    # Recordings the dataset step converts at once (unset: the CPUs this process may run on).
    dataset_workers: int = env("DATASET_WORKERS", parse=integer(ge=1), factory=usable_cpus)

    # --- observability and identity
    sentry_dsn: str | None = env("SENTRY_DSN", secret=True)
    log_level: str = env("LOG_LEVEL", "INFO", one_of("DEBUG", "INFO", "WARNING", "ERROR"))
    log_format: str = env("LOG_FORMAT", "json", one_of("json", "console"))
    worker_id: str = env("WORKER_ID", factory=_default_worker_id)
    # A file the loop and the heartbeat touch while alive; `python -m worker health` checks its age.
    liveness_file: str | None = env("LIVENESS_FILE")
    liveness_max_age_s: float | None = env("LIVENESS_MAX_AGE_SECONDS", None,
                                           number(gt=0, le=MAX_AGE_LIMIT_S))
    # Set by systemd for Type=notify units: READY, WATCHDOG and STOPPING go there.
    notify_socket: str | None = env("NOTIFY_SOCKET")
    # CloudWatch embedded metric format, one JSON object per line on stdout (worker/core/metrics.py).
    metrics_enabled: bool = env("METRICS_ENABLED", True, boolean)
    metrics_namespace: str = env("METRICS_NAMESPACE", "VoiceWorker", text(min_chars=1, max_chars=255))
    # Name=Value pairs added to every metric, e.g. "Environment=production,Queue=jobs".
    metrics_dimensions: dict[str, str] = env("METRICS_DIMENSIONS", parse=_dimensions, factory=dict)
    # Job state-change events (worker/core/events.py): an SNS topic ARN or an EventBridge bus ARN; empty: none.
    events_target: str = env("EVENTS_TARGET", "", _events_target)
    # OpenTelemetry spans for each job, its trace carried from `submit` (worker/core/tracing.py; the
    # `tracing` extra). Off by default.
    tracing_enabled: bool = env("TRACING_ENABLED", False, boolean)

    # --- testing only: kill the process at a named point (see worker/core/faults.py); unset in production
    crash_at: CrashPoint | None = env("VOICE_WORKER_CRASH_AT", None, _crash_point)

    # --- AWS
    aws_endpoint_url: str | None = env("AWS_ENDPOINT_URL", None, url("http", "https"))
    aws_region: str | None = env("AWS_REGION")
    # Set by ECS in every task's containers: the agent's local endpoint, used for scale-in protection
    # while a job runs (worker/core/ecs_agent.py). Absent elsewhere, and then nothing is protected.
    ecs_agent_uri: str | None = env("ECS_AGENT_URI", None, url("http", "https"))
    # On EC2 spot: read the interruption notice from instance metadata this often and shut down as for
    # SIGTERM at the first one (worker/core/imds.py). 0: off (the default; ECS's spot draining sends
    # SIGTERM itself).
    spot_interruption_check_s: float = env("SPOT_INTERRUPTION_CHECK_SECONDS", 0.0,
                                           number(ge=0, le=SPOT_NOTICE_S))
    # Parsed here: the watch is handed the host and port.
    imds_endpoint: Endpoint = env("IMDS_ENDPOINT", DEFAULT_ENDPOINT, parse_endpoint)

    @property
    def heartbeat_interval_s(self) -> float:
        return self.sqs_visibility_heartbeat_interval_ms / 1000.0

    @property
    def models_root_path(self) -> str:
        return self.models_root or os.path.join(self.work_root, ".models")

    @property
    def stage_stop_grace_s(self) -> float:
        """How long a stopped stage gets between SIGTERM and SIGKILL."""
        return min(10.0, self.shutdown_grace_s or 10.0)

    @property
    def liveness_age_limit_s(self) -> float:
        """How stale the liveness file may get: a few of the longest quiet spells (a long poll, a tick)."""
        if self.liveness_max_age_s is not None:
            return self.liveness_max_age_s
        return 3 * max(self.sqs_wait_time_s + 10, self.heartbeat_interval_s) + 30

    @property
    def mongo_connect_retry_delay_s(self) -> float:
        return self.mongo_connect_retry_delay_ms / 1000.0

    @property
    def reconcile_stale_s(self) -> int:
        """RECONCILE_STALE_AFTER_SECONDS, or a default well past anything a live worker can take."""
        if self.reconcile_stale_after_s is not None:
            return self.reconcile_stale_after_s
        return self.job_time_limit_s + self.sqs_visibility_timeout_s + self.sqs_retry_visibility_max_s + 3600

    # What each part of the worker is built with: plain values, so no part imports the settings.
    def lease_timings(self) -> LeaseTimings:
        return LeaseTimings(
            visibility_timeout_s=self.sqs_visibility_timeout_s,
            interval_s=self.heartbeat_interval_s,
            time_limit_s=self.job_time_limit_s,
            shutdown_grace_s=self.shutdown_grace_s,
            # Time for the stage runner's SIGTERM -> SIGKILL and one last tick to record the stop.
            wind_down_s=self.stage_stop_grace_s + self.heartbeat_interval_s,
        )

    def loop_config(self) -> LoopConfig:
        return LoopConfig(wait_s=self.sqs_wait_time_s, lease=self.lease_timings(),
                          backoff=Backoff(self.sqs_retry_visibility_base_s, self.sqs_retry_visibility_max_s))

    def aws_config(self) -> AwsConfig:
        return AwsConfig(region=region_for(self.aws_region, self.sqs_queue_url),
                         endpoint_url=self.aws_endpoint_url, long_poll_s=self.sqs_wait_time_s,
                         heartbeat_interval_s=self.heartbeat_interval_s)

    def metrics_config(self) -> MetricsConfig:
        return MetricsConfig(self.metrics_namespace, self.metrics_dimensions, enabled=self.metrics_enabled)

    def store_config(self) -> StoreConfig:
        from worker.voice.records import MongoConfig, StoreConfig  # the records only when a store opens

        mongo = None if not self.mongo_uri else MongoConfig(
            self.mongo_uri, database=self.mongo_database, jobs_collection=self.mongo_jobs_collection,
            profiles_collection=self.mongo_profiles_collection,
            connect_max_attempts=self.mongo_connect_max_attempts,
            connect_retry_delay_s=self.mongo_connect_retry_delay_s)
        return StoreConfig(sqlite_path=self.sqlite_path, mongo=mongo)

    def input_policy(self) -> InputPolicy:
        return InputPolicy(recordings_bucket=self.recordings_s3_bucket,
                           recordings_key_prefix=self.recordings_s3_key_prefix,
                           max_recordings=self.max_recordings_per_job, max_text_chars=self.max_text_chars)

    def job_limits(self) -> JobLimits:
        return JobLimits(max_job_download_bytes=self.max_job_download_bytes,
                         max_recording_seconds=self.max_recording_seconds,
                         max_job_audio_seconds=self.max_job_audio_seconds,
                         dataset_workers=self.dataset_workers)

    def remote_work_config(self) -> RemoteWorkConfig | None:
        """Where attempts mirror their work, or None when they do not."""
        from pipeline.remote_work import RemoteWorkConfig

        if self.checkpoint_s3_sync_s <= 0 or not self.s3_bucket:
            return None
        return RemoteWorkConfig(bucket=self.s3_bucket, prefix=self.s3_prefix,
                                sync_interval_s=self.checkpoint_s3_sync_s)

    def download_settings(self) -> DownloadSettings:
        from pipeline.downloads import DownloadSettings  # the download machinery only when it is used
        from pipeline.netguard import LOCAL_RUN_NETWORKS

        return DownloadSettings(
            timeout_s=self.download_timeout_s, max_bytes=self.download_max_bytes,
            concurrency=self.download_concurrency,
            allowed_networks=LOCAL_RUN_NETWORKS if self.download_allow_private_hosts else ())


def consistency_problems(s: Settings) -> list[str]:
    """Cross-setting rules, one readable line per broken rule (checked once every field is valid)."""
    problems = _queue_time_problems(s)
    if s.mongo_uri and s.sqlite_path:
        problems.append("MONGO_URI and STORE_URL are both set: choose one store")
    if s.reconcile_stale_after_s is not None and (
            s.reconcile_stale_after_s < s.job_time_limit_s + s.sqs_visibility_timeout_s):
        # A worker whose store renewals fail keeps working (and may still commit) up to the time limit.
        problems.append(
            f"RECONCILE_STALE_AFTER_SECONDS={s.reconcile_stale_after_s} must be at least "
            f"JOB_TIME_LIMIT_SECONDS + SQS_VISIBILITY_TIMEOUT_SECONDS "
            f"({s.job_time_limit_s + s.sqs_visibility_timeout_s}), or a live job may be marked lost")
    problem = models_root_problem(s.work_root, s.models_root_path)
    if problem:
        problems.append(problem)
    return problems


def _queue_time_problems(s: Settings) -> list[str]:
    """The rules between the heartbeat, the backoff, the time limit and SQS's 12 hours."""
    problems = []
    if s.sqs_visibility_heartbeat_interval_ms >= s.sqs_visibility_timeout_s * 1000:
        problems.append(
            f"SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS={s.sqs_visibility_heartbeat_interval_ms} must be "
            f"shorter than SQS_VISIBILITY_TIMEOUT_SECONDS={s.sqs_visibility_timeout_s} "
            f"({s.sqs_visibility_timeout_s * 1000} ms), or the message reappears between renewals"
        )
    if s.sqs_retry_visibility_base_s > s.sqs_retry_visibility_max_s:
        problems.append(
            f"SQS_RETRY_VISIBILITY_BASE_SECONDS={s.sqs_retry_visibility_base_s} must not exceed "
            f"SQS_RETRY_VISIBILITY_MAX_SECONDS={s.sqs_retry_visibility_max_s}"
        )
    if s.job_time_limit_s + s.sqs_visibility_timeout_s > SQS_MAX_VISIBILITY_S:
        problems.append(
            f"JOB_TIME_LIMIT_SECONDS={s.job_time_limit_s} plus SQS_VISIBILITY_TIMEOUT_SECONDS="
            f"{s.sqs_visibility_timeout_s} exceeds the {SQS_MAX_VISIBILITY_S} s SQS allows a message "
            f"to stay invisible from its receipt"
        )
    elif s.job_time_limit_s + s.sqs_retry_visibility_max_s > SQS_MAX_VISIBILITY_S:
        # The backoff is set when the attempt ends, at most a time limit after the receipt.
        problems.append(
            f"JOB_TIME_LIMIT_SECONDS={s.job_time_limit_s} plus SQS_RETRY_VISIBILITY_MAX_SECONDS="
            f"{s.sqs_retry_visibility_max_s} exceeds the {SQS_MAX_VISIBILITY_S} s SQS allows a message "
            f"to stay invisible from its receipt: the backoff could not be set"
        )
    return problems


def models_root_problem(work_root: str, models_root: str) -> str | None:
    """Why MODELS_ROOT could meet a job's work directory (whose cleanup would remove models), or None."""
    work, models = Path(os.path.abspath(work_root)), Path(os.path.abspath(models_root))
    if models == work or work in models.parents and re.fullmatch(SAFE_NAME, models.relative_to(work).parts[0]):
        return (f"MODELS_ROOT={models_root} must not be WORK_ROOT or a directory below it that an "
                "environment name could take (use a name starting with a dot, or a path outside WORK_ROOT)")
    if models in work.parents:
        return f"MODELS_ROOT={models_root} must not hold WORK_ROOT={work_root}"
    return None


# Each environment variable's field, in the order above.
FIELD_OF_ENV: dict[str, Field] = {f.metadata["env"]: f for f in fields(Settings)}
ENV_NAMES = tuple(FIELD_OF_ENV)


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Build the settings from ``environ`` (default: the process environment) or raise ConfigError."""
    source = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    problems: list[str] = []
    for name, spec in FIELD_OF_ENV.items():
        raw = source.get(name, "")
        if raw == "":
            continue
        try:
            values[spec.name] = spec.metadata["parse"](raw)
        except Lines as exc:
            problems.extend(exc.lines)
        except ValueError as exc:
            # A value with a line break in it is quoted: one problem, one line.
            shown = "" if spec.metadata["secret"] else f"={raw}" if raw.isprintable() else f"={raw!r}"
            problems.append(f"{name}{shown}: {exc}")
    if problems:
        raise ConfigError(problems)
    settings = Settings(**values)
    # The rules between settings only once each one is valid on its own.
    if problems := consistency_problems(settings):
        raise ConfigError(problems)
    return settings


_REQUIRED = {
    "queue": (lambda s: s.sqs_queue_url, "SQS_QUEUE_URL is required: the queue to take jobs from"),
    "store": (lambda s: s.mongo_uri or s.sqlite_path,
              "MONGO_URI or STORE_URL is required: where job and profile records live"),
    "bucket": (lambda s: s.s3_bucket, "S3_BUCKET is required: where the trained artifacts are uploaded"),
}


def missing(s: Settings, *needs: str) -> list[str]:
    """One line for each of ``needs`` ("queue", "store", "bucket") the settings do not provide."""
    return [line for need in needs for present, line in [_REQUIRED[need]] if not present(s)]


def daemon_problems(s: Settings) -> list[str]:
    """What the long-running worker needs beyond valid settings: a queue, a store and a bucket."""
    return missing(s, "queue", "store", "bucket")


@dataclass(frozen=True, slots=True)
class DaemonTargets:
    """The queue the daemon takes jobs from and the bucket it uploads to, known to be set."""

    queue_url: str
    bucket: str


def daemon_targets(s: Settings) -> DaemonTargets:
    """The daemon's queue and bucket, or ConfigError with ``daemon_problems``' lines."""
    problems = daemon_problems(s)
    if problems or not s.sqs_queue_url or not s.s3_bucket:
        raise ConfigError(problems)
    return DaemonTargets(queue_url=s.sqs_queue_url, bucket=s.s3_bucket)
