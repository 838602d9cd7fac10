"""Wiring: settings in, a ready Worker out. The only place that knows every concrete adapter."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from pipeline.config import load_pipeline_config
from pipeline.stage_env import stage_env_problems, stage_environment
from worker import __version__
from worker.core.aws import LazyClient, lease_client_config, make_client, new_session, notice_client_config
from worker.core.ecs_agent import task_protection
from worker.core.errors import ConfigError
from worker.core.events import Events, NoEvents, Publisher, target_service
from worker.core.faults import CrashPoints
from worker.core.health import Liveness
from worker.core.imds import InstanceMetadata, SpotWatch
from worker.core.loop import Worker
from worker.core.metrics import Metrics
from worker.core.presence import Identity, Presence
from worker.core.queue import Queue
from worker.core.reporting import Reporter
from worker.settings import Settings, daemon_targets, settings_warnings
from worker.voice.message import log_fields as message_log_fields
from worker.voice.records import Store, open_store
from worker.voice.records.rules import clock_skew_problem

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from pipeline.config import PipelineConfig
    from pipeline.remote_work import RemoteWorkConfig
    from worker.core.core_config import AwsConfig
    from worker.voice.job import Trainer, VoiceJobHandler

log = structlog.get_logger(__name__)


@dataclass
class App:
    worker: Worker
    store: Store
    pulse: Liveness
    spot_watch: SpotWatch | None = None
    presence: Presence | None = None

    def start(self) -> None:
        """Start what runs beside the loop (the spot watch, the presence writer), just before the loop."""
        if self.presence is not None:
            self.presence.start()
        if self.spot_watch is not None:
            self.spot_watch.start()

    def close(self) -> None:
        if self.spot_watch is not None:
            self.spot_watch.close()
        if self.presence is not None:
            self.presence.close(remove=clean_exit(self.worker))
        self.store.close()


def clean_exit(worker: Worker) -> bool:
    """The loop ended because a stop or a drain was asked for, on a fit host: its presence goes with it.
    A crash or an unfit host leaves the record, which goes stale (or says unfit) for operators to see."""
    asked = worker.shutdown.requested.is_set() or worker.draining.is_set()
    return asked and getattr(worker, "unfit", None) is None


def device_of(config: PipelineConfig) -> str | None:
    """What the pipeline trains on, for the presence record: cuda when a stage declares it, cpu when
    every stage that declares a device says cpu, else None (unknown)."""
    declared = {stage.device for stage in config.stages if stage.device is not None}
    if "cuda" in declared:
        return "cuda"
    return "cpu" if declared else None


def log_shipping(settings: Settings, trainer: Trainer, aws: AwsConfig, session) -> Trainer:
    """The trainer, shipping each attempt's step logs to S3 while it trains (LOG_SHIP_INTERVAL_SECONDS)."""
    from worker.voice.stage_logs import LogShipping, S3Logs, ShippingTrainer

    config = settings.log_shipping_config()
    if config is None:
        return trainer
    # Short timeouts and few retries: a shipment that fails is tried again at the next interval.
    s3 = LazyClient(lambda: make_client("s3", aws, session, config=notice_client_config(aws)))
    return ShippingTrainer(trainer, LogShipping(S3Logs(s3, config.bucket, config.prefix), config))


def refuse_clock_skew(store: Store, max_skew_s: float) -> None:
    """ConfigError when this host's clock is off from the store's by more than ``max_skew_s``.

    Leases are stamped and judged on the store's clock alone; the margin guards what still reads the
    host's clock (log times, signed AWS requests, operators comparing the two).
    """
    offset_s = store.clock_offset_s()
    log.info("worker.store_clock", offset_s=round(offset_s, 3), max_skew_s=max_skew_s)
    if problem := clock_skew_problem(offset_s, max_skew_s):
        raise ConfigError(problem)


def remote_work(settings: Settings) -> RemoteWorkConfig | None:
    """Where attempts mirror their work in S3; None when off, or when the work root is shared (NFS,
    EFS): every host then sees every attempt's files, and a mirror would only copy them twice."""
    from pipeline.remote_work import shared_file_system

    config = settings.remote_work_config()
    if config is not None and (fstype := shared_file_system(Path(settings.work_root))):
        log.info("remote_work.off", reason=f"WORK_ROOT is on a shared file system ({fstype})")
        return None
    return config


def ready_host(settings: Settings, config: PipelineConfig, *, s3=None, env: Mapping[str, str] | None = None,
               wait: Callable[[float], None] | None = None) -> PipelineConfig:
    """Run the host checks in order (``pipeline.host``): ``HostUnfit`` at the first that fails, before any
    receive; returns the config with ``{base_model_dir}`` pointing at the verified cache entry."""
    from pipeline.base_model_cache import BaseModelCache
    from pipeline.host import check_host, readiness_checks

    cache = BaseModelCache(Path(settings.base_model_cache_path), wait=wait or time.sleep)
    check_host(readiness_checks(config, work_root=Path(settings.work_root),
                                min_free_bytes=settings.work_min_free_bytes, cache=cache, s3=s3, env=env))
    if config.base_model is None:
        return config
    return replace(config, base_model_dir=os.path.abspath(cache.entry(config.base_model)))


# What the reference stand-in never trains unless ALLOW_STAND_IN_TRAINER allows it (issue #29).
STAND_IN_REFUSED_ENVIRONMENTS = frozenset({"staging", "production"})


def stand_in_refusals(stand_in: bool, allowed: bool) -> frozenset[str]:
    """The environments whose jobs the handler refuses: staging and production when the pipeline is the
    reference stand-in ([pipeline] stand_in = true) and ALLOW_STAND_IN_TRAINER is false."""
    if not stand_in or allowed:
        return frozenset()
    log.info("worker.stand_in", refused_environments=sorted(STAND_IN_REFUSED_ENVIRONMENTS),
             note="the pipeline is the reference stand-in: staging and production jobs are refused")
    return STAND_IN_REFUSED_ENVIRONMENTS


def build_app(settings: Settings, *, session=None, wait: Callable[[float], None] | None = None) -> App:
    """Check everything that can be checked before the first receive, then assemble the worker.

    ``wait(s)`` is the store's pause between connect attempts, and ``wait(0)`` comes before the store
    is opened: the daemon's raises once a stop or drain is requested (``worker.core.daemon.Requests``),
    which ends the start-up there."""
    # Cheapest checks first: a bad pipeline file must not wait on a store connection.
    config = load_pipeline_config(settings.pipeline_config, settings.trainer_python)
    if problems := stage_env_problems(settings.stage_env_passthrough):
        raise ConfigError(problems)
    # Read once, here: stages get this allow-listed copy, never the worker's own environment.
    stage_env = stage_environment(os.environ, settings.stage_env_passthrough)
    # One session for every client: each session loads and keeps its own copy of the service models.
    session = session or new_session()
    aws = settings.aws_config()
    sqs = make_client("sqs", aws, session)
    targets = daemon_targets(settings)  # the queue and the bucket, as plain strings
    # Before the store: a mistyped queue URL must not create a SQLite file or wait on MongoDB.
    Queue(sqs, targets.queue_url).check_exists()
    # Made at the first download or upload: an idle worker never needs the S3 model in memory.
    s3 = LazyClient(lambda: make_client("s3", aws, session))
    # Before the store and long before the first receive: a host that cannot run jobs takes none, and
    # spends no job's attempt on finding out (exit 7, worker.core.daemon.EXIT_HOST_UNFIT).
    config = ready_host(settings, config, s3=s3, env=stage_env, wait=wait)
    if wait is not None:
        wait(0)
    store = open_store(settings.store_config(), sleep=wait)
    try:
        refuse_clock_skew(store, settings.max_clock_skew_s)
    except BaseException:
        store.close()
        raise
    crash_points = CrashPoints(settings.crash_at)
    metrics = Metrics.from_config(settings.metrics_config())
    events: Events = NoEvents()
    if settings.events_target:
        service = target_service(settings.events_target)
        events = Publisher(settings.events_target, LazyClient(
            lambda: make_client(service, aws, session, config=notice_client_config(aws))).made)
    limits, policy = settings.job_limits(), settings.input_policy()

    def job_handler() -> VoiceJobHandler:
        from pipeline.run import DATASET_STEP, DOWNLOAD_STEP, PipelineTrainer
        from worker.voice.artifacts import ArtifactUploader
        from worker.voice.job import HandlerConfig, VoiceJobHandler
        from worker.voice.records.training import plan_of

        trainer = PipelineTrainer(config, settings.download_settings(), s3_client=s3, limits=limits,
                                  stage_env=stage_env, grace_s=settings.stage_stop_grace_s,
                                  crash_points=crash_points, remote=remote_work(settings))
        handler_config = HandlerConfig(
            work_root=Path(settings.work_root),
            s3_prefix=settings.s3_prefix,
            worker_id=settings.worker_id,
            lease_s=settings.sqs_visibility_timeout_s,
            models_root=Path(settings.models_root_path),
            keep_work_files=settings.keep_work_files,
            max_failed_attempts=settings.max_failed_attempts,
            max_host_fault_releases=settings.host_fault_max_releases,
            work_min_free_bytes=settings.work_min_free_bytes,
            stage_logs_max_age_s=settings.stage_logs_max_age_days * 86_400.0,
            stage_logs_max_bytes=settings.stage_logs_max_bytes,
            policy=policy,
            artifacts=config.artifact_keys,
            quality=config.quality,
            refused_environments=stand_in_refusals(config.stand_in, settings.allow_stand_in_trainer),
            base_model=config.base_model.identity.as_record() if config.base_model is not None else None,
            stage_plan=plan_of(config.stages, (DOWNLOAD_STEP, DATASET_STEP)),
            progress_log_interval_s=settings.progress_log_interval_s,
        )
        return VoiceJobHandler(
            handler_config,
            store=store,
            uploader=ArtifactUploader(s3, targets.bucket),
            train=log_shipping(settings, trainer, aws, session),
            crash_points=crash_points,
            metrics=metrics,
            events=events,
            forget_remote_work=trainer.forget_remote_work,
        )

    # Made at start, not at the first message: deferring it would spare an idle worker about 2.5 MiB
    # until then, but a broken install (a module of the job path that does not import) would then
    # crash at a message, holding it invisible, again after every restart, instead of failing here.
    handler = job_handler()
    pulse = Liveness(settings.liveness_file, settings.notify_socket, max_age_s=settings.liveness_age_limit_s,
                     unreachable_after_s=settings.health_unreachable_limit_s)
    presence = Presence(Identity(settings.worker_id, socket.gethostname(), __version__, device_of(config)), store,
                        interval_s=settings.presence_interval_s,
                        stopping=lambda: worker.shutdown.requested.is_set() or worker.draining.is_set(),
                        unfit=lambda: getattr(worker, "unfit", None) is not None,
                        on_written=lambda: pulse.reached("store"))
    lease_sqs = make_client("sqs", aws, session, config=lease_client_config(aws))
    worker = Worker(settings.loop_config(), Queue(sqs, targets.queue_url, lease_client=lease_sqs),
                    handler, reporter=Reporter(settings.sentry_dsn), alive=pulse.beat,
                    crash_points=crash_points, metrics=metrics,
                    activity=presence.activity(pulse.announcing(task_protection(settings.ecs_agent_uri, metrics))),
                    log_fields=message_log_fields, reached=pulse.reached)
    spot_watch = None
    if settings.spot_interruption_check_s > 0:
        def reclaimed() -> None:  # as SIGTERM does (worker.core.daemon): systemd hears it at once
            pulse.stopping()
            worker.stop(notice=True)  # the agent's SIGTERM that may follow must not end the grace

        spot_watch = SpotWatch(InstanceMetadata(settings.imds_endpoint), settings.spot_interruption_check_s,
                               on_notice=reclaimed)
    for warning in settings_warnings(settings):
        log.warning("settings.suspect", problem=warning)
    return App(worker=worker, store=store, pulse=pulse, spot_watch=spot_watch, presence=presence)

