"""The bounded fault soak: three worker processes, each a host of its own with the S3 checkpoint
mirror on, twelve jobs, ten faults of every kind (kill -9, SIGSTOP past the lease, SIGTERM,
partitions mid-upload and at random, drops, latency, duplicate sends), then the total-queue checker
(soak_check.py). The longer, seedable run is scripts/soak.py.

The soak runs once per test session; the tests below each read one family of its violations. Under
pytest-xdist the first process to get here runs it and the others read its result from a file.
"""

from __future__ import annotations

import fcntl
import json
import sys
from dataclasses import dataclass

import pytest

from tests.reliability.soak import FAULT_KINDS, SoakConfig, run_soak
from tests.reliability.soak_check import COMPLETION, DLQ, LOST, OVERLAP, S3

SEED = 14
# Each worker a host of its own with the S3 mirror on: a retry elsewhere resumes from what the job
# record vouches for, under the same faults (a vouch from a fenced-out attempt is refused).
CONFIG = SoakConfig(seed=SEED, workers=3, jobs=12, faults=10, window_s=30.0, hosts=True,
                    worker_env={"CHECKPOINT_S3_SYNC_SECONDS": "1"})

pytestmark = pytest.mark.server


@dataclass(frozen=True)
class Outcome:
    violations: list[dict]
    faults: dict[str, int]
    uploads_caught: int
    lease_losses: int
    mirror_pushes: int
    summary: str

    def of(self, *kinds: str) -> list[str]:
        return [f"[{v['kind']}] {v['job_id']}: {v['detail']}" for v in self.violations if v["kind"] in kinds]


def _run(moto_server: str, root) -> Outcome:
    soak_dir = root / "soak"
    soak_dir.mkdir()
    result = run_soak(moto_server, soak_dir, CONFIG)
    events = [e.get("event") for path in soak_dir.glob("worker-*.log")
              for e in map(_json_or_empty, path.read_text(errors="replace").splitlines())]
    return Outcome([{"kind": v.kind, "job_id": v.job_id, "detail": v.detail} for v in result.violations],
                   dict(result.faults), result.uploads_caught, events.count("heartbeat.lease_lost"),
                   events.count("remote_work.checkpoints_pushed"), f"seed {SEED}: " + result.summary())


def _json_or_empty(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@pytest.fixture(scope="session")
def soak(moto_server, tmp_path_factory, worker_id) -> Outcome:
    """One soak per session, shared by every xdist process through a file under the common temp root."""
    if worker_id == "master":
        outcome = _run(moto_server, tmp_path_factory.mktemp("soak"))
    else:
        shared = tmp_path_factory.getbasetemp().parent
        with open(shared / "soak.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = shared / "soak.json"
            if cached.exists():
                outcome = Outcome(**json.loads(cached.read_text()))
            else:
                outcome = _run(moto_server, tmp_path_factory.mktemp("soak"))
                cached.write_text(json.dumps(outcome.__dict__))
    print(f"\n{outcome.summary}", file=sys.stderr)
    return outcome


def test_the_soak_injected_every_kind_of_fault(soak):
    """Every kind of fault was injected, a partition caught an upload and leases were lost."""
    assert set(soak.faults) == set(FAULT_KINDS), soak.summary
    assert soak.uploads_caught >= 1, soak.summary
    assert soak.lease_losses >= 1, soak.summary


def test_the_jobs_mirrored_their_checkpoints_under_the_faults(soak):
    """With the mirror on, checkpoint sets went to S3 (and were vouched for) while the faults ran."""
    assert soak.mirror_pushes >= 1, soak.summary


def test_every_job_completed_exactly_once_and_nothing_was_lost(soak):
    """Every job ended completed with one completed attempt, one logged commit and ten paths; no message was left behind."""
    assert soak.of(COMPLETION, LOST) == [], soak.summary


def test_no_two_trainings_of_one_job_ran_at_once(soak):
    """The trainer stand-in's own start and end lines show no two trainings of one job overlapping."""
    assert soak.of(OVERLAP) == [], soak.summary


def test_every_dead_letter_is_explained(soak):
    """Every message on the DLQ has a permanent error recorded for that very message."""
    assert soak.of(DLQ) == [], soak.summary


def test_committed_objects_never_change_and_hold_one_trainings_bytes(soak):
    """Each object a committed profile names has exactly the version it had at the commit, and the five hold one training's bytes."""
    assert soak.of(S3) == [], soak.summary
