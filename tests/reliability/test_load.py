"""Load and races: four worker processes on one queue and one SQLite file, 200 messages for 140 jobs.

Sixty of the messages repeat a job already sent (forty jobs twice, ten three times), shuffled so that
copies of one job often sit next to each other and reach two workers at once. Every job must end
completed exactly once, no two workers may ever have held the same job at the same time (the attempt
history's intervals), and the queue and DLQ must end empty.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from datetime import UTC, datetime
from itertools import pairwise

import pytest

from tests.reliability.procs import WorkerProcess, wait_until
from tests.reliability.stack import make_stack, quick_pipeline
from tests.support import ARTIFACT_KEYS
from worker.voice.stage_logs import LOGS_KEY_DIR

WORKERS = 4
SINGLES, DOUBLES, TRIPLES = 90, 40, 10
MESSAGES = SINGLES + 2 * DOUBLES + 3 * TRIPLES
JOBS = SINGLES + DOUBLES + TRIPLES
LOAD_TIMEOUT_S = 180


def overlapping_attempts(history: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs of attempts whose [start, end] intervals overlap; an attempt with no end is still running."""
    ordered = sorted(history, key=lambda h: h["start"])
    return [(a, b) for a, b in pairwise(ordered) if a.get("end") is None or a["end"] > b["start"]]


def attempts_from_logs(workers: list[WorkerProcess]) -> dict[str, list[dict]]:
    """Each worker's own account of its attempts, job id -> [{worker, start, end}], from claim to settle.

    Independent of the store's history (which a claim rewrites), so a broken claim cannot hide here.
    """
    attempts: dict[str, list[dict]] = {}
    for worker in workers:
        open_claims: dict[str, tuple[str, datetime]] = {}
        for event in worker.events():
            name, message_id = event.get("event"), event.get("message_id")
            if name == "job.claimed":
                open_claims[message_id] = (event["job_id"], datetime.fromisoformat(event["timestamp"]))
            elif name == "message.handled" and message_id in open_claims:
                job_id, start = open_claims.pop(message_id)
                attempts.setdefault(job_id, []).append(
                    {"worker": worker.env["WORKER_ID"], "start": start,
                     "end": datetime.fromisoformat(event["timestamp"])})
        for job_id, start in open_claims.values():
            attempts.setdefault(job_id, []).append({"worker": worker.env["WORKER_ID"], "start": start, "end": None})
    return attempts


def test_overlap_check_finds_overlaps():
    """The interval check itself flags overlapping and unfinished attempts and passes back-to-back ones."""
    from datetime import datetime, timedelta

    t = datetime(2026, 1, 1, tzinfo=UTC)
    s = timedelta(seconds=1)
    assert overlapping_attempts([{"start": t, "end": t + s}, {"start": t + s, "end": t + 2 * s}]) == []
    assert len(overlapping_attempts([{"start": t, "end": t + 2 * s}, {"start": t + s, "end": t + 3 * s}])) == 1
    assert len(overlapping_attempts([{"start": t, "end": None}, {"start": t + s, "end": t + 3 * s}])) == 1


@pytest.mark.server
def test_four_workers_two_hundred_messages_each_job_completed_once(moto_server, tmp_path):
    """Four daemons share one queue and one SQLite file: 140 jobs (60 duplicate messages) all complete exactly once, never trained by two workers at once, queues empty."""
    stack = make_stack(moto_server, tmp_path, quick_pipeline())
    jobs = [stack.submit(directory="load", send=False) for _ in range(JOBS)]
    bodies = [body for _, _, body in jobs]
    copies = [1] * SINGLES + [2] * DOUBLES + [3] * TRIPLES
    messages = [body for body, n in zip(bodies, copies, strict=True) for _ in range(n)]
    random.Random(7).shuffle(messages)
    assert len(messages) == MESSAGES

    env = {"SQS_VISIBILITY_TIMEOUT_SECONDS": "10", "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "2000"}
    workers = [WorkerProcess(stack.env(WORKER_ID=f"load-{n}", LIVENESS_FILE=str(tmp_path / f"alive-{n}"), **env),
                             tmp_path / f"worker-{n}.log") for n in range(WORKERS)]
    try:
        for worker in workers:
            worker.start()
        # Every worker has made its first receive before the first message goes in.
        wait_until(lambda: all((tmp_path / f"alive-{n}").exists() for n in range(WORKERS)), 60, "workers up")
        started_s = time.monotonic()
        for first in range(0, MESSAGES, 10):
            stack.queues.sqs.send_message_batch(QueueUrl=stack.queues.url, Entries=[
                {"Id": str(i), "MessageBody": body} for i, body in enumerate(messages[first:first + 10])])

        def all_done() -> bool:
            with stack.store() as store:
                done = sum((store.get_job(job_id) or {}).get("status") == "completed" for job_id, _, _ in jobs)
            return done == JOBS and stack.queue_counts() == ((0, 0), (0, 0))

        wait_until(all_done, LOAD_TIMEOUT_S, "every job completed and both queues empty", interval_s=0.5)
        elapsed_s = time.monotonic() - started_s
        assert [worker.stop() for worker in workers] == [0] * WORKERS
    finally:
        for worker in workers:
            worker.ensure_dead()

    logged = [event for worker in workers for event in worker.events()]
    events = Counter(event.get("event", "") for event in logged)
    assert events["job.completed"] == JOBS
    assert events["worker.crashed"] == 0 and events["message.settle_failed"] == 0
    # Every message deleted; one deleted twice only when SQS delivered it twice (a starved machine can
    # let a visibility lapse while the holder's renewal still succeeds on the old receipt handle).
    deletes = Counter(e["message_id"] for e in logged if e.get("event") == "message.deleted")
    received_again = {e["message_id"] for e in logged
                      if e.get("event") == "message.received" and e.get("receive_count", 1) > 1}
    assert len(deletes) == MESSAGES
    assert [m for m, n in deletes.items() if n > 1 and m not in received_again] == []
    # Each delete that is not a completion acknowledged a copy without work: held by another worker,
    # already complete when read, or completed by another worker between that read and the claim.
    without_work = events["job.duplicate_delivery"] + events["job.already_complete"] + events["job.nothing_to_do"]
    assert without_work == sum(deletes.values()) - JOBS

    for job_id, attempts in attempts_from_logs(workers).items():
        assert overlapping_attempts(attempts) == [], f"two workers worked on {job_id} at once: {attempts}"

    trained_by: Counter = Counter()
    with stack.store() as store:
        for job_id, profile_id, _ in jobs:
            job, profile = store.get_job(job_id), store.get_profile(profile_id)
            completions = [h for h in job["history"] if h["outcome"] == "completed"]
            assert job["status"] == "completed" and len(completions) == 1, job["history"]
            assert overlapping_attempts(job["history"]) == [], f"two workers held {job_id} at once"
            assert profile["status"] == "completed" and sorted(profile["s3Paths"]) == sorted(ARTIFACT_KEYS)
            stage_runs = [n for n in stack.stage_logs(job_id, "load") if n.endswith("-quick.log")]
            assert 1 <= len(stage_runs) <= len(job["history"])
            trained_by[completions[0]["worker"]] += 1
    assert sorted(trained_by) == [f"load-{n}" for n in range(WORKERS)], f"not every worker took part: {trained_by}"

    versions = Counter()
    for page in stack.s3.get_paginator("list_object_versions").paginate(Bucket=stack.bucket):
        # Shipped stage logs (worker.voice.stage_logs) share the bucket; only the artifacts count here.
        versions.update(v["Key"] for v in page.get("Versions", []) if f"/{LOGS_KEY_DIR}/" not in v["Key"])
    assert len(versions) == JOBS * len(ARTIFACT_KEYS) and set(versions.values()) == {1}
    print(f"\n{MESSAGES} messages, {JOBS} jobs, {WORKERS} workers: {elapsed_s:.1f} s; jobs per worker "
          f"{dict(trained_by)}; copies held elsewhere {events['job.duplicate_delivery']}, "
          f"already complete {events['job.already_complete']}")
