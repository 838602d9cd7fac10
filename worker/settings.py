"""Settings: one validated, frozen object built once at start-up from the environment and passed in.

Nothing else in the project reads ``os.environ``. ``load_settings`` raises ``ConfigError`` with one
line per problem, before any AWS or store call, so a bad deployment fails loudly at start. Each
variable is parsed here, once (``METRICS_DIMENSIONS`` is a dict, ``STORE_URL`` the SQLite path);
the parts of the worker get small values built from these settings (``loop_config``,
``aws_config``, ``store_config``, ...) and never see the settings object or parse a variable again.

``Settings`` is a frozen pydantic model validated from the mapping ``load_settings`` is handed: each
field's alias is its variable, and pydantic checks the types, the bounds (``ge``/``gt``/``le``), the
choices and, once every value is valid, the rules between settings. It is a plain model over that
mapping, not pydantic-settings: an empty value means unset, the comma formats are ours (its sources
would try to JSON-decode them), and tests and the CLI stay hermetic from the process environment.
Where pydantic would read text we refuse, a parser of ours turns the text into the value first (each
says why it is kept). Pydantic's own messages never reach the user: ``load_settings`` translates each
error into the line ``NAME=value: must be ...``.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticUndefined

from pipeline.limits import JobLimits, usable_cpus
from worker.core.core_config import (
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
from worker.core.names import SAFE_NAME
from worker.core.queue import MAX_VISIBILITY_S
from worker.voice.input_policy import InputPolicy, key_prefix_problem
from worker.voice.metrics import parse_dimensions

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from pipeline.downloads import DownloadSettings
    from pipeline.remote_work import RemoteWorkConfig
    from worker.voice.records import StoreConfig
    from worker.voice.stage_logs import LogShippingConfig

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


# ---------------------------------------------------------------- text to values
# Each parser runs before pydantic's own checks, on a variable's text only: a value that is not text (a
# default, a value already parsed) goes to pydantic as it is. A parser raises ValueError with our rule
# ("must be ..."), or ProblemLines with whole lines when its problems name the variable themselves.


class ProblemLines(ValueError):
    """A variable's problems as whole lines that name it already (not ``NAME=value: ...``)."""

    def __init__(self, *lines: str):
        super().__init__("\n".join(lines))
        self.lines = list(lines)


def _on_text(parse: Callable[[str], Any]) -> BeforeValidator:
    return BeforeValidator(lambda value: parse(value) if isinstance(value, str) else value)


def _whole_number(text: str) -> int:
    # Kept: pydantic's int reads any Unicode space around the digits ("\u2003 5", "5\xa0"), and refuses
    # thousands of digits in words about its parser, not about the setting. "600.0" and "1_000" read as
    # pydantic reads them, so a deployment's values keep working.
    whole = re.fullmatch(r"\s*([+-]?[0-9](?:_?[0-9])*)(?:\.0+)?\s*", text, re.ASCII)
    if not whole:
        raise ValueError("must be a whole number")
    if len(whole.group(1)) > _MAX_DIGITS:
        raise ValueError(f"must be a whole number of at most {_MAX_DIGITS} digits")
    return int(whole.group(1))


def _number(text: str) -> float:
    # Kept: pydantic's float reads underscores float() refuses ("1._5", "+_6", "6E_2") and refuses
    # spaced ones it reads ("1_9\t"): the values that load stay float()'s. ASCII only, as float() also
    # reads other scripts' digits.
    if not text.isascii():
        raise ValueError("must be a number")
    try:
        value = float(text)
    except ValueError:
        raise ValueError("must be a number") from None
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def url(*schemes: str) -> Callable[[str], str]:
    """A URL, with one of ``schemes`` when given: checked here once, so that a bad one (a port past
    65535) is a settings line, not an error where a client is made or each time it is called.

    Kept rather than pydantic's URL types: those rewrite the text (``http://h:80`` becomes ``http://h/``)
    where the settings keep it as given, and take a user, a query and a fragment."""
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


def _default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _events_target(target: str) -> str:
    if problem := target_problem(target):
        raise ValueError(problem)
    return target


def _sqlite_path(url: str) -> str:
    path = url.removeprefix(SQLITE_URL_PREFIX) if url.startswith(SQLITE_URL_PREFIX) else ""
    if not path or "?" in path or "\x00" in path:
        raise ProblemLines(f"STORE_URL must look like sqlite:///path/to/file.db, got {url!r}")
    return path


def _stage_env_names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if bad := [f"STAGE_ENV_PASSTHROUGH: {name!r} is not an environment variable name"
               for name in names if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)]:
        raise ProblemLines(*bad)
    return names


def _dimensions(value: str) -> dict[str, str]:
    try:
        return parse_dimensions(value)
    except ValueError as exc:
        raise ProblemLines(f"METRICS_DIMENSIONS: {exc}") from None


def _key_prefix(prefix: str) -> str:
    if problem := key_prefix_problem(prefix):
        raise ProblemLines(f"RECORDINGS_S3_KEY_PREFIX={prefix!r} {problem}")
    return prefix


def _crash_point(name: str) -> CrashPoint:
    if name not in POINTS:
        raise ProblemLines(f"VOICE_WORKER_CRASH_AT={_shown(name)} is not one of {', '.join(POINTS)}")
    return CrashPoint(name)


def _shown(value: object) -> str:
    """A value as a problem line shows it: quoted when it holds a line break or another unprintable
    character, so that one problem stays one line."""
    text = str(value)
    return text if text.isprintable() else repr(text)


# The value types of the fields below: pydantic's type, after our parser where one is kept.
WholeNumber = Annotated[int, _on_text(_whole_number)]
Number = Annotated[float, Field(allow_inf_nan=False), _on_text(_number)]
# pydantic's bool reads the words we read (1/0, true/false, t/f, yes/no, y/n, on/off, in any case);
# it only refuses the spaces around them that we allow.
Switch = Annotated[bool, _on_text(str.strip)]
UrlText = Annotated[str, _on_text(url())]
HttpUrlText = Annotated[str, _on_text(url("http", "https"))]


# ---------------------------------------------------------------- the settings


class Settings(BaseModel):
    # Validated from the mapping load_settings hands in, keyed by the variables (the aliases); an empty
    # value means unset. The defaults are validated too, so a default outside its own bounds cannot load.
    # Secrets are the fields with repr=False: not in the repr, and their value is not in a problem line.
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, hide_input_in_errors=True)

    # --- queue
    sqs_queue_url: UrlText | None = Field(None, alias="SQS_QUEUE_URL")
    sqs_visibility_timeout_s: WholeNumber = Field(300, alias="SQS_VISIBILITY_TIMEOUT_SECONDS",
                                                  ge=1, le=SQS_MAX_VISIBILITY_S)
    sqs_visibility_heartbeat_interval_ms: WholeNumber = Field(60_000, alias="SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS",
                                                              ge=1, le=SQS_MAX_VISIBILITY_S * 1000)
    sqs_retry_visibility_base_s: WholeNumber = Field(30, alias="SQS_RETRY_VISIBILITY_BASE_SECONDS",
                                                     ge=0, le=SQS_MAX_VISIBILITY_S)
    sqs_retry_visibility_max_s: WholeNumber = Field(900, alias="SQS_RETRY_VISIBILITY_MAX_SECONDS",
                                                    ge=0, le=SQS_MAX_VISIBILITY_S)
    sqs_wait_time_s: WholeNumber = Field(20, alias="SQS_WAIT_TIME_SECONDS", ge=0, le=SQS_MAX_WAIT_S)
    # Recorded retryable failures before the worker dead-letters a job; releases and crashes spend none.
    max_failed_attempts: WholeNumber = Field(DEFAULT_MAX_FAILED_ATTEMPTS, alias="MAX_FAILED_ATTEMPTS", ge=1)
    # Releases of one job for host faults (GPU gone, work disk full or gone mid-job) before its next
    # such fault counts as its own failure (a job can fill a disk itself); 0: never released for them.
    host_fault_max_releases: WholeNumber = Field(2, alias="HOST_FAULT_MAX_RELEASES", ge=0, le=100)

    # --- records
    mongo_uri: str | None = Field(None, alias="MONGO_URI", repr=False)
    mongo_database: str = Field("voice", alias="MONGO_DATABASE")
    mongo_jobs_collection: str = Field("voiceclonings", alias="MONGO_JOBS_COLLECTION")
    mongo_profiles_collection: str = Field("useraudioprofiles", alias="MONGO_PROFILES_COLLECTION")
    mongo_connect_max_attempts: WholeNumber = Field(7, alias="MONGO_CONNECT_MAX_ATTEMPTS",
                                                    ge=1, le=MONGO_MAX_CONNECT_ATTEMPTS)
    mongo_connect_retry_delay_ms: WholeNumber = Field(1000, alias="MONGO_CONNECT_RETRY_DELAY_MS",
                                                      ge=0, le=MONGO_MAX_RETRY_DELAY_MS)
    # STORE_URL=sqlite:///path/to/file.db, kept as the file's path.
    sqlite_path: Annotated[str, _on_text(_sqlite_path)] | None = Field(None, alias="STORE_URL")

    # --- artifacts and files
    s3_bucket: str | None = Field(None, alias="S3_BUCKET")
    s3_prefix: str = Field("", alias="S3_PREFIX")
    work_root: str = Field("var/work", alias="WORK_ROOT")
    pipeline_config: str = Field("config/pipeline.toml", alias="PIPELINE_CONFIG")
    # What a config's {trainer_python} stands for: the interpreter of the trainers' own virtualenv
    # (trainers/), never the worker's. Checked at start when the config uses it.
    trainer_python: str = Field("", alias="TRAINER_PYTHON")
    # A pipeline marked [pipeline] stand_in = true (the reference stand-in) refuses staging and production
    # jobs (StandInRefused) unless this allows it: a load test of the worker around the stand-in, say.
    allow_stand_in_trainer: Switch = Field(False, alias="ALLOW_STAND_IN_TRAINER")
    # Mirror each attempt's checkpoints and finished stages to S3 this often (pipeline/remote_work.py),
    # so a retry on another host resumes instead of starting over. 0: off. Off anyway on a shared work root.
    checkpoint_s3_sync_s: Number = Field(0.0, alias="CHECKPOINT_S3_SYNC_SECONDS", ge=0, le=SQS_MAX_VISIBILITY_S)
    # Each attempt's step logs go to S3 under the job while they are written (worker/voice/stage_logs.py):
    # at most this long after a line is written, and once more when the attempt's steps end. 0: not shipped.
    log_ship_interval_s: Number = Field(10.0, alias="LOG_SHIP_INTERVAL_SECONDS", ge=0, le=3600)
    # A log ships at once when this many KiB are waiting; also the most one shipped chunk holds.
    log_ship_chunk_kib: WholeNumber = Field(1024, alias="LOG_SHIP_CHUNK_KIB", ge=64, le=64 * 1024)
    # Stages get a secret-free environment: a built-in allow-list (pipeline/stage_env.py) plus these names.
    stage_env_passthrough: Annotated[tuple[str, ...], _on_text(_stage_env_names)] = Field(
        default_factory=tuple, alias="STAGE_ENV_PASSTHROUGH")
    # After the commit a job's work directory is emptied except its logs/; true keeps every file.
    keep_work_files: Switch = Field(False, alias="KEEP_WORK_FILES")
    # Where the artifacts are published for the profile's modelPaths (unset: <WORK_ROOT>/.models).
    models_root: str | None = Field(None, alias="MODELS_ROOT")
    # The host's cache of the pipeline's [base_model], shared by its workers (unset: <WORK_ROOT>/.base-models).
    base_model_cache_dir: str | None = Field(None, alias="BASE_MODEL_CACHE_DIR")
    # Below this much free space on WORK_ROOT's file system the worker refuses to start (host unfit).
    work_min_free_bytes: WholeNumber = Field(2 * 1024**3, alias="WORK_MIN_FREE_BYTES", ge=0)
    # Jobs' stage logs left on the host are pruned past this age (0: kept whatever their age) ...
    stage_logs_max_age_days: WholeNumber = Field(14, alias="STAGE_LOGS_MAX_AGE_DAYS", ge=0, le=3650)
    # ... and, oldest first, while all of them together hold more than this (0: no size bound).
    stage_logs_max_bytes: WholeNumber = Field(1024**3, alias="STAGE_LOGS_MAX_BYTES", ge=0)

    # --- time
    job_time_limit_s: WholeNumber = Field(21_600, alias="JOB_TIME_LIMIT_SECONDS", ge=1, le=SQS_MAX_VISIBILITY_S)
    shutdown_grace_s: Number = Field(60.0, alias="SHUTDOWN_GRACE_SECONDS", ge=0, le=SQS_MAX_VISIBILITY_S)
    # The reconciler: a processing job whose lease ended this long ago lost its worker (unset: the job
    # time limit + visibility timeout + longest backoff + 1 h); a pending job never enqueued this long
    # after its creation is enqueued again, once.
    reconcile_stale_after_s: WholeNumber | None = Field(None, alias="RECONCILE_STALE_AFTER_SECONDS",
                                                        ge=1, le=SQS_MAX_RETENTION_S)
    reconcile_pending_after_s: WholeNumber = Field(1800, alias="RECONCILE_PENDING_AFTER_SECONDS",
                                                   ge=1, le=SQS_MAX_RETENTION_S)
    # Leases are judged on the store's clock; a host whose clock is further off than this from the
    # store's refuses to start (AWS refuses requests signed more than 15 min off, hence the cap).
    max_clock_skew_s: Number = Field(10.0, alias="MAX_CLOCK_SKEW_SECONDS", gt=0, le=900)

    # --- downloads
    download_timeout_s: Number = Field(60.0, alias="DOWNLOAD_TIMEOUT_SECONDS", gt=0, le=SQS_MAX_VISIBILITY_S)
    download_max_bytes: WholeNumber = Field(2 * 1024**3, alias="DOWNLOAD_MAX_BYTES", ge=1)
    # Recordings on the wire at once for a job (each takes its declared length of MAX_JOB_DOWNLOAD_BYTES,
    # or DOWNLOAD_MAX_BYTES when it declares none).
    download_concurrency: WholeNumber = Field(8, alias="DOWNLOAD_CONCURRENCY", ge=1, le=64)
    # Local runs only: lets recordings come from loopback/private hosts (never in production).
    download_allow_private_hosts: Switch = Field(False, alias="DOWNLOAD_ALLOW_PRIVATE_HOSTS")
    # s3:// recordings must be in this bucket (unset: s3:// recordings are refused), under this key
    # prefix, in which {profileId} stands for the message's profileId: no job reads another's files.
    recordings_s3_bucket: str | None = Field(None, alias="RECORDINGS_S3_BUCKET")
    recordings_s3_key_prefix: Annotated[str, _on_text(_key_prefix)] = Field(
        "recordings/{profileId}/", alias="RECORDINGS_S3_KEY_PREFIX")

    # --- limits: what one job may ask for; past a limit the job fails permanently
    max_recordings_per_job: WholeNumber = Field(500, alias="MAX_RECORDINGS_PER_JOB", ge=1, le=100_000)
    max_text_chars: WholeNumber = Field(2000, alias="MAX_TEXT_CHARS", ge=1)
    max_job_download_bytes: WholeNumber = Field(8 * 1024**3, alias="MAX_JOB_DOWNLOAD_BYTES", ge=1)
    max_recording_seconds: Number = Field(1800.0, alias="MAX_RECORDING_SECONDS", gt=0, le=MAX_AUDIO_S)
    max_job_audio_seconds: Number = Field(36_000.0, alias="MAX_JOB_AUDIO_SECONDS", gt=0, le=MAX_AUDIO_S)

    # --- dataset
    # Recordings the dataset step converts at once (unset: the CPUs this process may run on).
    dataset_workers: WholeNumber = Field(default_factory=usable_cpus, alias="DATASET_WORKERS", ge=1)

    # --- observability and identity
    sentry_dsn: str | None = Field(None, alias="SENTRY_DSN", repr=False)
    # Any case: `debug` is what people type (logging's own names are upper case).
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], _on_text(str.upper)] = Field(
        "INFO", alias="LOG_LEVEL")
    log_format: Literal["json", "console"] = Field("json", alias="LOG_FORMAT")
    worker_id: str = Field(default_factory=_default_worker_id, alias="WORKER_ID")
    # A file the loop and the heartbeat touch while alive; `python -m worker health` checks its age.
    liveness_file: str | None = Field(None, alias="LIVENESS_FILE")
    liveness_max_age_s: Number | None = Field(None, alias="LIVENESS_MAX_AGE_SECONDS", gt=0, le=MAX_AGE_LIMIT_S)
    # Health fails once the queue or the store has not answered for this long (worker.core.healthcheck).
    health_unreachable_after_s: Number = Field(300.0, alias="HEALTH_UNREACHABLE_AFTER_SECONDS", gt=0,
                                               le=MAX_AGE_LIMIT_S)
    # A running trainer stage logs one `stage.progress` line (step, percent, ETA, latest metrics) this
    # often, and emits its latest training metrics (worker/voice/records/attempt.py).
    progress_log_interval_s: Number = Field(60.0, alias="PROGRESS_LOG_INTERVAL_SECONDS", ge=1, le=86_400)
    # Set by systemd for Type=notify units: READY, WATCHDOG and STOPPING go there.
    notify_socket: str | None = Field(None, alias="NOTIFY_SOCKET")
    # CloudWatch embedded metric format, one JSON object per line on stdout (worker/core/metrics.py).
    metrics_enabled: Switch = Field(True, alias="METRICS_ENABLED")
    metrics_namespace: str = Field("VoiceWorker", alias="METRICS_NAMESPACE", min_length=1, max_length=255)
    # Name=Value pairs added to every metric, e.g. "Environment=production,Queue=jobs".
    metrics_dimensions: Annotated[dict[str, str], _on_text(_dimensions)] = Field(
        default_factory=dict, alias="METRICS_DIMENSIONS")
    # Job state-change events (worker/core/events.py): an SNS topic ARN or an EventBridge bus ARN; empty: none.
    events_target: Annotated[str, _on_text(_events_target)] = Field("", alias="EVENTS_TARGET")
    # OpenTelemetry spans for each job, its trace carried from `submit` (worker/core/tracing.py; the
    # `tracing` extra). Off by default.
    tracing_enabled: Switch = Field(False, alias="TRACING_ENABLED")

    # --- testing only: kill the process at a named point (see worker/core/faults.py); unset in production
    crash_at: Annotated[CrashPoint, _on_text(_crash_point)] | None = Field(None, alias="VOICE_WORKER_CRASH_AT")

    # --- AWS
    aws_endpoint_url: HttpUrlText | None = Field(None, alias="AWS_ENDPOINT_URL")
    aws_region: str | None = Field(None, alias="AWS_REGION")
    # Set by ECS in every task's containers: the agent's local endpoint, used for scale-in protection
    # while a job runs (worker/core/ecs_agent.py). Absent elsewhere, and then nothing is protected.
    ecs_agent_uri: HttpUrlText | None = Field(None, alias="ECS_AGENT_URI")
    # On EC2 spot: read the interruption notice from instance metadata this often and shut down as for
    # SIGTERM at the first one (worker/core/imds.py). 0: off (the default; ECS's spot draining sends
    # SIGTERM itself).
    spot_interruption_check_s: Number = Field(0.0, alias="SPOT_INTERRUPTION_CHECK_SECONDS", ge=0, le=SPOT_NOTICE_S)
    # Parsed here: the watch is handed the host and port.
    imds_endpoint: Annotated[Endpoint, _on_text(parse_endpoint)] = Field(DEFAULT_ENDPOINT, alias="IMDS_ENDPOINT")

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        # Run by pydantic only once every field is valid on its own.
        if problems := consistency_problems(self):
            raise ProblemLines(*problems)
        return self

    @property
    def heartbeat_interval_s(self) -> float:
        return self.sqs_visibility_heartbeat_interval_ms / 1000.0

    @property
    def models_root_path(self) -> str:
        # Here, not at the top: the idle worker loads none of the work directory's machinery.
        from pipeline.workdir import DEFAULT_MODELS_DIR

        return self.models_root or os.path.join(self.work_root, DEFAULT_MODELS_DIR)

    @property
    def base_model_cache_path(self) -> str:
        from pipeline.workdir import BASE_MODEL_CACHE_DIR_NAME

        return self.base_model_cache_dir or os.path.join(self.work_root, BASE_MODEL_CACHE_DIR_NAME)

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
    def presence_interval_s(self) -> float:
        """How often a worker writes its presence record: each heartbeat tick, but not more than every
        few seconds (the test suites' sub-second ticks would only load the store)."""
        return max(PRESENCE_MIN_INTERVAL_S, self.heartbeat_interval_s)

    @property
    def health_unreachable_limit_s(self) -> float:
        """HEALTH_UNREACHABLE_AFTER_SECONDS, raised to two of the longest quiet spells between contacts
        (a long poll, a heartbeat tick: the presence write and the renewals come once a tick), so a
        healthy worker with a long heartbeat is never called unreachable."""
        quiet_s = max(self.sqs_wait_time_s + 10, self.presence_interval_s)
        return min(MAX_AGE_LIMIT_S, max(self.health_unreachable_after_s, 2 * quiet_s))

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
        from worker.voice.languages import trainer_languages

        # A deployment that runs the real trainers (TRAINER_PYTHON set) takes only the languages they train.
        return InputPolicy(recordings_bucket=self.recordings_s3_bucket,
                           recordings_key_prefix=self.recordings_s3_key_prefix,
                           max_recordings=self.max_recordings_per_job, max_text_chars=self.max_text_chars,
                           languages=trainer_languages() if self.trainer_python else None)

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

    def log_shipping_config(self) -> LogShippingConfig | None:
        """Where attempts ship their step logs, or None when they do not (no bucket, or the interval 0)."""
        from worker.voice.stage_logs import LogShippingConfig

        if self.log_ship_interval_s <= 0 or not self.s3_bucket:
            return None
        return LogShippingConfig(bucket=self.s3_bucket, prefix=self.s3_prefix, interval_s=self.log_ship_interval_s,
                                 chunk_bytes=self.log_ship_chunk_kib * 1024)

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
    if problem := below_work_root_problem("BASE_MODEL_CACHE_DIR", s.work_root, s.base_model_cache_path):
        problems.append(problem)
    return problems


# Below this many milliseconds a heartbeat interval is surely seconds typed into the _MS setting
# (`=60`): ten renewals a second and more would only hammer SQS and the store. Refused.
HEARTBEAT_MIN_MS = 100
PRESENCE_MIN_INTERVAL_S = 5.0
# Below a second it may be meant (the test suites run such short ticks), or be seconds (`=300` for five
# minutes): the daemon starts, with a warning saying both readings (``settings_warnings``).
HEARTBEAT_SUSPECT_BELOW_MS = 1000


def heartbeat_unit_problem(interval_ms: int) -> str | None:
    """Why SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS is surely the wrong unit (below 100 ms), or None."""
    if interval_ms >= HEARTBEAT_MIN_MS:
        return None
    return (f"SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS={interval_ms} is in milliseconds, and a renewal every "
            f"{interval_ms} ms would hammer SQS and the store: for {interval_ms} s write {interval_ms * 1000} "
            f"(at least {HEARTBEAT_MIN_MS})")


def settings_warnings(s: Settings) -> list[str]:
    """What the daemon starts with but says at start, one line each: values that may be the wrong unit."""
    ms = s.sqs_visibility_heartbeat_interval_ms
    if ms < HEARTBEAT_SUSPECT_BELOW_MS:
        return [f"SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS={ms} renews every {ms} ms, under a second: if "
                f"{ms} s was meant, write {ms * 1000}"]
    return []


def _queue_time_problems(s: Settings) -> list[str]:
    """The rules between the heartbeat, the backoff, the time limit and SQS's 12 hours."""
    problems = []
    if problem := heartbeat_unit_problem(s.sqs_visibility_heartbeat_interval_ms):
        problems.append(problem)
    elif s.sqs_visibility_heartbeat_interval_ms >= s.sqs_visibility_timeout_s * 1000:
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
    return below_work_root_problem("MODELS_ROOT", work_root, models_root)


def below_work_root_problem(name: str, work_root: str, path: str) -> str | None:
    """Why ``path`` could meet a job's work directory (whose clean-up would remove it), or None."""
    work, inside = Path(os.path.abspath(work_root)), Path(os.path.abspath(path))
    if inside == work or work in inside.parents and re.fullmatch(SAFE_NAME, inside.relative_to(work).parts[0]):
        return (f"{name}={path} must not be WORK_ROOT or a directory below it that an environment name "
                "could take (use a name starting with a dot, or a path outside WORK_ROOT)")
    if inside in work.parents:
        return f"{name}={path} must not hold WORK_ROOT={work_root}"
    return None


@dataclass(frozen=True, slots=True)
class EnvSetting:
    """What one environment variable fills: the settings' field, its default (``MISSING`` when a
    factory makes it) or its ``default_factory`` (``MISSING`` when none), and whether it is a secret."""

    name: str
    env: str
    default: Any
    default_factory: Any
    secret: bool


def _env_setting(name: str, info: FieldInfo) -> EnvSetting:
    if info.alias is None:
        raise TypeError(f"Settings.{name} names no environment variable (its alias)")
    return EnvSetting(name=name, env=info.alias,
                      default=MISSING if info.default is PydanticUndefined else info.default,
                      default_factory=MISSING if info.default_factory is None else info.default_factory,
                      secret=not info.repr)


# Each environment variable's setting, in the order of the fields above.
FIELD_OF_ENV: dict[str, EnvSetting] = {
    setting.env: setting for setting in (_env_setting(name, info) for name, info in Settings.model_fields.items())}
ENV_NAMES = tuple(FIELD_OF_ENV)


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Build the settings from ``environ`` (default: the process environment) or raise ConfigError."""
    source = os.environ if environ is None else environ
    values = {name: raw for name in ENV_NAMES if (raw := source.get(name, "")) != ""}
    try:
        return Settings.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(problem_lines(exc, values)) from None


# pydantic's error types in our words; a bound is shown as the field declares it (pydantic's context
# has a float field's bound as a float: "at most 43200.0").
_RULES = {
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be more than {gt}",
    "int_type": "must be a whole number",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be text",
}


def problem_lines(exc: ValidationError, values: Mapping[str, Any]) -> list[str]:
    """Pydantic's errors as our lines, one per problem: ``NAME=value: must be ...`` (a secret's value and
    pydantic's own wording never shown; a value with a line break quoted, so one problem stays one line),
    or the whole lines a rule of ours wrote."""
    lines: list[str] = []
    for error in exc.errors(include_url=False):
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, ProblemLines):
            lines.extend(cause.lines)
            continue
        name = str(error["loc"][0]) if error["loc"] else ""
        setting = FIELD_OF_ENV.get(name)
        if setting is None:  # not a variable's error: the model's own (a key no setting reads, say)
            lines.append(f"{name or 'settings'}: is not a setting" if error["type"] == "extra_forbidden"
                         else f"{name or 'settings'}: invalid")
            continue
        rule = str(cause) if cause is not None else _rule(error["type"], error.get("ctx", {}), setting)
        shown = "" if setting.secret else f"={_shown(values.get(name, error.get('input')))}"
        lines.append(f"{name}{shown}: {rule}")
    return lines


def _rule(kind: str, context: dict[str, Any], setting: EnvSetting) -> str:
    info = Settings.model_fields[setting.name]
    declared = {key: value for m in info.metadata for key in ("ge", "gt", "le", "lt", "min_length", "max_length")
                if (value := getattr(m, key, None)) is not None}
    if kind in ("string_too_short", "string_too_long"):
        low, high = declared.get("min_length"), declared.get("max_length")
        return f"must be {low}-{high} characters" if low is not None and high is not None else (
            f"must be at least {low} characters" if low is not None else f"must be at most {high} characters")
    if kind == "literal_error":
        return f"must be one of {', '.join(map(str, get_args(info.annotation)))}"
    if kind in _RULES:
        return _RULES[kind].format(**{**context, **declared})
    return "is not a valid value"


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
