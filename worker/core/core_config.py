"""What the core is configured with: small frozen values, built once from the settings and passed in.

The core never sees the whole ``Settings`` (worker/settings.py builds these from it): each piece
takes the one value it reads, so the core imports only itself and a test builds exactly what it
exercises. Like httpx's ``Timeout`` and ``Limits``, they are plain data: the settings validated
every number and every cross-setting rule, so nothing here checks again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# Recorded retryable failures a job may have before the worker dead-letters it (MAX_FAILED_ATTEMPTS;
# ``worker.core.loop.retry_budget``).
DEFAULT_MAX_FAILED_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class LeaseTimings:
    """Every clock the heartbeat keeps for one message (worker/core/lease.py), all from the receipt."""

    visibility_timeout_s: int  # what each renewal resets the message's visibility to
    interval_s: float  # between two renewals
    time_limit_s: float  # one attempt: then the stop signal says time_limit
    shutdown_grace_s: float  # from a shutdown request to the stop signal saying shutdown
    # Past the time limit, how long the handler has to stop before the heartbeat gives the message up
    # (None: never). The loop's: the stage runner's SIGTERM -> SIGKILL wait plus one last tick.
    wind_down_s: float | None = None


@dataclass(frozen=True, slots=True)
class Backoff:
    """The retry visibility: base * 2^(receives-1) seconds, jittered, capped at ``max_s``."""

    base_s: int = 30
    max_s: int = 900  # also how long a message that could not be dead-lettered is parked


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """What the worker loop reads (worker/core/loop.py)."""

    wait_s: int  # the receive's long poll
    lease: LeaseTimings  # one per message, the same for all
    backoff: Backoff = Backoff()


@dataclass(frozen=True, slots=True)
class AwsConfig:
    """How boto3 clients are made (worker/core/aws.py)."""

    region: str | None = None  # None: boto3's own chain (AWS_DEFAULT_REGION, ~/.aws/config) decides
    endpoint_url: str | None = None  # a local stand-in for AWS; None: AWS itself
    long_poll_s: int = 20  # the longest receive wait: reading a response must outlast it
    heartbeat_interval_s: float = 60.0  # renewal clients give up well within one tick


_REGION_IN_QUEUE_URL = re.compile(r"^https://sqs[.-]([a-z0-9-]+)\.amazonaws\.com")


def region_for(region: str | None, queue_url: str | None) -> str | None:
    """``region`` (AWS_REGION), else the region in an AWS queue URL, else None."""
    if region:
        return region
    m = _REGION_IN_QUEUE_URL.match(queue_url or "")
    return m.group(1) if m else None


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """What the EMF metrics carry (worker/core/metrics.py)."""

    namespace: str
    dimensions: Mapping[str, str] = field(default_factory=dict)  # added to every metric
    enabled: bool = True
