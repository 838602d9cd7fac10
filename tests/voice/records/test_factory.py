"""open_store: the settings choose the store, and a store that cannot start says so."""

from __future__ import annotations

import mongomock
import pytest
from pymongo.errors import ServerSelectionTimeoutError

from tests.voice.records.conftest import JOB_ID, submit
from worker.core.errors import ConfigError
from worker.settings import load_settings
from worker.voice.records import Access, open_store
from worker.voice.records.errors import StoreError
from worker.voice.records.mongo import MongoStore
from worker.voice.records.sqlite import SqliteStore


def test_store_url_opens_sqlite_and_creates_its_directory(tmp_path):
    """STORE_URL=sqlite:///path opens a SQLite store at that path, creating the directory."""
    path = tmp_path / "var" / "records.db"
    store = open_store(load_settings({"STORE_URL": f"sqlite:///{path}"}).store_config())
    try:
        assert isinstance(store, SqliteStore)
        submit(store)
        assert path.exists()
    finally:
        store.close()


def test_mongo_uri_opens_mongo_with_indexes_and_owns_the_client():
    """MONGO_URI opens a MongoStore on the URI's database with its indexes, closing the client on close."""
    clients = []

    def factory(uri, **_kwargs):
        clients.append(mongomock.MongoClient(uri))
        return clients[-1]

    settings = load_settings({"MONGO_URI": "mongodb://db.internal:27017/voicedb",
                              "MONGO_JOBS_COLLECTION": "jobs"})
    store = open_store(settings.store_config(), mongo_client_factory=factory)
    assert isinstance(store, MongoStore)
    submit(store)
    assert clients[0]["voicedb"]["jobs"].count_documents({}) == 1
    assert "idempotencyKey_unique" in clients[0]["voicedb"]["jobs"].index_information()
    store.close()


class DownClient:
    """A client whose server never answers."""

    def __init__(self) -> None:
        self.admin = self
        self.closed = False

    def command(self, _name: str) -> dict:
        raise ServerSelectionTimeoutError("no servers")

    def close(self) -> None:
        self.closed = True


def test_unreachable_mongo_fails_after_the_configured_attempts():
    """An unreachable MongoDB raises StoreError after MONGO_CONNECT_MAX_ATTEMPTS with the configured delay."""
    client, sleeps = DownClient(), []
    settings = load_settings({"MONGO_URI": "mongodb://db:27017", "MONGO_CONNECT_MAX_ATTEMPTS": "3",
                              "MONGO_CONNECT_RETRY_DELAY_MS": "250"})
    with pytest.raises(StoreError):
        open_store(settings.store_config(), mongo_client_factory=lambda _uri, **_kw: client,
                   sleep=sleeps.append)
    assert sleeps == [0.25, 0.5] and client.closed


def test_no_store_configured_is_a_config_error():
    """Without MONGO_URI or STORE_URL there is no store to open."""
    with pytest.raises(ConfigError):
        open_store(load_settings({}).store_config())


def test_reopened_sqlite_store_sees_earlier_records(tmp_path):
    """Records survive closing and reopening the same file."""
    path = str(tmp_path / "records.db")
    with SqliteStore(path) as store:
        submit(store)
    with SqliteStore(path) as store:
        assert store.get_job(JOB_ID)["status"] == "pending"


@pytest.mark.parametrize("access", [Access.EXISTING, Access.READ, "read"])
def test_existing_and_read_access_never_create_a_missing_file(tmp_path, access):
    """Access EXISTING or READ (or its string) on a missing STORE_URL file is a ConfigError naming it; no file or directory appears."""
    path = tmp_path / "var" / "records.db"
    with pytest.raises(ConfigError) as raised:
        open_store(load_settings({"STORE_URL": f"sqlite:///{path}"}).store_config(), access=access)
    assert raised.value.problems == [f"STORE_URL names {path}, which does not exist"]
    assert not path.parent.exists()


def test_a_relative_missing_file_is_named_with_its_absolute_path(tmp_path, monkeypatch):
    """A relative STORE_URL path that does not exist is shown as written and as resolved."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        open_store(load_settings({"STORE_URL": "sqlite:///var/records.db"}).store_config(), access="read")
    assert raised.value.problems == [f"STORE_URL names var/records.db ({tmp_path}/var/records.db), which does not exist"]


def test_read_access_reads_an_existing_store(tmp_path):
    """access "read" opens an existing SQLite file and sees its records."""
    path = tmp_path / "records.db"
    with SqliteStore(str(path)) as store:
        submit(store)
    with open_store(load_settings({"STORE_URL": f"sqlite:///{path}"}).store_config(), access="read") as store:
        assert store.get_job(JOB_ID)["status"] == "pending"
