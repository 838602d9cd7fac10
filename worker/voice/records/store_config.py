"""The records' config values: which backend ``open_store`` opens (``StoreConfig``, with MongoDB's
``MongoConfig``) and what an opened SQLite store may do to its file (``Access``). Built by the settings;
the backends read them, so they stand apart from ``open_store`` (worker/voice/records/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Access(StrEnum):
    """What an opened store may do to a SQLite file: create it if missing, only write an existing one,
    or only read one."""

    CREATE = "create"
    EXISTING = "existing"
    READ = "read"


@dataclass(frozen=True, slots=True)
class MongoConfig:
    """MONGO_URI and the MONGO_* settings that go with it (their defaults live in the settings)."""

    uri: str = field(repr=False)  # may hold a password
    database: str  # used when the URI names no database
    jobs_collection: str
    profiles_collection: str
    connect_max_attempts: int
    connect_retry_delay_s: float


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Which backend holds the records: a SQLite file (STORE_URL, parsed) or MongoDB; the settings
    refuse both at once."""

    sqlite_path: str | None = None
    mongo: MongoConfig | None = None
