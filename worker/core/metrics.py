"""Metrics as CloudWatch embedded metric format (EMF): one JSON object per line, no metrics service.

CloudWatch Logs extracts metrics from any log event that is exactly one EMF document (PutLogEvents
needs no special header), so whatever ships stdout to a log group is enough: the ECS ``awslogs``
driver, or the CloudWatch agent tailing a file the unit's stdout goes to. The lines go to **stdout**
while the structured logs go to stderr, so a shipper can route or drop them separately; each line is
written whole under a lock, so the heartbeat thread and the loop never interleave. One per event::

    {"_aws": {"Timestamp": 1714564800000,
              "CloudWatchMetrics": [{"Namespace": "VoiceWorker",
                                     "Dimensions": [["Environment", "Queue"]],
                                     "Metrics": [{"Name": "JobDuration", "Unit": "Seconds"}]}]},
     "Environment": "production", "Queue": "jobs", "JobDuration": 812.4, "outcome": "completed"}

Namespace: METRICS_NAMESPACE. Dimensions: METRICS_DIMENSIONS ("Name=Value,..."), added to every metric;
a caller may add a dimension of its own to one document (``emit(dimensions=...)``). METRICS_ENABLED=false
writes nothing. The metric names below are the loop's and the heartbeat's; a layer above names its own
next to its code and passes them to ``parse_dimensions`` as ``reserved``, so that no configured
dimension shadows them. The names config/cloudwatch-dashboard.json and config/cloudwatch-alarms.yaml
refer to are the core's and those.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any, TextIO

import structlog

from worker.core.core_config import MetricsConfig
from worker.core.errors import Action

log = structlog.get_logger(__name__)

DEFAULT_NAMESPACE = "VoiceWorker"
SECONDS, COUNT = "Seconds", "Count"

JOB_DURATION = "JobDuration"                            # the completing attempt: receipt to delete
RECEIVE_COUNT_AT_COMPLETION = "ReceiveCountAtCompletion"
HEARTBEAT_FAILURES = "HeartbeatFailures"                # a renewal (the queue's or a callback's) that failed
# A scale-in protection clear that still failed after its retries: an idle task may stay protected.
PROTECTION_CLEAR_FAILURES = "TaskProtectionClearFailures"

# What the loop did with a message -> the count it adds 1 to.
class Outcome(StrEnum):
    """How one message ended, as counted: the loop's action, refined by the handler's label."""

    COMPLETED = "completed"
    RETRIED = "retried"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"
    RELEASED = "released"
    SKIPPED = "skipped"  # acknowledged without work: already complete, or a duplicate
    LEASE_LOST = "lease_lost"


# Keyed by text: ``outcome_of`` passes an action it does not map through unchanged.
OUTCOME_METRICS: dict[str, str] = {
    Outcome.COMPLETED: "JobsCompleted",
    Outcome.RETRIED: "JobsRetried",
    Outcome.DEAD_LETTERED: "JobsDeadLettered",
    Outcome.CANCELLED: "JobsCancelled",
    Outcome.RELEASED: "JobsReleased",
    Outcome.SKIPPED: "JobsSkipped",
    Outcome.LEASE_LOST: "JobsLeaseLost",
}
# The core's metric names: what the loop and the heartbeat emit.
METRIC_NAMES = frozenset({JOB_DURATION, RECEIVE_COUNT_AT_COMPLETION, HEARTBEAT_FAILURES, PROTECTION_CLEAR_FAILURES,
                          *OUTCOME_METRICS.values()})

MAX_DIMENSIONS = 30  # per dimension set, CloudWatch's limit
_DIMENSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,249}")  # EMF allows 250
_RESERVED = METRIC_NAMES | {"_aws"}


def parse_dimensions(text: str, reserved: Iterable[str] = ()) -> dict[str, str]:
    """``"Environment=production,Queue=jobs"`` -> a dict; ValueError with a readable reason.

    No name may be one of the core's metrics or ``reserved`` (the metric and dimension names of the
    layers above): a dimension of that name would shadow them in the document.
    """
    taken = _RESERVED | frozenset(reserved)
    dims: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not value:
            raise ValueError(f"{item!r} is not Name=Value")
        if not _DIMENSION_NAME.fullmatch(name):
            raise ValueError(f"dimension name {name!r} must be letters, digits, '_', '.', '-'")
        if name in taken:
            raise ValueError(f"dimension name {name!r} is reserved (a metric or built-in dimension)")
        if len(value) > 1024:
            raise ValueError(f"dimension {name} has a value longer than 1024 characters")
        if name in dims:
            raise ValueError(f"dimension {name} is given twice")
        dims[name] = value
    if len(dims) > MAX_DIMENSIONS - 1:  # one place is kept for a dimension a caller adds (emit's)
        raise ValueError(f"at most {MAX_DIMENSIONS - 1} dimensions, got {len(dims)}")
    return dims


def outcome_of(action: Action, label: str | None) -> Outcome | str:
    """The outcome counted for the loop's ``Action`` and the handler's label (for an ack)."""
    if action == Action.ACK:
        return Outcome(label) if label in (Outcome.COMPLETED, Outcome.CANCELLED) else Outcome.SKIPPED
    return {Action.RETRY: Outcome.RETRIED, Action.DEAD_LETTER: Outcome.DEAD_LETTERED,
            Action.RELEASE: Outcome.RELEASED, Action.ABANDON: Outcome.LEASE_LOST}.get(action, action)


def emf_document(namespace: str, dimensions: Mapping[str, str], values: Mapping[str, tuple[float, str]],
                 *, timestamp_ms: int, properties: Mapping[str, Any] | None = None) -> dict | None:
    """One EMF document; ``values`` maps a metric name to (value, unit). None when nothing is left."""
    finite = {name: (float(v), unit) for name, (v, unit) in values.items()
              if isinstance(v, (int, float)) and math.isfinite(v)}
    if not finite:
        return None
    directive = {
        "Namespace": namespace,
        "Dimensions": [list(dimensions)],
        "Metrics": [{"Name": name, "Unit": unit} for name, (_v, unit) in finite.items()],
    }
    # Properties first: a property can never shadow a dimension or a metric value.
    doc: dict[str, Any] = {k: v for k, v in (properties or {}).items() if k not in _RESERVED}
    doc.update(dimensions)
    doc.update({name: value for name, (value, _unit) in finite.items()})
    doc["_aws"] = {"Timestamp": int(timestamp_ms), "CloudWatchMetrics": [directive]}
    return doc


class Metrics:
    """Writes EMF lines; safe from the heartbeat thread and the main thread at once."""

    def __init__(self, namespace: str = DEFAULT_NAMESPACE, dimensions: Mapping[str, str] | None = None,
                 *, stream: TextIO | None = None, enabled: bool = True,
                 clock: Callable[[], float] = time.time):
        self.namespace = namespace
        self.dimensions = dict(dimensions or {})
        self.enabled = enabled
        self._stream = stream
        self._clock = clock
        self._lock = threading.Lock()
        self._write_failed = False

    @classmethod
    def from_config(cls, config: MetricsConfig, stream: TextIO | None = None) -> Metrics:
        return cls(config.namespace, config.dimensions, stream=stream, enabled=config.enabled)

    def emit(self, values: Mapping[str, tuple[float, str]], *,
             dimensions: Mapping[str, str] | None = None, **properties: Any) -> None:
        """Write one document; ``dimensions`` are added to the configured ones for these values."""
        if not self.enabled:
            return
        doc = emf_document(self.namespace, {**self.dimensions, **(dimensions or {})}, values,
                           timestamp_ms=round(self._clock() * 1000), properties=properties)
        if doc is None:
            return
        line = json.dumps(doc, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            try:
                stream = self._stream or sys.stdout  # looked up late: tests and daemons may swap it
                stream.write(line)
                stream.flush()
            except (OSError, ValueError) as exc:
                # Metrics are advisory: a closed or broken stdout must never fail a job.
                if not self._write_failed:
                    self._write_failed = True
                    log.warning("metrics.write_failed", error=f"{type(exc).__name__}: {exc}")

    def count(self, name: str, value: float = 1, **properties: Any) -> None:
        self.emit({name: (value, COUNT)}, **properties)

    def seconds(self, name: str, value_s: float, *, dimensions: Mapping[str, str] | None = None,
                **properties: Any) -> None:
        self.emit({name: (value_s, SECONDS)}, dimensions=dimensions, **properties)


NULL_METRICS = Metrics(enabled=False)
