"""Connecting to MongoDB: a bounded ping check with linear back-off, then the store on top.

Kept apart from ``store_mongo`` (the record operations) so each stays small.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pymongo
import structlog
from pymongo.errors import ConfigurationError, PyMongoError

from worker.core.errors import ConfigError, StoreError
from worker.voice.store_mongo import MongoStore, close_quietly, translated

if TYPE_CHECKING:
    from worker.settings import Settings

log = structlog.get_logger(__name__)


def connect_mongo(uri: str, *, max_attempts: int = 7, retry_delay_s: float = 1.0,
                  client_factory: Callable[..., Any] = pymongo.MongoClient,
                  sleep: Callable[[float], None] = time.sleep) -> Any:
    """A client whose server answered ``ping``, or StoreError chained to the last failure.

    The delay grows linearly: after failed attempt n it waits ``retry_delay_s * n`` (1, 2, 3 … s by
    default, 21 s in all before the 7th and last attempt), which rides out a replica set election.
    """
    try:
        client = client_factory(uri, tz_aware=True, serverSelectionTimeoutMS=5000, socketTimeoutMS=30_000,
                                connectTimeoutMS=5000)
    except (ConfigurationError, ValueError) as exc:
        # An unusable URI (pymongo raises ValueError for some, e.g. a bad port) will not heal by
        # retrying; its text may hold credentials, so only the type is said.
        raise ConfigError(f"MONGO_URI is not a usable MongoDB URI ({type(exc).__name__})") from exc
    except PyMongoError as exc:
        raise StoreError(f"mongo client could not be created: {type(exc).__name__}") from exc
    last_exc: BaseException | None = None
    for attempt in range(1, max_attempts + 1):
        try:
            client.admin.command("ping")
            return client
        except PyMongoError as exc:
            last_exc = exc
            delay_s = retry_delay_s * attempt if attempt < max_attempts else 0.0
            log.warning("store.mongo_ping_failed", attempt=attempt, max_attempts=max_attempts,
                        error_type=type(exc).__name__, retry_in_s=delay_s)
            if delay_s > 0:
                sleep(delay_s)
    close_quietly(client)
    raise StoreError(f"MongoDB did not answer after {max_attempts} attempts: "
                     f"{type(last_exc).__name__}") from last_exc


def open_mongo_store(settings: Settings, *, client_factory: Callable[..., Any] | None = None,
                     sleep: Callable[[float], None] | None = None) -> MongoStore:
    client = connect_mongo(settings.mongo_uri or "", max_attempts=settings.mongo_connect_max_attempts,
                           retry_delay_s=settings.mongo_connect_retry_delay_s,
                           client_factory=client_factory or pymongo.MongoClient,
                           sleep=sleep or time.sleep)
    try:
        with translated("open"):
            db = client.get_default_database(settings.mongo_database)
        store = MongoStore(db, jobs_collection=settings.mongo_jobs_collection,
                           profiles_collection=settings.mongo_profiles_collection, client=client)
        store.ensure_indexes()
    except BaseException:
        close_quietly(client)
        raise
    return store
