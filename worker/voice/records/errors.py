"""The records' errors, on the core's retryable branch (``worker.core.errors``): what a store raises.

    RetryableError (core)   retry: the message comes back after the backoff
    ├── StoreError          the records store is unavailable (pymongo's and sqlite3's errors, translated
    │                       at the backend's boundary)
    └── StaleWrite          a fenced update matched no record (not ours any more, or gone): never
                            acknowledge

The heartbeat's record-lease renewal turns a ``StaleWrite`` into the core's ``LeaseLost``
(``worker.voice.records.attempt.StoreLease``). The job's own errors, decided from what the records
hold, are ``worker.voice.errors``.
"""

from __future__ import annotations

from worker.core.errors import RetryableError


class StoreError(RetryableError):
    pass


class StaleWrite(RetryableError):
    pass
