"""Health turns unhealthy when the queue or the store stops answering, and both health commands give one answer."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.core import healthcheck
from worker.core.health import Liveness
from worker.core.healthcheck import contact_lines, reached_at_s
from worker.ops import cli

REPO = Path(__file__).resolve().parents[2]
HEALTH_VARIABLES = ("LIVENESS_FILE", "LIVENESS_MAX_AGE_SECONDS", "HEALTH_UNREACHABLE_AFTER_SECONDS")


def liveness_file(tmp_path, *, queue_age_s: float | None = 1, store_age_s: float | None = 1,
                  unreachable_after_s: float | None = 300, extra: str = "") -> str:
    """A liveness file as a running worker writes it, its stamps ``*_age_s`` seconds old."""
    now = time.time()
    reached = {part: now - age for part, age in (("queue", queue_age_s), ("store", store_age_s)) if age is not None}
    content = "max_age_s=120\n" + (contact_lines(unreachable_after_s, reached) if unreachable_after_s else "")
    path = tmp_path / "alive"
    path.write_text(content + extra, encoding="utf-8")
    return str(path)


# (case id, file arguments or None for no file, extra environment, the expected answer)
CASES = [
    ("both answered", {}, {}, "healthy"),
    ("queue silent", {"queue_age_s": 400}, {}, "unhealthy: the queue has not answered for 400 s (limit 300 s)"),
    ("store silent", {"store_age_s": 400}, {}, "unhealthy: the store has not answered for 400 s (limit 300 s)"),
    ("both silent", {"queue_age_s": 400, "store_age_s": 500}, {},
     "unhealthy: the queue has not answered for 400 s; the store has not answered for 500 s (limit 300 s)"),
    ("environment allows longer", {"queue_age_s": 400}, {"HEALTH_UNREACHABLE_AFTER_SECONDS": "600"}, "healthy"),
    ("environment allows less", {"queue_age_s": 100}, {"HEALTH_UNREACHABLE_AFTER_SECONDS": "60"},
     "unhealthy: the queue has not answered for 100 s (limit 60 s)"),
    ("an older worker's file", {"unreachable_after_s": None, "queue_age_s": None, "store_age_s": None}, {},
     "healthy"),
    ("an invalid unreachable limit", {}, {"HEALTH_UNREACHABLE_AFTER_SECONDS": "nan"},
     "unhealthy: HEALTH_UNREACHABLE_AFTER_SECONDS='nan' is not a number of seconds above 0 and at most 172800"),
    ("an invalid age limit", {}, {"LIVENESS_MAX_AGE_SECONDS": "soon"},
     "unhealthy: LIVENESS_MAX_AGE_SECONDS='soon' is not a number of seconds above 0 and at most 172800"),
    ("an invalid setting health does not read", {}, {"SQS_WAIT_TIME_SECONDS": "forever", "LOG_FORMAT": "xml"},
     "healthy"),
    ("an unfit host", {"extra": "unfit=no GPU\n"}, {}, "unhealthy: host unfit: no GPU"),
    ("no liveness file set", None, {}, "unhealthy: LIVENESS_FILE is not set: nothing to check"),
]


def case_environment(tmp_path, file_args, extra) -> dict[str, str]:
    env = dict(extra)
    if file_args is not None:
        env["LIVENESS_FILE"] = liveness_file(tmp_path, **file_args)
    return env


@pytest.mark.parametrize(("file_args", "extra", "answer"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_both_health_commands_give_the_same_answer(tmp_path, monkeypatch, capsys, file_args, extra, answer):
    """The container check's main() and `python -m worker health` print the same line and exit alike."""
    env = case_environment(tmp_path, file_args, extra)
    out = io.StringIO()
    code = healthcheck.main(env, out=out)
    assert out.getvalue().strip() == answer
    assert code == (0 if answer == "healthy" else 1)
    for name in (*HEALTH_VARIABLES, "SQS_WAIT_TIME_SECONDS", "LOG_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["health"]) == code
    assert capsys.readouterr().out.strip() == answer


@pytest.mark.parametrize("module", ["worker", "worker.core.healthcheck"])
def test_an_invalid_setting_changes_neither_entry_points_answer(tmp_path, module):
    """As processes, both entry points call a fresh worker healthy whatever an unrelated setting holds."""
    env = {key: value for key, value in os.environ.items() if key not in HEALTH_VARIABLES}
    env.update(LIVENESS_FILE=liveness_file(tmp_path), SQS_WAIT_TIME_SECONDS="forever", MAX_FAILED_ATTEMPTS="-1")
    argv = [sys.executable, "-m", module, *(["health"] if module == "worker" else [])]
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "healthy"), done.stderr


def test_a_ready_worker_stamps_both_and_each_contact_moves_its_stamp(tmp_path):
    """Liveness writes the limit and both stamps at ready; reached() and a beat move only that part's stamp."""
    path = tmp_path / "alive"
    wall = [1_000.0]
    beats = [0.0]
    pulse = Liveness(str(path), max_age_s=120, unreachable_after_s=300, wall=lambda: wall[0],
                     clock=lambda: beats[0])
    pulse.ready()
    content = path.read_text(encoding="utf-8")
    assert "unreachable_after_s=300\n" in content and reached_at_s(content) == {"queue": 1000.0, "store": 1000.0}
    wall[0], beats[0] = 1_500.0, 10.0
    pulse.reached("store")
    pulse.beat()
    assert reached_at_s(path.read_text(encoding="utf-8")) == {"queue": 1000.0, "store": 1500.0}
    assert healthcheck.unreachable_problem(path.read_text(encoding="utf-8"), 300, now_s=1_500.0) == \
        "the queue has not answered for 500 s (limit 300 s)"


def test_an_unfit_mark_survives_later_beats(tmp_path):
    """Once the host is marked unfit, a beat only touches the file: the unfit line stays."""
    path = tmp_path / "alive"
    beats = [0.0]
    pulse = Liveness(str(path), max_age_s=120, unreachable_after_s=300, clock=lambda: beats[0])
    pulse.ready()
    pulse.unfit("GPU lost")
    beats[0] = 10.0
    pulse.beat()
    assert healthcheck.problem(str(path), None) == "host unfit: GPU lost"


def test_the_limit_the_worker_writes_is_at_least_two_quiet_spells():
    """HEALTH_UNREACHABLE_AFTER_SECONDS below two heartbeat ticks is raised to them, so a busy worker stays healthy."""
    from worker.settings import load_settings

    settings = load_settings({"HEALTH_UNREACHABLE_AFTER_SECONDS": "60", "SQS_VISIBILITY_TIMEOUT_SECONDS": "900",
                              "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "120000"})
    assert settings.health_unreachable_limit_s == 240
    assert load_settings({}).health_unreachable_limit_s == 300
