"""Job and profile records: the interface (``store``), the rules both backends share (``rules``,
``recovery``), every write once over a backend's three primitives, a read and two swaps
(``transitions``), and the backends (``sqlite``, ``mongo``). ``open_store`` picks the backend the
settings name (``store_config``: the values it takes, re-exported here).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from worker.core.errors import ConfigError
from worker.voice.records.attempt import Attempt
from worker.voice.records.rules import ClaimOutcome
from worker.voice.records.store import Claim, Clock, Store
from worker.voice.records.store_config import Access, MongoConfig, StoreConfig

__all__ = ["Access", "Attempt", "Claim", "ClaimOutcome", "Clock", "MongoConfig", "Store", "StoreConfig", "open_store"]


def open_store(config: StoreConfig, *, mongo_client_factory: Callable[..., Any] | None = None,
               sleep: Callable[[float], None] | None = None, access: Access | str = Access.CREATE) -> Store:
    """The store the settings select: STORE_URL (SQLite) or MONGO_URI (MongoDB, connect-checked).

    ``access`` EXISTING or READ (read-only) never creates a SQLite file: a missing one is a
    ConfigError. MongoDB creates nothing on reads, so it ignores ``access``.
    """
    if config.sqlite_path:
        from worker.voice.records.sqlite import CREATE, EXISTING, READ_ONLY, SqliteStore

        access = Access(access)
        modes = {Access.CREATE: CREATE, Access.EXISTING: EXISTING, Access.READ: READ_ONLY}
        path = config.sqlite_path
        parent = os.path.dirname(path)
        if parent and access is Access.CREATE:
            os.makedirs(parent, exist_ok=True)
        return SqliteStore(path, mode=modes[access])
    if config.mongo:
        from worker.voice.records.mongo import open_mongo_store

        return open_mongo_store(config.mongo, client_factory=mongo_client_factory, sleep=sleep)
    raise ConfigError("MONGO_URI or STORE_URL is required: where job and profile records live")
