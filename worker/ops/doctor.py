"""`python -m worker doctor`: checks a deployment before it takes its first job, one PASS/FAIL/WARN line
each. A WARN is a finding the worker runs despite (say, metrics no alarm will see): it does not fail."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError

from worker.core.aws import aws_error_text
from worker.core.errors import WorkerError
from worker.core.queue import Queue
from worker.core.redact import redact_url
from worker.settings import Settings, daemon_targets


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    warn_only: bool = False  # a finding that is not ok is a WARN, and leaves the exit code at 0


def queue_checks(settings: Settings, attrs: dict, dlq_attrs: dict | None) -> list[Check]:
    """Pure checks on the queue's attributes (and its DLQ's) against the worker's settings."""
    checks = []
    policy = attrs.get("RedrivePolicy")
    if policy:
        max_receives = int(json.loads(policy).get("maxReceiveCount", 0))
        checks.append(Check("redrive policy", max_receives >= 2,
                            f"maxReceiveCount={max_receives} (needs at least 2 so retries can happen)"))
        # SQS counts every receive, releases for a deploy or a spot reclaim too: at or below the
        # worker's own budget it dead-letters healthy jobs before their failures do.
        checks.append(Check(
            "retry backstop", max_receives > settings.max_failed_attempts,
            # Worded without the setting's name: its "FAIL" would read as a failed check.
            f"maxReceiveCount={max_receives}, the worker's retry budget {settings.max_failed_attempts} "
            "(SQS also counts interruptions: keep it well above the budget, e.g. 20)",
            warn_only=True))
    else:
        checks.append(Check("redrive policy", False,
                            "the queue has no RedrivePolicy: permanent failures cannot be dead-lettered"))
    visibility_s = int(attrs.get("VisibilityTimeout", 30))
    # The worker sets its own timeout on every receive; the queue's default still governs every other
    # consumer (redrive tooling, consoles), so it should not be shorter than the worker's lease.
    checks.append(Check(
        "queue visibility", visibility_s >= settings.sqs_visibility_timeout_s,
        f"queue VisibilityTimeout={visibility_s} s, worker lease SQS_VISIBILITY_TIMEOUT_SECONDS="
        f"{settings.sqs_visibility_timeout_s} s (the queue's should be at least the worker's)"))
    checks.append(Check(
        "long polling", settings.sqs_wait_time_s >= 1,
        f"SQS_WAIT_TIME_SECONDS={settings.sqs_wait_time_s} (0 means short polling: more requests, more cost)"))
    if dlq_attrs is not None:
        source_s = int(attrs.get("MessageRetentionPeriod", 345600))
        dlq_s = int(dlq_attrs.get("MessageRetentionPeriod", 345600))
        checks.append(Check("dead-letter retention", dlq_s > source_s,
                            f"DLQ keeps messages {dlq_s} s, the queue {source_s} s (the DLQ must keep them longer)"))
    return checks


def run_checks(settings: Settings, *, sqs, s3, sts, open_store: Callable, load_pipeline: Callable) -> list[Check]:
    targets = daemon_targets(settings)  # ConfigError without a queue, store or bucket
    checks: list[Check] = []
    try:
        who = sts.get_caller_identity()
        checks.append(Check("credentials", True, f"account {who.get('Account')} as {who.get('Arn')}"))
    except (ClientError, BotoCoreError) as exc:
        checks.append(Check("credentials", False, aws_error_text(exc)))

    attrs = None
    queue = Queue(sqs, targets.queue_url)
    try:
        attrs = queue.attributes("All")
        checks.append(Check("queue reachable", True, targets.queue_url))
    except WorkerError as exc:
        checks.append(Check("queue reachable", False, str(exc)))
    if attrs is not None:
        dlq_attrs = None
        try:
            dlq_url = queue.dead_letter_url(attrs)
            if dlq_url is not None:
                dlq_attrs = Queue(sqs, dlq_url).attributes("All")
        except WorkerError as exc:
            checks.append(Check("dead-letter queue reachable", False, str(exc)))
        checks.extend(queue_checks(settings, attrs, dlq_attrs))

    key = f"{settings.s3_prefix.strip('/') + '/' if settings.s3_prefix.strip('/') else ''}.doctor/{uuid.uuid4().hex}"
    try:
        s3.put_object(Bucket=targets.bucket, Key=key, Body=b"voice-worker doctor probe")
        s3.delete_object(Bucket=targets.bucket, Key=key)
        checks.append(Check("bucket writable", True, f"s3://{targets.bucket}/{key} written and removed"))
    except (ClientError, BotoCoreError) as exc:
        checks.append(Check("bucket writable", False, f"s3://{targets.bucket}: {aws_error_text(exc)}"))

    try:
        store = open_store(settings)
        try:
            store.get_job("doctor-probe")
        finally:
            store.close()
        checks.append(Check("store reachable", True, store_description(settings)))
    except WorkerError as exc:
        checks.append(Check("store reachable", False, str(exc)))

    config = None
    try:
        config = load_pipeline(settings.pipeline_config, settings.trainer_python)
        checks.append(Check("pipeline config", True,
                            f"{settings.pipeline_config}: {len(config.stages)} stages"))
    except WorkerError as exc:
        checks.append(Check("pipeline config", False, str(exc).replace("\n", "; ")))
    if config is not None:
        checks.append(stand_in_check(settings, config))
        checks.extend(host_checks(settings, config, s3))
    checks.append(job_code_check())
    checks.append(metrics_dimensions_check(settings))
    return checks


def stand_in_check(settings: Settings, config) -> Check:
    """WARN when the pipeline is the reference stand-in (``[pipeline] stand_in = true``): it trains no voice."""
    if config.stand_in:
        return Check("pipeline is real", False,
                     f"{settings.pipeline_config} is the reference stand-in ([pipeline] stand_in = true): "
                     "its models clone no voice, and staging or production jobs are refused; set "
                     "PIPELINE_CONFIG to a real trainer's config (config/pipeline.real.toml)", warn_only=True)
    return Check("pipeline is real", True, f"{settings.pipeline_config} is not marked stand_in")


def host_checks(settings: Settings, config, s3) -> list[Check]:
    """The worker's start-up host checks (``pipeline.host``), each a PASS or a FAIL: a FAIL is a host the
    daemon refuses to start on (exit 7). The base model is fetched into the cache when absent, as the
    worker's start would."""
    import os
    from pathlib import Path

    from pipeline.base_model_cache import BaseModelCache
    from pipeline.errors import HostUnfit
    from pipeline.host import readiness_checks
    from pipeline.stage_env import stage_environment

    checks = []
    # The probe gets what a stage gets (the allow-list), never this command's whole environment.
    env = stage_environment(os.environ, settings.stage_env_passthrough)
    for check in readiness_checks(config, work_root=Path(settings.work_root),
                                  min_free_bytes=settings.work_min_free_bytes,
                                  cache=BaseModelCache(Path(settings.base_model_cache_path)), s3=s3, env=env):
        try:
            checks.append(Check(check.name, True, check.run()))
        except HostUnfit as exc:
            checks.append(Check(check.name, False, f"{exc.problem} (the worker would exit 7: host unfit)"))
    checks.append(work_root_use_check(settings))
    return checks


def work_root_use_check(settings: Settings) -> Check:
    """What the jobs hold under WORK_ROOT (a figure to watch, never a failure): bytes, job directories
    (ended ones hold only their logs, pruned by STAGE_LOGS_MAX_AGE_DAYS and STAGE_LOGS_MAX_BYTES), free."""
    from pathlib import Path

    from pipeline.workdir import work_root_usage

    use = work_root_usage(Path(settings.work_root))
    return Check("work root use", True,
                 f"{settings.work_root}: {use.bytes} bytes in {use.jobs} job directories ({use.ended_jobs} ended, "
                 f"logs only), {use.free_bytes} bytes free; ended jobs' logs are kept "
                 f"{settings.stage_logs_max_age_days} days, {settings.stage_logs_max_bytes} bytes at most")


def store_description(settings: Settings) -> str:
    """Which store the records are in, as an operator can tell it apart: never the URI's credentials."""
    if not settings.mongo_uri:
        return f"sqlite:///{settings.sqlite_path}"
    # The URI's own database wins over MONGO_DATABASE, as when the store opens it.
    path = settings.mongo_uri.partition("://")[2].partition("/")[2]
    database = path.partition("?")[0] or settings.mongo_database
    return (f"MongoDB at {redact_url(settings.mongo_uri).rstrip('/')}, database {database}, collections "
            f"{settings.mongo_jobs_collection} and {settings.mongo_profiles_collection}")


# The dimension names config/cloudwatch-alarms.yaml matches; an alarm sees one exact dimension set.
ALARM_DIMENSIONS = ("Environment", "Queue")


def metrics_dimensions_check(settings: Settings) -> Check:
    """Whether the metrics carry the dimension set the shipped alarms match: without it they never fire."""
    name, wanted = "metrics dimensions", ",".join(f"{d}=<...>" for d in ALARM_DIMENSIONS)
    if not settings.metrics_enabled:
        return Check(name, False, "METRICS_ENABLED=false: no metrics, so no alarm on them fires", warn_only=True)
    if not settings.metrics_dimensions:
        return Check(name, False, f"METRICS_DIMENSIONS is empty: the alarms in config/cloudwatch-alarms.yaml "
                                  f"match {wanted} and never fire", warn_only=True)
    shown = ",".join(f"{k}={v}" for k, v in settings.metrics_dimensions.items())
    if sorted(settings.metrics_dimensions) != sorted(ALARM_DIMENSIONS):
        return Check(name, False, f"METRICS_DIMENSIONS={shown}: the alarms in config/cloudwatch-alarms.yaml "
                                  f"match exactly {wanted}", warn_only=True)
    return Check(name, True, f"METRICS_DIMENSIONS={shown}")


# The job path: a broken install (a module that does not import) shows here before any deployment runs it.
JOB_MODULES = ("worker.voice.job", "worker.voice.artifacts", "pipeline.run")


def job_code_check(modules: tuple[str, ...] = JOB_MODULES) -> Check:
    """Whether the job's code imports, checked from an operator's shell before the daemon starts."""
    import importlib

    try:
        for name in modules:
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding, reported as one line
        return Check("job code loads", False, f"{name}: {type(exc).__name__}: {exc}")
    return Check("job code loads", True, ", ".join(modules))


def report(checks: list[Check], out=None) -> int:
    out = out or sys.stdout  # looked up per call, so a replaced sys.stdout (tests, wrappers) is honoured
    for c in checks:
        verdict = "PASS" if c.ok else "WARN" if c.warn_only else "FAIL"
        print(f"{verdict}  {c.name}: {c.detail}", file=out)
    failed = [c for c in checks if not c.ok and not c.warn_only]
    warned = [c for c in checks if not c.ok and c.warn_only]
    summary = f"{len(checks) - len(failed) - len(warned)} passed, {len(failed)} failed"
    print(f"\n{summary}, {len(warned)} warned" if warned else f"\n{summary}", file=out)
    return 1 if failed else 0
