"""The container health check: reads the liveness file alone, with the limit the worker wrote in it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from worker.core.health import Pulse
from worker.core.healthcheck import FALLBACK_MAX_AGE_S, main, problem


def test_the_worker_writes_its_limit_and_the_check_reads_it(tmp_path):
    """A ready Pulse writes its age limit into the liveness file; the check holds a file to that limit."""
    path = tmp_path / "alive"
    Pulse(str(path), max_age_s=45).ready()
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
    Pulse(str(path), max_age_s=30).ready()
    assert main({"LIVENESS_FILE": str(path)}) == 0
    assert main({"LIVENESS_FILE": str(path), "LIVENESS_MAX_AGE_SECONDS": "soon"}) == 1
    assert main({}) == 1
    assert capsys.readouterr().out.splitlines() == [
        "healthy", "unhealthy: LIVENESS_MAX_AGE_SECONDS='soon' is not a number",
        "unhealthy: LIVENESS_FILE is not set: nothing to check"]


def test_the_check_imports_nothing_of_the_worker_beyond_itself(tmp_path):
    """python -m worker.core.healthcheck loads no boto3, pydantic, structlog or worker module but its own."""
    path = tmp_path / "alive"
    Pulse(str(path), max_age_s=30).ready()
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
