"""Job and profile records: the interface (``store``), the rules both backends share (``rules``,
``recovery``), every write once over two swap primitives (``transitions``), and the backends
(``sqlite``, ``mongo``). ``open_store`` picks the backend the settings name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.core.errors import ConfigError
from worker.voice.records.attempt import Attempt
from worker.voice.records.store import Claim, Clock, Store

if TYPE_CHECKING:
    from worker.settings import Settings

__all__ = ["Attempt", "Claim", "Clock", "Store", "open_store"]


def open_store(settings: Settings, *, mongo_client_factory: Callable[..., Any] | None = None,
               sleep: Callable[[float], None] | None = None, access: str = "create") -> Store:
    """The store the settings select: STORE_URL (SQLite) or MONGO_URI (MongoDB, connect-checked).

    ``access`` "existing" or "read" (read-only) never creates a SQLite file: a missing one is a
    ConfigError. MongoDB creates nothing on reads, so it ignores ``access``.
    """
    if settings.sqlite_path:
        from worker.voice.records.sqlite import CREATE, EXISTING, READ_ONLY, SqliteStore

        modes = {"create": CREATE, "existing": EXISTING, "read": READ_ONLY}
        path = settings.sqlite_path
        parent = os.path.dirname(path)
        if parent and access == "create":
            os.makedirs(parent, exist_ok=True)
        return SqliteStore(path, mode=modes[access])
    if settings.mongo_uri:
        from worker.voice.records.mongo import open_mongo_store

        return open_mongo_store(settings, client_factory=mongo_client_factory, sleep=sleep)
    raise ConfigError("MONGO_URI or STORE_URL is required: where job and profile records live")
