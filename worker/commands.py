"""The operator's commands: submit, status, cancel, health. Each takes its clients, prints, returns an exit code."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any, TextIO

from worker.errors import InvalidMessage, WorkerError
from worker.health import liveness_problem
from worker.settings import Settings
from worker.store import FINAL_STATUSES, Store
from worker.submit import submit

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def cmd_submit(store: Store, sqs, queue_url: str, source: TextIO, *, as_json: bool, out=sys.stdout,
               err=sys.stderr) -> int:
    try:
        payload = json.loads(source.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        print(f"submission is not valid JSON: {exc}", file=err)
        return EXIT_USAGE
    try:
        job_id, created = submit(store, sqs, queue_url, payload)
    except InvalidMessage as exc:
        for line in exc.problems:
            print(line, file=err)
        return EXIT_USAGE
    except WorkerError as exc:
        print(f"submit failed: {exc}", file=err)
        return EXIT_FAILED
    if as_json:
        print(json.dumps({"jobId": job_id}), file=out)
    else:
        print(job_id if created else f"{job_id} (already submitted with this idempotency key)", file=out)
    return EXIT_OK


def status_document(store: Store, job_id: str) -> dict | None:
    job = store.get_job(job_id)
    if job is None:
        return None
    profile = store.get_profile(job["profileId"]) if job.get("profileId") else None
    return {"job": _jsonable(job), "profile": _jsonable(profile)}


def render_status(doc: dict) -> str:
    job, profile = doc["job"], doc["profile"] or {}
    lines = [f"job {job['_id']}: {job.get('status')}  (attempts: {job.get('attempts', 0)})"]
    if job.get("progress"):
        p = job["progress"]
        lines.append(f"  progress   {p.get('stage')} {p.get('percent', 0):.0f} %  (at {p.get('updatedAt')})")
    if job.get("lease"):
        lines.append(f"  lease      held by {job['lease'].get('owner')} until {job['lease'].get('expiresAt')}")
    if job.get("cancelRequested") and job.get("status") != "cancelled":
        lines.append("  cancel     requested")
    if job.get("error"):
        e = job["error"]
        kind = "retryable" if e.get("retryable") else "permanent"
        lines.append(f"  error      {e.get('type')} ({kind}): {e.get('message')}")
    for h in job.get("history") or []:
        lines.append(f"  attempt    {h.get('start')} -> {h.get('end') or '…'}  {h.get('outcome')}  on {h.get('worker')}")
    if job.get("completedAt"):
        lines.append(f"  completed  {job['completedAt']}")
    lines.append(f"profile {profile.get('_id', job.get('profileId'))}: {profile.get('status', 'missing')}")
    for key, path in (profile.get("modelPaths") or {}).items():
        lines.append(f"  {key:<18} {path}")
    for key, uri in (profile.get("s3Paths") or {}).items():
        lines.append(f"  {key:<18} {uri}")
    return "\n".join(lines)


def cmd_status(store: Store, job_id: str, *, as_json: bool, watch_s: float | None = None, out=sys.stdout,
               err=sys.stderr, sleep=time.sleep) -> int:
    while True:
        doc = status_document(store, job_id)
        if doc is None:
            print(f"no job {job_id}", file=err)
            return EXIT_NOT_FOUND
        print(json.dumps(doc) if as_json else render_status(doc), file=out, flush=True)
        job = doc["job"]
        permanent_error = job.get("status") == "error" and not (job.get("error") or {}).get("retryable")
        if not watch_s or job.get("status") in FINAL_STATUSES or permanent_error:
            return EXIT_OK
        sleep(watch_s)
        if not as_json:
            print("", file=out)


def cmd_cancel(store: Store, job_id: str, out=sys.stdout, err=sys.stderr) -> int:
    job = store.get_job(job_id)
    if job is None:
        print(f"no job {job_id}", file=err)
        return EXIT_NOT_FOUND
    if store.request_cancel(job_id):
        print(f"cancel requested for {job_id}: a running attempt stops at its next heartbeat; "
              "a queued one ends cancelled when it is received", file=out)
        return EXIT_OK
    print(f"job {job_id} is already {job.get('status')}: nothing to cancel", file=err)
    return EXIT_FAILED


def cmd_health(settings: Settings, out=sys.stdout) -> int:
    problem = liveness_problem(settings.liveness_file, settings.liveness_age_limit_s)
    if problem:
        print(f"unhealthy: {problem}", file=out)
        return EXIT_FAILED
    print("healthy", file=out)
    return EXIT_OK
