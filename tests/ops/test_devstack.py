"""The documented dev loop, end to end: dev-stack, run, submit samples/job.json, status --watch, cancel,
dlq list — each a real `python -m worker` process, talking to each other only through var/dev/env.sh."""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.procs import wait_until
from tests.support import ARTIFACT_KEYS
from worker.ops.devstack import dev_environment, env_script

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.server


def _free_port() -> int:
    """A port free now, with the next one free too (dev-stack --store mongo serves MongoDB there),
    below the kernel's ephemeral range, where no client connection of a parallel test can take it."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20_000, 32_000)
        sockets = [socket.socket() for _ in range(2)]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError("no two free ports next to each other below 32000")


def _sourced(env_file: Path) -> dict[str, str]:
    """What `. env.sh` would export, read the way a shell reads it."""
    out = subprocess.run(["sh", "-c", f". {shlex.quote(str(env_file))} && env -0"], check=True,
                         capture_output=True, env={"PATH": os.environ["PATH"]}).stdout
    env = dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)
    env.pop("PWD", None)
    return env


def _worker(env: dict[str, str], *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout_s)


def test_env_script_round_trips_through_a_shell(tmp_path):
    """Every setting written to env.sh comes back unchanged when a shell sources it."""
    env = dev_environment("http://127.0.0.1:1", "http://127.0.0.1:1/123/q", tmp_path / "dir with space")
    path = tmp_path / "env.sh"
    path.write_text(env_script(env))
    sourced = _sourced(path)
    assert {k: sourced[k] for k in env} == env


def test_documented_dev_loop_completes_a_job_and_cancels_another(tmp_path):
    """dev-stack, then run, submit, status --watch, cancel and dlq list work exactly as documented."""
    state_dir, port = tmp_path / "dev", _free_port()
    base_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "AWS_CONFIG_FILE": "/dev/null",
                "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    stack = subprocess.Popen([sys.executable, "-m", "worker", "dev-stack", "--port", str(port),
                              "--dir", str(state_dir)], cwd=REPO, env=base_env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    worker = None
    try:
        env_file = state_dir / "env.sh"
        wait_until(env_file.exists, 60, "the dev stack's env.sh")
        env = {**base_env, **_sourced(env_file)}
        env["SQS_WAIT_TIME_SECONDS"] = "1"  # only to keep the test short; the loop is the same
        worker = subprocess.Popen([sys.executable, "-m", "worker", "run"], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        submitted = _worker(env, "submit", "samples/job.json", "--json")
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["jobId"]
        watched = _worker(env, "status", job_id, "--watch", "0.5", timeout_s=120)
        assert watched.returncode == 0, watched.stderr
        assert "completed" in watched.stdout
        final = json.loads(_worker(env, "status", job_id, "--json").stdout)
        assert final["job"]["status"] == "completed"
        assert len(final["profile"]["s3Paths"]) == len(ARTIFACT_KEYS)

        # A second job, cancelled: it ends cancelled whether the worker had started it or not.
        second = json.loads(_worker(env, "submit", "samples/job.json", "--json").stdout)["jobId"]
        cancelled = _worker(env, "cancel", second)
        assert cancelled.returncode == 0, cancelled.stderr
        assert "cancel" in cancelled.stdout
        wait_until(lambda: json.loads(_worker(env, "status", second, "--json").stdout)["job"]["status"]
                   in ("cancelled", "completed"), 90, "the second job to end")

        listed = _worker(env, "dlq", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) == []
    finally:
        for proc in (worker, stack):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (worker, stack):
            if proc is not None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    assert stack.returncode == 0, stack.stdout.read()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_dev_stack_on_mongo_keeps_the_records_on_its_server_across_a_restart(tmp_path):
    """dev-stack --store mongo serves the records from a local MongoDB server: doctor names it, and a restart keeps them."""
    state_dir, port = tmp_path / "dev", _free_port()
    base_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "AWS_CONFIG_FILE": "/dev/null",
                "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    env_file = state_dir / "env.sh"

    def start() -> subprocess.Popen:
        env_file.unlink(missing_ok=True)
        stack = subprocess.Popen([sys.executable, "-m", "worker", "dev-stack", "--store", "mongo", "--port",
                                  str(port), "--dir", str(state_dir)], cwd=REPO, env=base_env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_until(lambda: env_file.exists() or stack.poll() is not None, 90, "the dev stack's env.sh")
        assert stack.poll() is None, stack.stdout.read() if stack.stdout else ""
        return stack

    stack = start()
    try:
        env = {**base_env, **_sourced(env_file)}
        assert env["MONGO_URI"] == f"mongodb://127.0.0.1:{port + 1}/voice" and env["STORE_URL"] == ""
        doctor = _worker(env, "doctor")
        assert f"PASS  store reachable: MongoDB at mongodb://127.0.0.1:{port + 1}/voice" in doctor.stdout, doctor.stdout
        submitted = _worker(env, "submit", "samples/job.json", "--json")
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["jobId"]
    finally:
        _stop(stack)
    assert stack.returncode == 0, stack.stdout.read() if stack.stdout else ""

    stack = start()
    try:
        shown = _worker({**base_env, **_sourced(env_file)}, "status", job_id, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["job"]["status"] == "pending"
    finally:
        _stop(stack)
    assert stack.returncode == 0


def test_the_dev_loop_environment_names_a_liveness_file_that_health_reads(tmp_path):
    """env.sh sets LIVENESS_FILE under the stack's directory, so `health` works in the dev loop."""
    from worker.core.health import Liveness
    from worker.core.healthcheck import main as healthcheck

    env = dev_environment("http://127.0.0.1:4566", "http://127.0.0.1:4566/000000000000/jobs", tmp_path)
    assert Path(env["LIVENESS_FILE"]).parent == tmp_path.resolve()
    Liveness(env["LIVENESS_FILE"], max_age_s=30).ready()
    assert healthcheck({"LIVENESS_FILE": env["LIVENESS_FILE"]}) == 0
