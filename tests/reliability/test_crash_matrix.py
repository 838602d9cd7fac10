"""The crash matrix: SIGKILL a real worker at every point of a job's life, then let a fresh one finish.

Each case runs `python -m worker run` against the moto server and a SQLite file with a three-stage
reference-trainer pipeline, kills it (a crash point for the instants between two writes, a kill of
the whole process tree while a stage runs), starts a second worker and checks that the job ended
completed exactly once with nothing redone that had been verified. Every point runs three times; the
three repetitions of a point run side by side, each on its own queue, bucket and records.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.reliability.procs import WorkerProcess, cmdline, descendants, wait_until
from tests.reliability.stack import Stack, make_stack, reference_pipeline
from worker.core.faults import POINTS as CRASH_POINTS

STAGES = ("embed", "train_full", "train_light")
KILL_POINTS = (
    "after_receive", "during_download",
    *(f"during_{stage}" for stage in STAGES),
    "after_upload", "after_paths", "after_profile_completed", "after_job_completed",
)
REPEATS = 3
TRAINER_STEPS, STEP_DELAY_S = 6, 0.15
CASE_TIMEOUT_S = 60


@dataclass
class AtKill:
    """What the dead worker left behind."""

    verified: set[str]
    logs: list[str]
    job: dict
    children_killed: list[int] = field(default_factory=list)


def trainer_running(worker: WorkerProcess, stack: Stack, job_id: str, stage: str) -> bool:
    """The stage's trainer process is alive (and a slowed trainer has written two checkpoints)."""
    mode = {"embed": "embed", "train_full": "full", "train_light": "light"}[stage]
    running = any("pipeline.reference_trainer" in argv and mode in argv
                  for argv in map(cmdline, descendants(worker.pid)))
    if not running or stage == "embed":
        return running
    return len(list(stack.work_dir(job_id).glob(f"attempts/*/checkpoints/{stage}/ckpt-*.npz"))) >= 2


def kill_at(point: str, worker: WorkerProcess, stack: Stack, job_id: str) -> list[int]:
    if point in CRASH_POINTS:
        code = worker.proc.wait(CASE_TIMEOUT_S)
        assert code == -signal.SIGKILL, f"worker ended with {code} instead of dying at {point}"
        return []
    stage = point.removeprefix("during_")
    wait_until(lambda: trainer_running(worker, stack, job_id, stage), CASE_TIMEOUT_S, f"{stage} to run")
    return worker.kill_tree()


def settled(stack: Stack, job_id: str, second: WorkerProcess, confirm_s: float = 0.3) -> str | None:
    """'done' once completed with both queues empty; 'lost' if the message is gone but the job is not done."""
    # A job killed after its commit marker is completed before the redelivery even happens, and moto
    # can count a message turning visible in neither column: wait for the second worker's delete.
    if "message.deleted" not in second.event_names():
        return None
    for attempt in range(2):
        with stack.store() as store:
            status = (store.get_job(job_id) or {}).get("status")
        empty = stack.queue_counts() == ((0, 0), (0, 0))
        if not empty:
            return None
        if status == "completed":
            return "done"
        # moto counts a message turning visible in neither column for an instant: look again.
        if attempt == 0:
            time.sleep(confirm_s)
    return f"lost (job {status}, no message left on the queue or the DLQ)"


def run_case(endpoint: str, root: Path, point: str) -> dict:
    stack = make_stack(endpoint, root, reference_pipeline(TRAINER_STEPS, STEP_DELAY_S))
    job_id, profile_id, _ = stack.submit()
    crash_env = {"VOICE_WORKER_CRASH_AT": point} if point in CRASH_POINTS else {}
    first = WorkerProcess(stack.env(WORKER_ID="first", **crash_env), root / "first.log")
    second = WorkerProcess(stack.env(WORKER_ID="second"), root / "second.log")
    started_s = time.monotonic()
    try:
        first.start()
        children = kill_at(point, first, stack, job_id)
        with stack.store() as store:
            at_kill = AtKill(stack.verified_stages(job_id), stack.stage_logs(job_id), store.get_job(job_id),
                             children)
        second.start()
        outcome = wait_until(lambda: settled(stack, job_id, second), CASE_TIMEOUT_S, "the second worker to finish")
        assert outcome == "done", f"{point}: {outcome}"
        assert second.stop() == 0
    finally:
        first.ensure_dead()
        second.ensure_dead()
    check_case(point, stack, job_id, profile_id, at_kill, first, second)
    return {"point": point, "seconds": round(time.monotonic() - started_s, 1)}


def check_case(point: str, stack: Stack, job_id: str, profile_id: str, at_kill: AtKill,
               first: WorkerProcess, second: WorkerProcess) -> None:
    assert stack.completion_problems(job_id, profile_id) == [], point
    assert stack.queue_counts() == ((0, 0), (0, 0))
    assert "message.deleted" not in first.event_names(), "the killed worker must not have acknowledged"
    if point.startswith("during_") and point not in CRASH_POINTS:
        stage = point.removeprefix("during_")
        assert stage not in at_kill.verified, f"the kill came after {stage} had finished"
        assert at_kill.children_killed, "no stage process was running at the kill"
    if point in ("after_upload", "after_paths", "after_profile_completed", "after_job_completed"):
        assert at_kill.verified == set(STAGES)
    logs = stack.stage_logs(job_id)
    for stage in at_kill.verified:
        runs = [name for name in logs if name.endswith(f"-{stage}.log")]
        assert len(runs) == 1, f"{point}: verified stage {stage} ran again: {runs}"
    if point in ("during_train_full", "during_train_light"):
        stage = point.removeprefix("during_")
        rerun = sorted(stack.work_dir(job_id).joinpath("logs").glob(f"*-{stage}.log"))[-1]
        assert "resumed from checkpoint" in rerun.read_text(), "the resumable stage started over"
    if point == "after_job_completed":
        names = second.event_names()
        assert "job.already_complete" in names and "message.deleted" in names
        assert "job.claimed" not in names and "artifacts.uploaded" not in names
        assert logs == at_kill.logs, "the redelivery of a completed job ran pipeline steps"
        with stack.store() as store:
            job = store.get_job(job_id)
        assert job["history"] == at_kill.job["history"] and job["attempts"] == at_kill.job["attempts"]


@pytest.mark.server
@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_then_fresh_worker_completes_exactly_once(moto_server, tmp_path, point):
    """Killed at this point three times over, a fresh worker always ends the job completed once, all five objects verified, queues empty, nothing verified redone."""
    with ThreadPoolExecutor(REPEATS) as pool:
        futures = [pool.submit(run_case, moto_server, tmp_path / f"run{n}", point) for n in range(REPEATS)]
        results = [f.result() for f in futures]
    assert len(results) == REPEATS
