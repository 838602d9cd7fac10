"""No stage process outlives its worker, and no step of a job starts beside an older process of that job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.config import StageSpec
from pipeline.errors import StageFailed
from pipeline.proctree import JOB_NAME
from pipeline.stage_keeper import exit_status_code, parse_argv
from pipeline.stages import StageContext, is_newer_attempt, run_stage
from tests.pipeline.test_stages import process_alive
from worker.core.stop import StopSignal

WAIT_S = 30.0

# Starts a plain grandchild and one that calls setsid, publishes the three pids, then sleeps.
FAMILY = """
import os, subprocess, sys, time
pidfile = sys.argv[1]
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
plain = subprocess.Popen(sleeper)
detached = subprocess.Popen(sleeper, start_new_session=True)
with open(pidfile + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {plain.pid} {detached.pid}")
os.replace(pidfile + ".tmp", pidfile)
time.sleep(120)
"""

# The runner in a process of its own (a worker stand-in) that a test can kill -9.
RUNNER = """
import sys
from pathlib import Path
from pipeline.config import StageSpec
from pipeline.stages import StageContext, run_stage
from worker.core.stop import StopSignal
root, script = Path(sys.argv[1]), sys.argv[2]
ctx = StageContext(dataset_dir=root / "ds", output_dir=root / "out", checkpoints_root=root / "ck",
                   log_dir=root / "logs", job_id="job-k", language="en")
stage = StageSpec(name="family", argv=("{python}", script, str(root / "pids")), outputs=("never",))
run_stage(stage, ctx, StopSignal(), lambda name, pct: None, grace_s=1.0)
"""


def write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


def wait_for(condition, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def ctx(tmp_path) -> StageContext:
    return StageContext(dataset_dir=tmp_path / "ds", output_dir=tmp_path / "out", checkpoints_root=tmp_path / "ck",
                        log_dir=tmp_path / "logs", job_id="job-s", language="en")


def test_kill_9_of_the_worker_ends_the_stage_and_its_setsid_grandchild(tmp_path):
    """After the runner's process is killed with SIGKILL, the stage and both grandchildren end too."""
    pidfile = tmp_path / "pids"
    runner = subprocess.Popen([sys.executable, write(tmp_path, "runner.py", RUNNER), str(tmp_path),
                               write(tmp_path, "family.py", FAMILY)], cwd=Path(__file__).parents[2])
    pids: list[int] = []
    try:
        wait_for(pidfile.exists, "the stage to publish its pids")
        pids = [int(p) for p in pidfile.read_text().split()]
        assert all(process_alive(pid) for pid in pids)
        runner.kill()
        runner.wait()
        wait_for(lambda: not any(process_alive(pid) for pid in pids), "the stage's processes to end")
    finally:
        runner.kill()
        kill_all(pids)


def test_a_survivor_of_the_job_is_ended_before_a_stage_of_that_job_starts(tmp_path, ctx, capsys):
    """A process carrying the job's mark (even one ignoring SIGTERM) is gone before the stage runs."""
    survivor = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                               "print('ready', flush=True); time.sleep(120)"],
        env={**os.environ, JOB_NAME: ctx.job_mark()}, stdout=subprocess.PIPE)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 env={**os.environ, JOB_NAME: "another-job"})
    try:
        assert survivor.stdout.readline() == b"ready\n"
        seen = tmp_path / "seen"
        # A zombie (the test reaps it later) counts as ended: its state letter is Z.
        state = f"open('/proc/{survivor.pid}/stat').read().rsplit(')', 1)[1].split()[0]"
        check = f"open({str(seen)!r}, 'w').write(str({state} not in 'ZX'))"
        stage = StageSpec(name="after", argv=("{python}", "-c", check + "; open('{output_dir}/o', 'w').write('x')"),
                          outputs=("o",))
        run_stage(stage, ctx, StopSignal(), lambda name, pct: None, grace_s=0.3)
        assert survivor.wait(WAIT_S) == -signal.SIGKILL
        assert seen.read_text() == "False"
        assert bystander.poll() is None
        assert "stage.survivor_ended" in capsys.readouterr().out
    finally:
        kill_all([survivor.pid, bystander.pid])
        survivor.wait()
        bystander.wait()


def test_the_stage_environment_carries_the_job_mark(tmp_path, ctx):
    """Every stage process gets VOICE_WORKER_JOB=<the job's work directory>, the mark a later attempt looks for."""
    stage = StageSpec(name="env", argv=("{python}", "-c", f"import os; open('{{output_dir}}/o', 'w').write(os.environ['{JOB_NAME}'])"),
                      outputs=("o",))
    run_stage(stage, ctx, StopSignal(), lambda name, pct: None)
    assert (ctx.output_dir / "o").read_text() == ctx.job_mark() == str(ctx.output_dir.parent.resolve())


@pytest.mark.parametrize(("body", "expected"), [
    ("import sys; sys.exit(7)", "exited with code 7"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGUSR1)", f"killed by signal {int(signal.SIGUSR1)}"),
], ids=["code", "signal"])
def test_the_keeper_passes_the_stage_exit_through(tmp_path, ctx, body, expected):
    """The runner sees the stage's own exit code or killing signal, not the keeper's."""
    stage = StageSpec(name="ends", argv=("{python}", "-c", body), outputs=("o",))
    with pytest.raises(StageFailed, match=expected):
        run_stage(stage, ctx, StopSignal(), lambda name, pct: None)


def test_keeper_argv_and_wait_statuses_parse():
    """The keeper's arguments need the separator; wait statuses split into code or signal."""
    assert parse_argv(["12", "5", "1.5", "--", "a", "b"]) == (12, 5, 1.5, ["a", "b"])
    with pytest.raises(ValueError):
        parse_argv(["12", "5", "1.5", "a"])
    assert exit_status_code(3 << 8) == (3, None)
    assert exit_status_code(int(signal.SIGTERM)) == (None, int(signal.SIGTERM))


def test_only_a_later_attempt_number_is_newer():
    """Attempts compare by number: a later one is newer; an earlier one, our own and an unknown one are not."""
    assert is_newer_attempt("0010-bbbbbbbb", "0009-aaaaaaaa")
    assert not is_newer_attempt("0008-bbbbbbbb", "0009-aaaaaaaa")
    assert not is_newer_attempt("0009-aaaaaaaa", "0009-aaaaaaaa")
    assert not is_newer_attempt(None, "0009-aaaaaaaa") and not is_newer_attempt("", "0009-aaaaaaaa")


def test_a_stale_attempt_never_ends_a_newer_attempts_process(tmp_path):
    """A process of a later attempt of the job makes this attempt's stage refuse to start, and it lives on."""
    from pipeline.proctree import ATTEMPT_NAME

    newer = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(120)"],
                             env={**os.environ, JOB_NAME: "job-n", ATTEMPT_NAME: "0010-bbbbbbbb"},
                             stdout=subprocess.PIPE)
    try:
        assert newer.stdout.readline() == b"ready\n"
        ctx = StageContext(dataset_dir=tmp_path / "ds", output_dir=tmp_path / "out", checkpoints_root=tmp_path / "ck",
                           log_dir=tmp_path / "logs", job_id="job-n", language="en",
                           env={"PATH": os.environ["PATH"], JOB_NAME: "job-n", ATTEMPT_NAME: "0009-aaaaaaaa"})
        stage = StageSpec(name="stale", argv=("{python}", "-c", "open('{output_dir}/o', 'w').write('x')"),
                          outputs=("o",))
        with pytest.raises(StageFailed, match="newer attempt"):
            run_stage(stage, ctx, StopSignal(), lambda name, pct: None, grace_s=0.3)
        assert newer.poll() is None
        assert not (ctx.output_dir / "o").exists()
    finally:
        newer.kill()
        newer.wait()
