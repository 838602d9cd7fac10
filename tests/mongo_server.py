"""Fixtures for a real MongoDB server under the store's tests: one per xdist worker, a fresh database per test.

The server is the local SecantusDB process of ``worker.ops.localmongo`` on a free loopback port,
started once per test session of each xdist worker (it takes seconds, a database takes milliseconds).
``MONGO_TEST_URI``, when set, points the tests at a real mongod instead (a replica set, for the
majority write concern) and no server is started. A server that cannot start fails every test that
needs it, with its log: never a skip, which would hide the gap.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest

from worker.ops.localmongo import LocalMongo
from worker.voice.records.mongo import connect_mongo

TEST_URI_ENV = "MONGO_TEST_URI"
_databases = itertools.count()


def database_uri(server_uri: str, database: str) -> str:
    """``server_uri`` naming ``database`` as its default database, its options (a query) kept."""
    scheme, _, rest = server_uri.partition("://")
    hosts, _, path = rest.partition("/")
    query = path.partition("?")[2] or (rest.partition("?")[2] if "/" not in rest else "")
    hosts = hosts.partition("?")[0]
    return f"{scheme}://{hosts}/{database}" + (f"?{query}" if query else "")


@pytest.fixture(scope="session")
def mongo_server_uri(worker_id: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URI of a real MongoDB server: ``MONGO_TEST_URI``, or a local server started for this worker."""
    uri = os.environ.get(TEST_URI_ENV)
    if uri:
        yield uri
        return
    log_path = tmp_path_factory.getbasetemp() / f"mongo-server-{worker_id}.log"
    with LocalMongo(log_path=log_path) as server:
        yield server.uri


@pytest.fixture(scope="session")
def mongo_client(mongo_server_uri: str) -> Iterator[Any]:
    """One client per session, made by the project's own connect check."""
    client = connect_mongo(mongo_server_uri, max_attempts=3, retry_delay_s=0.5)
    yield client
    client.close()


@pytest.fixture
def mongo_db(mongo_client: Any, worker_id: str) -> Iterator[Any]:
    """A database of its own for one test, dropped after it."""
    name = f"voice_test_{worker_id}_{os.getpid()}_{next(_databases)}"
    yield mongo_client[name]
    mongo_client.drop_database(name)
