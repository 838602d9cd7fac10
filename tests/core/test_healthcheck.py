"""The container health check: reads the liveness file alone, with the limit the worker wrote in it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from worker.core.health import Liveness
from worker.core.healthcheck import FALLBACK_MAX_AGE_S, MAX_AGE_LIMIT_S, main, problem
from worker.settings import SQS_MAX_VISIBILITY_S, load_settings

A_DAY_IN_2001_S = 1_000_000_000.0


def test_the_worker_writes_its_limit_and_the_check_reads_it(tmp_path):
    """A ready Liveness writes its age limit into the liveness file; the check holds a file to that limit."""
    path = tmp_path / "alive"
    Liveness(str(path), max_age_s=45).ready()
    assert problem(str(path), None) is None
    old = time.time() - 60
    os.utime(path, (old, old))
    assert "limit 45 s" in problem(str(path), None)
    assert problem(str(path), 90) is None  # LIVENESS_MAX_AGE_SECONDS wins


def test_a_file_without_a_limit_gets_the_fallback_and_a_missing_one_is_unhealthy(tmp_path):
    """An empty liveness file (an older worker's) is judged by the fallback; no file is unhealthy."""
    path = tmp_path / "alive"
    path.touch()
    old = time.time() - FALLBACK_MAX_AGE_S - 5
    os.utime(path, (old, old))
    assert f"limit {FALLBACK_MAX_AGE_S:.0f} s" in problem(str(path), None)
    assert "does not exist" in problem(str(tmp_path / "absent"), None)
    assert "not set" in problem(None, None)


def test_the_entry_point_answers_with_exit_codes_and_a_line(tmp_path, capsys):
    """main() prints healthy or the reason and exits 0 or 1; a malformed limit is unhealthy."""
    path = tmp_path / "alive"
    Liveness(str(path), max_age_s=30).ready()
    assert main({"LIVENESS_FILE": str(path)}) == 0
    assert main({"LIVENESS_FILE": str(path), "LIVENESS_MAX_AGE_SECONDS": "soon"}) == 1
    assert main({}) == 1
    assert capsys.readouterr().out.splitlines() == [
        "healthy", "unhealthy: LIVENESS_MAX_AGE_SECONDS='soon' is not a number of seconds above 0 and at most 172800",
        "unhealthy: LIVENESS_FILE is not set: nothing to check"]


@pytest.mark.parametrize("limit", ["nan", "inf", "-inf", "Infinity", "1e300", "0", "-5", "\u0665\u0660", "172801"])
def test_a_limit_that_could_call_a_dead_worker_healthy_is_refused(tmp_path, capsys, limit):
    """LIVENESS_MAX_AGE_SECONDS that is not finite, above 0 and at most two days is unhealthy, whatever the file."""
    path = tmp_path / "alive"
    path.touch()
    os.utime(path, (A_DAY_IN_2001_S, A_DAY_IN_2001_S))
    assert main({"LIVENESS_FILE": str(path), "LIVENESS_MAX_AGE_SECONDS": limit}) == 1
    assert f"LIVENESS_MAX_AGE_SECONDS={limit!r} is not a number of seconds" in capsys.readouterr().out


@pytest.mark.parametrize("limit", [float("nan"), float("inf"), 0.0, -1.0, 1e300])
def test_the_check_refuses_an_unusable_limit_handed_to_it(tmp_path, limit):
    """problem() itself calls a limit that is not finite, above 0 and at most two days a problem."""
    path = tmp_path / "alive"
    path.touch()
    assert "is not a number of seconds above 0" in problem(str(path), limit)


@pytest.mark.parametrize("written", ["nan", "inf", "1e300", "-1", "\u0665"])
def test_an_unusable_limit_in_the_file_gives_way_to_the_fallback(tmp_path, written):
    """A liveness file from 2001 whose written limit is not usable is judged by the fallback: unhealthy."""
    path = tmp_path / "alive"
    path.write_text(f"max_age_s={written}\n", encoding="utf-8")
    os.utime(path, (A_DAY_IN_2001_S, A_DAY_IN_2001_S))
    assert f"limit {FALLBACK_MAX_AGE_S:.0f} s" in problem(str(path), None)


def test_the_longest_limit_the_worker_computes_is_one_the_check_accepts(tmp_path):
    """With the longest heartbeat the settings allow, the limit the worker writes is the one the check applies."""
    settings = load_settings({"SQS_VISIBILITY_TIMEOUT_SECONDS": str(SQS_MAX_VISIBILITY_S - 1),
                              "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": str((SQS_MAX_VISIBILITY_S - 2) * 1000),
                              "JOB_TIME_LIMIT_SECONDS": "1", "SQS_RETRY_VISIBILITY_MAX_SECONDS": "1",
                              "SQS_RETRY_VISIBILITY_BASE_SECONDS": "1"})
    assert settings.liveness_age_limit_s <= MAX_AGE_LIMIT_S
    path = tmp_path / "alive"
    Liveness(str(path), max_age_s=settings.liveness_age_limit_s).ready()
    old = time.time() - settings.liveness_age_limit_s - 60
    os.utime(path, (old, old))
    assert f"limit {settings.liveness_age_limit_s:.0f} s" in problem(str(path), None)


def test_the_check_imports_nothing_of_the_worker_beyond_itself(tmp_path):
    """python -m worker.core.healthcheck loads no boto3, pydantic, structlog or worker module but its own."""
    path = tmp_path / "alive"
    Liveness(str(path), max_age_s=30).ready()
    probe = ("import runpy, sys\n"
             "sys.argv = ['healthcheck']\n"
             "try:\n    runpy.run_module('worker.core.healthcheck', run_name='__main__')\n"
             "except SystemExit as exc:\n    code = exc.code\n"
             "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 'pydantic', 'structlog')\n"
             "               or (m.startswith(('worker.', 'pipeline')) and m != 'worker.core.healthcheck'))\n"
             "print(code, heavy)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          env={**os.environ, "LIVENESS_FILE": str(path)})
    assert done.stdout.splitlines()[-1] == "0 ['worker.core']"
