"""Shared fixtures: hermetic AWS credentials, moto, and settings built the way the daemon builds them."""

from __future__ import annotations

import os

import pytest

# A real MongoDB server per xdist worker (mongo_server_uri, mongo_client, mongo_db).
pytest_plugins = ["tests.mongo_server"]

# Tests never reach real AWS: fake credentials, a fixed region, no instance-metadata lookups.
for _name, _value in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}.items():
    os.environ[_name] = _value
for _name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
    os.environ.pop(_name, None)


@pytest.fixture(autouse=True)
def _logging_left_as_found():
    """A test that points the logs at a stream of its own (a captured stderr, say) does not leave later
    tests in the same process writing to it once it is closed: the order differs under pytest-xdist."""
    import logging

    import structlog

    root = logging.getLogger()
    handlers = root.handlers[:]
    yield
    structlog.reset_defaults()
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)


@pytest.fixture
def aws():
    from moto import mock_aws

    with mock_aws():
        yield


@pytest.fixture(scope="session")
def moto_server():
    """A real moto server process on a free loopback port (the demo's, one way to start it); yields its URL."""
    from worker.ops.demo import LocalAws

    with LocalAws() as aws:
        yield aws.url


@pytest.fixture
def sqs(aws):
    import boto3

    return boto3.client("sqs", region_name="us-east-1")


@pytest.fixture
def queues(sqs):
    from tests.support import create_queues

    return create_queues(sqs)


@pytest.fixture
def fake_clock():
    """The heartbeat's clock in tests: it moves only when the test advances it (worker.core.testing)."""
    from worker.core.testing import FakeClock

    return FakeClock()


@pytest.fixture
def memory_queue(fake_clock):
    """An in-memory queue with a dead-letter queue, both timed by ``fake_clock``."""
    from worker.core.testing import MemoryQueue

    return MemoryQueue(fake_clock, url="memory://jobs",
                       dead_letter_queue=MemoryQueue(fake_clock, url="memory://jobs-dlq"))


@pytest.fixture
def make_worker(queues):
    """Build a Worker on the moto queue; returns (worker, recording client).

    With ``clock=`` (a FakeClock) the heartbeat runs on that clock and the handler starts once it is
    parked there, so the handler moves time with ``clock.advance`` instead of sleeping.
    """
    from tests.support import FAST, FaultyClient, on_the_clock
    from worker.core.loop import Worker
    from worker.core.queue import Queue
    from worker.settings import load_settings

    def build(handler, *, client=None, reporter=None, clock=None, **env):
        values = {**FAST, "SQS_QUEUE_URL": queues.url, **{k: str(v) for k, v in env.items()}}
        settings = load_settings(values)
        faulty = client or FaultyClient(queues.sqs)
        loop_config = settings.loop_config()
        if clock is None:
            return Worker(loop_config, Queue(faulty, queues.url), handler, reporter=reporter), faulty
        worker = Worker(loop_config, Queue(faulty, queues.url, clock=clock), on_the_clock(handler, clock),
                        reporter=reporter, clock=clock, wait=clock.wait)
        return worker, faulty

    return build


@pytest.fixture
def make_memory_worker(memory_queue):
    """Build a Worker on ``memory_queue`` with its heartbeat on the queue's fake clock; returns the worker.

    The handler starts once the heartbeat is parked on the clock; it moves time with ``clock.advance``.
    """
    from tests.support import FAST, on_the_clock
    from worker.core.loop import Worker
    from worker.settings import load_settings

    def build(handler, *, queue=None, **kw):
        queue = queue or memory_queue
        env = {k: str(v) for k, v in kw.items() if k.isupper()}
        options = {k: v for k, v in kw.items() if not k.isupper()}
        settings = load_settings({**FAST, "SQS_QUEUE_URL": queue.url, **env})
        return Worker(settings.loop_config(), queue, on_the_clock(handler, queue.clock), clock=queue.clock,
                      wait=queue.clock.wait, **options)

    return build
