"""boto3 clients built one way: botocore's standard retry mode, timeouts that fit the long poll."""

from __future__ import annotations

import threading
from collections.abc import Callable

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, NoRegionError

from worker.core.core_config import AwsConfig
from worker.core.errors import ConfigError


def client_config(aws: AwsConfig) -> Config:
    return Config(
        region_name=aws.region,
        # Throttling and 5xx are retried by botocore with jittered backoff; there is no retry loop of ours.
        retries={"mode": "standard", "max_attempts": 5},
        connect_timeout=5,
        # A long poll holds the connection for up to SQS_WAIT_TIME_SECONDS: reading must outlast it.
        read_timeout=aws.long_poll_s + 10,
    )


def lease_client_config(aws: AwsConfig) -> Config:
    """For heartbeat renewals: fail fast and try again on the next tick rather than block the tick."""
    tick_s = max(1.0, aws.heartbeat_interval_s)
    return Config(
        region_name=aws.region,
        retries={"mode": "standard", "max_attempts": 2},
        connect_timeout=min(5.0, tick_s),
        read_timeout=min(10.0, tick_s),
    )


def notice_client_config(aws: AwsConfig) -> Config:
    """For best-effort notices on the job's thread (state-change events): a few seconds at most."""
    return Config(region_name=aws.region, retries={"mode": "standard", "max_attempts": 2},
                  connect_timeout=3.0, read_timeout=5.0)


NO_REGION = "AWS_REGION is not set and cannot be derived from SQS_QUEUE_URL: set AWS_REGION"


def new_session() -> boto3.session.Session:
    return boto3.session.Session()


class LazyClient:
    """A client made on its first use, once, also when two threads use it first together."""

    def __init__(self, make: Callable[[], object]):
        self._make = make
        self._client: object | None = None
        self._lock = threading.Lock()

    def made(self):
        """The client, made now if this is its first use."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make()
                client = self._client
        return client

    def __getattr__(self, name: str):
        return getattr(self.made(), name)


def make_client(service: str, aws: AwsConfig, session: boto3.session.Session | None = None,
                config: Config | None = None):
    """A client, or ConfigError when no region can be found (SQS has no default region)."""
    session = session or boto3.session.Session()
    # Checked for every service, not only SQS: S3 and STS would quietly default to us-east-1.
    if aws.region is None and session.region_name is None:
        raise ConfigError(NO_REGION)
    try:
        return session.client(service, config=config or client_config(aws),
                              endpoint_url=aws.endpoint_url)
    except NoRegionError:
        raise ConfigError(NO_REGION) from None


def aws_error_text(exc: Exception) -> str:
    """One line for an AWS call that failed: the service's error code and message, else the exception."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code')}: {error.get('Message')}"
    return f"{type(exc).__name__}: {exc}"
