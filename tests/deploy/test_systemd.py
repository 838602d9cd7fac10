"""The systemd units: notify + watchdog, a stop that outlasts the grace, hardening that keeps the GPU."""

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
