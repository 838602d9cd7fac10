"""The systemd units: notify + watchdog, a stop that outlasts the grace, hardening that keeps the GPU,
restarts that outlast an outage, memory caps, and metrics in the file the CloudWatch agent sends."""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

import pytest

from tests.deploy.files import REPO, read_unit, store_connect_worst_s, timespan_s
from worker.settings import ENV_NAMES, load_settings

UNITS = {
    "single": REPO / "config" / "voice-worker.service",
    "template": REPO / "config" / "voice-worker@.service",
}
# Environment= names that are not worker settings but are set on purpose.
OTHER_ENV = {"CUDA_VISIBLE_DEVICES", "HOME", "PYTHONUNBUFFERED"}
# Past the grace the worker still stops the trainer, releases the message and closes the store.
RELEASE_MARGIN_S = 30


@pytest.fixture(params=sorted(UNITS), scope="module")
def unit(request):
    return read_unit(UNITS[request.param])


@pytest.fixture(scope="module")
def template():
    return read_unit(UNITS["template"])


def _settings_from(unit):
    """The worker settings the unit's own Environment= lines produce (instance 0 for the template)."""
    env = {k: v.replace("%i", "0").replace("%H", "host") for k, v in unit.environment().items()}
    return load_settings({k: v for k, v in env.items() if k in ENV_NAMES})


def test_service_is_notify_with_a_watchdog(unit):
    """Type=notify with NotifyAccess=main, and a WatchdogSec that tolerates several missed heartbeats."""
    assert unit.value("Service", "Type") == "notify"
    assert unit.value("Service", "NotifyAccess") == "main"
    settings = _settings_from(unit)
    watchdog_s = timespan_s(unit.value("Service", "WatchdogSec"))
    assert watchdog_s >= 3 * settings.heartbeat_interval_s
    assert watchdog_s >= 3 * settings.sqs_wait_time_s


def test_stop_signals_the_main_process_and_outlasts_the_grace(unit):
    """SIGTERM to the worker only (KillMode=mixed) and TimeoutStopSec beyond SHUTDOWN_GRACE_SECONDS."""
    assert unit.value("Service", "KillSignal") == "SIGTERM"
    assert unit.value("Service", "KillMode") == "mixed"
    grace_s = _settings_from(unit).shutdown_grace_s
    assert "SHUTDOWN_GRACE_SECONDS" in unit.environment()  # stated, not left to the default
    assert timespan_s(unit.value("Service", "TimeoutStopSec")) >= grace_s + RELEASE_MARGIN_S


def test_start_timeout_outlasts_the_store_connect_retries(unit):
    """TimeoutStartSec leaves room for every MongoDB connect attempt before READY=1 is due."""
    settings = _settings_from(unit)
    assert timespan_s(unit.value("Service", "TimeoutStartSec")) > store_connect_worst_s(settings)


def test_restarts_on_failure_but_not_on_configuration_errors(unit):
    """Restart=on-failure with a RestartSec, and exit 2 (bad settings) is not restarted."""
    from worker.core.daemon import EXIT_CONFIG

    assert unit.value("Service", "Restart") == "on-failure"
    assert timespan_s(unit.value("Service", "RestartSec")) > 0
    assert str(EXIT_CONFIG) in unit.value("Service", "RestartPreventExitStatus").split()


def test_runs_the_venv_worker_as_a_dedicated_user(unit):
    """ExecStart is the venv's python -m worker run, under a dedicated non-root User and Group."""
    argv = shlex.split(unit.value("Service", "ExecStart"))
    assert argv[0].endswith("/.venv/bin/python") and argv[1:] == ["-m", "worker", "run"]
    assert unit.value("Service", "User") == unit.value("Service", "Group") == "voice-worker"


def test_reads_the_shared_env_file(unit):
    """The first EnvironmentFile is /etc/voice-worker/worker.env, required (no leading dash)."""
    assert unit.values("Service", "EnvironmentFile")[0] == "/etc/voice-worker/worker.env"


def test_environment_is_valid_and_names_only_known_settings(unit):
    """Every Environment= name is a worker setting (or a deliberate extra) and the values load."""
    assert set(unit.environment()) <= set(ENV_NAMES) | OTHER_ENV
    _settings_from(unit)  # raises ConfigError on an invalid value


def test_hardening_leaves_only_the_work_root_and_runtime_dir_writable(unit):
    """ProtectSystem=strict and friends, with WORK_ROOT under ReadWritePaths and the liveness file
    under the unit's RuntimeDirectory (the only writable places left)."""
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes",
                       "ProtectHome": "yes"}.items():
        assert unit.value("Service", key) == value
    env = unit.environment()
    writable = [PurePosixPath(p) for p in unit.value("Service", "ReadWritePaths").split()]
    work_root = PurePosixPath(env["WORK_ROOT"])
    assert work_root.is_absolute() and any(work_root.is_relative_to(p) for p in writable)
    runtime = PurePosixPath("/run") / unit.value("Service", "RuntimeDirectory")
    assert PurePosixPath(env["LIVENESS_FILE"]).parent == runtime


@pytest.mark.parametrize("name", ["voice-worker.service", "voice-worker@.service",
                                  "voice-worker-reconcile.service"])
def test_files_are_created_without_world_access(name):
    """Every unit runs with UMask=0027: artifacts, logs and the SQLite file are not world-readable."""
    assert read_unit(REPO / "config" / name).value("Service", "UMask") == "0027"


def test_gpu_devices_stay_reachable(unit):
    """No setting that hides or filters devices: PrivateDevices, ProtectClock, DeviceAllow, DevicePolicy."""
    assert not unit.keys("Service") & {"PrivateDevices", "ProtectClock", "DeviceAllow", "DevicePolicy"}


def test_template_gives_each_instance_its_gpu_and_identity(template):
    """The instance name picks the GPU and names the worker, its liveness file and runtime directory."""
    env = template.environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "%i"
    for name in ("WORKER_ID", "LIVENESS_FILE"):
        assert "%i" in env[name]
    assert "%i" in template.value("Service", "RuntimeDirectory")


def test_template_reads_a_per_gpu_env_file_after_the_shared_one(template):
    """An optional worker-%i.env comes after worker.env, so its values override the shared ones."""
    assert template.values("Service", "EnvironmentFile") == [
        "/etc/voice-worker/worker.env",
        "-/etc/voice-worker/worker-%i.env",
    ]


def test_single_unit_identity_is_not_templated():
    """The plain unit has no instance specifiers, which would expand to nothing outside a template."""
    assert "%i" not in UNITS["single"].read_text()


@pytest.mark.parametrize("name", ["voice-worker.service", "voice-worker@.service",
                                  "voice-worker-reconcile.service"])
def test_metrics_carry_the_dimensions_the_alarms_match(name):
    """Every unit sets METRICS_DIMENSIONS to the Environment and Queue config/cloudwatch-alarms.yaml
    is deployed with by default, so its alarms see the worker's and the reconciler's metrics."""
    from cfnlint.decode import cfn_yaml

    alarms_path = REPO / "config" / "cloudwatch-alarms.yaml"
    params = cfn_yaml.loads(alarms_path.read_text(), str(alarms_path))["Parameters"]
    env = read_unit(REPO / "config" / name).environment()
    dimensions = load_settings({"METRICS_DIMENSIONS": env["METRICS_DIMENSIONS"]}).metrics_dimensions
    assert dimensions == {"Environment": params["Environment"]["Default"], "Queue": params["QueueName"]["Default"]}


# ---------------------------------------------------------------- restarts, memory, metrics file

SERVICES = {**UNITS, "reconcile": REPO / "config" / "voice-worker-reconcile.service"}
AGENT_CONFIG = REPO / "config" / "amazon-cloudwatch-agent.json"
# A host's own processes (sshd, journald, the CloudWatch agent) keep at least this much of its RAM.
SYSTEM_SHARE_PERCENT = 10
# voice-worker@.service's memory limits are sized for this many GPUs per host.
GPUS_PER_HOST = 4


@pytest.fixture(params=sorted(SERVICES), scope="module")
def service(request):
    return read_unit(SERVICES[request.param])


def _percent(text: str) -> float:
    assert text.endswith("%"), f"expected a share of RAM, got {text!r}"
    return float(text[:-1])


def _collected_files() -> list[dict]:
    import json

    return json.loads(AGENT_CONFIG.read_text())["logs"]["logs_collected"]["files"]["collect_list"]


def test_failed_starts_never_leave_a_unit_failed_for_good(service):
    """StartLimitIntervalSec=0: a few quick failures during an outage at boot do not hit the start limit."""
    assert service.value("Unit", "StartLimitIntervalSec") == "0"
    assert not service.keys("Unit") & {"StartLimitBurst", "StartLimitAction"}


def test_restarts_back_off_and_a_finished_drain_stays_stopped(unit):
    """Restart=on-failure (exit 0 after a drain is not restarted, as Restart=always would), with a delay
    that grows to RestartMaxDelaySec over RestartSteps on systemd 254+."""
    from worker.core.daemon import EXIT_OK

    assert unit.value("Service", "Restart") == "on-failure"
    assert str(EXIT_OK) not in unit.values("Service", "SuccessExitStatus")
    assert int(unit.value("Service", "RestartSteps")) > 0
    assert timespan_s(unit.value("Service", "RestartMaxDelaySec")) > timespan_s(unit.value("Service", "RestartSec"))


def test_an_oom_killed_trainer_does_not_stop_the_worker(unit):
    """OOMPolicy=continue: the worker sees its stage killed (a failed attempt) instead of being stopped,
    which would release the job without spending its retry budget."""
    assert unit.value("Service", "OOMPolicy") == "continue"


def test_memory_is_capped_below_the_hosts_ram(unit):
    """MemoryHigh below MemoryMax, and every worker on a host together leaves the system its share."""
    high, most = _percent(unit.value("Service", "MemoryHigh")), _percent(unit.value("Service", "MemoryMax"))
    assert 0 < high < most
    per_host = GPUS_PER_HOST if "%i" in unit.value("Service", "RuntimeDirectory") else 1
    assert per_host * most <= 100 - SYSTEM_SHARE_PERCENT


def test_reconcile_memory_matches_the_fargate_task():
    """The reconcile unit's MemoryMax is the reconcile task definition's memory (MiB)."""
    import json

    task = json.loads((REPO / "config" / "ecs-reconcile-task-definition.json").read_text())
    limit = read_unit(SERVICES["reconcile"]).value("Service", "MemoryMax")
    assert limit == f"{task['memory']}M"


def test_metrics_go_to_the_file_the_cloudwatch_agent_collects(service):
    """stdout (the EMF lines) is appended to the one file the sample agent config collects, in the unit's
    LogsDirectory; stderr (the logs) stays in the journal instead of following stdout there; and a file
    systemd cannot open (exit 209) is not restarted for ever."""
    (collected,) = _collected_files()
    output = service.value("Service", "StandardOutput")
    assert output == "append:" + collected["file_path"]
    assert service.value("Service", "StandardError") == "journal"
    if service.value("Service", "Type") != "oneshot":  # a missing directory is not worth a restart loop
        assert "209" in service.value("Service", "RestartPreventExitStatus").split()
    path = PurePosixPath(collected["file_path"])
    assert path.parent == PurePosixPath("/var/log") / service.value("Service", "LogsDirectory")


def test_cloudwatch_agent_config_names_a_group_and_a_stream_per_host():
    """The agent config is JSON with a log group and a per-instance stream for the metrics file."""
    (collected,) = _collected_files()
    assert collected["log_group_name"] and "{instance_id}" in collected["log_stream_name"]
    assert collected["retention_in_days"] > 0


def test_metrics_are_written_to_stdout_and_logs_to_stderr(capsys):
    """What the units rely on: an EMF line lands on stdout alone, a log line on stderr alone."""
    import json

    import structlog

    from worker.core.logs import configure_logging
    from worker.core.metrics import Metrics

    configure_logging("INFO", "json")
    try:
        Metrics().count("JobsCompleted")
        structlog.get_logger("test").info("a.log.line")
    finally:
        structlog.reset_defaults()
    out, err = capsys.readouterr()
    assert [json.loads(line)["_aws"]["CloudWatchMetrics"][0]["Metrics"][0]["Name"]
            for line in out.splitlines()] == ["JobsCompleted"]
    assert "a.log.line" in err and "a.log.line" not in out
