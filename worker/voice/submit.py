"""Submitting a job: records first (idempotently), then the message. Used by `submit` and the demo.

The record keeps the exact body as ``messageBody`` and gets ``enqueuedAt`` once the send succeeded:
a pending job without that stamp is one whose message may never have reached the queue, and the
reconciler (worker/ops/reconcile.py) sends ``messageBody`` again, once.

A submission with an ``idempotencyKey`` also stores ``submissionHash``, the SHA-256 of the canonical
JSON of the fields that define the job (``submission_hash``), in the same write as the record. A
later submission with that key and a different hash is refused (``IdempotencyMismatch``), as
Powertools' idempotency payload validation does, instead of answering with a job that is not the one
asked for. Records made before the hash existed have none: their key is honoured without a comparison.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

import structlog

from worker.core import tracing
from worker.core.errors import InvalidMessage, QueueError, WorkerError
from worker.core.queue import Queue
from worker.voice.errors import IdempotencyMismatch
from worker.voice.input_policy import SHAPE_ONLY, InputPolicy
from worker.voice.message import Job, parse_job
from worker.voice.records import Store

log = structlog.get_logger(__name__)

SUBMISSION_HASH = "submissionHash"
# The ids a submit generates when the caller left them out: not part of what defines the job.
_GENERATED = ("jobId", "idempotencyKey")


def submission_hash(body: dict) -> str:
    """``sha256:<hex>`` of the canonical JSON (sorted keys, no spaces) of what defines the job: every
    field but ``jobId``, ``idempotencyKey`` and ``_doc._id``, which a submit may generate."""
    fields = {name: value for name, value in body.items() if name not in _GENERATED}
    doc = fields.pop("_doc", None)
    if isinstance(doc, dict):
        doc = {name: value for name, value in doc.items() if name != "_id"}
    if doc:
        fields["_doc"] = doc
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def new_object_id() -> str:
    """A fresh 24-hex id, the shape of a MongoDB ObjectId."""
    return secrets.token_hex(12)


def prepare(payload: Any, policy: InputPolicy = SHAPE_ONLY) -> tuple[dict, Job, str | None]:
    """The message body to send, its validated Job, and the idempotency key; InvalidMessage if bad."""
    if not isinstance(payload, dict):
        raise InvalidMessage("submission must be a JSON object with the message's fields")
    body = dict(payload)
    key = body.pop("idempotencyKey", None)
    if key is not None and (not isinstance(key, str) or not key.strip() or len(key) > 256):
        raise InvalidMessage("idempotencyKey: must be a non-empty string of at most 256 characters")
    body.setdefault("jobId", new_object_id())
    body.setdefault("_doc", {"_id": body["jobId"]})
    job = parse_job(json.dumps(body), policy)
    return body, job, key


def submit(store: Store, sqs, queue_url: str, payload: Any, *,
           policy: InputPolicy = SHAPE_ONLY) -> tuple[str, bool]:
    """Create the records when absent, then enqueue; a repeated idempotency key enqueues nothing
    (and raises ``IdempotencyMismatch`` when it came with other fields).

    With the worker's ``policy`` (``Settings.input_policy()``) a job the worker would refuse is
    refused here, before any record exists; the default checks the shape only and leaves the rest
    to the worker, which dead-letters what its policy refuses.
    """
    return submit_prepared(store, sqs, queue_url, prepare(payload, policy))


def submit_prepared(store: Store, sqs, queue_url: str,
                    prepared: tuple[dict, Job, str | None]) -> tuple[str, bool]:
    """``submit`` for what ``prepare`` already validated: records, then the message."""
    body, job, key = prepared
    record = {
        "_id": job.job_id,
        "profileId": job.profile_id,
        "environment": job.environment,
        "directoryName": job.directory_name,
        "messageBody": json.dumps(body),
    }
    if key is not None:
        record[SUBMISSION_HASH] = submission_hash(body)
    job_id, created = store.submit(record, {"_id": job.profile_id}, idempotency_key=key)
    if not created and key is not None:
        # The stored hash was written with the record, so a concurrent submit that lost the race
        # to ours is judged on the body that won.
        found = store.get_job(job_id)
        # Not a field of the typed record: the submit's own bookkeeping, kept in the stored document.
        existing = found.document if found is not None else {}
        stored = existing.get(SUBMISSION_HASH)
        if stored is None:
            log.info("submit.idempotency_unverified", job_id=job_id,
                     note="the job was recorded before submissions were hashed: the body is not compared")
        elif stored != record[SUBMISSION_HASH]:
            raise IdempotencyMismatch(job_id, key)
        return job_id, False
    try:
        # On a FIFO queue the job is its own group, and a second send of it within SQS's 5-minute
        # deduplication interval (a retried submit with the same jobId) is dropped as a duplicate.
        with tracing.span("submit", **{"job.id": job_id}):  # the job's trace starts here and goes with it
            Queue(sqs, queue_url).send(record["messageBody"], group_id=job_id, dedup_id=job_id,
                                       attributes=tracing.message_attributes())
    except QueueError as exc:
        # The record stays pending; `reconcile` re-enqueues pending jobs whose message never arrived.
        raise QueueError(f"job {job_id} recorded but not enqueued: {exc}") from exc
    try:
        store.mark_enqueued(job_id)
    except WorkerError as exc:
        # The message is on its way: at worst the reconciler sends a duplicate, which the worker
        # acknowledges without work. Failing the submit here would invite a second submit instead.
        log.warning("submit.mark_enqueued_failed", job_id=job_id, error=str(exc))
    return job_id, created
