"""Fixtures shared by the dead-letter tests: a fault-injecting client over moto and the DLQ behind it."""

from __future__ import annotations

import pytest

from tests.support import FaultyClient
from worker.ops.dlq import DeadLetterQueue


@pytest.fixture
def client(queues):
    return FaultyClient(queues.sqs)


@pytest.fixture
def dlq(client, queues):
    return DeadLetterQueue.of(client, queues.url, wait_s=0)
