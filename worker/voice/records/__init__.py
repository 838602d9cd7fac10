"""Job and profile records: the interface (``store``), the rules both backends share (``rules``,
``recovery``), every write once over two swap primitives (``transitions``), and the backends
(``sqlite``, ``mongo``). ``open_store`` picks the backend the settings name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from worker.core.errors import ConfigError
from worker.voice.records.attempt import Attempt
from worker.voice.records.rules import ClaimOutcome
from worker.voice.records.store import Claim, Clock, Store

if TYPE_CHECKING:
    from worker.settings import Settings

__all__ = ["Access", "Attempt", "Claim", "ClaimOutcome", "Clock", "Store", "open_store", "sqlite_path_from_url"]


class Access(StrEnum):
    """What an opened store may do to a SQLite file: create it if missing, only write an existing one,
    or only read one."""

    CREATE = "create"
    EXISTING = "existing"
    READ = "read"


def sqlite_path_from_url(url: str) -> str:
    """``sqlite:///var/x.db`` -> ``var/x.db``; ``sqlite:////srv/x.db`` -> ``/srv/x.db``."""
    prefix = "sqlite:///"
    path = url[len(prefix):] if url.startswith(prefix) else ""
    if not path or "?" in path or "\x00" in path:
        raise ConfigError(f"STORE_URL must look like sqlite:///path/to/file.db, got {url!r}")
    return path


def open_store(settings: Settings, *, mongo_client_factory: Callable[..., Any] | None = None,
               sleep: Callable[[float], None] | None = None, access: Access | str = Access.CREATE) -> Store:
    """The store the settings select: STORE_URL (SQLite) or MONGO_URI (MongoDB, connect-checked).

    ``access`` EXISTING or READ (read-only) never creates a SQLite file: a missing one is a
    ConfigError. MongoDB creates nothing on reads, so it ignores ``access``.
    """
    if settings.store_url:
        from worker.voice.records.sqlite import CREATE, EXISTING, READ_ONLY, SqliteStore

        access = Access(access)
        modes = {Access.CREATE: CREATE, Access.EXISTING: EXISTING, Access.READ: READ_ONLY}
        path = sqlite_path_from_url(settings.store_url)
        parent = os.path.dirname(path)
        if parent and access is Access.CREATE:
            os.makedirs(parent, exist_ok=True)
        return SqliteStore(path, mode=modes[access])
    if settings.mongo_uri:
        from worker.voice.records.mongo import open_mongo_store

        return open_mongo_store(settings, client_factory=mongo_client_factory, sleep=sleep)
    raise ConfigError("MONGO_URI or STORE_URL is required: where job and profile records live")
