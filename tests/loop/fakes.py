"""Test doubles around real (moto-backed) boto3 clients: record calls, inject faults."""

from __future__ import annotations

import threading
import time

from botocore.exceptions import ClientError


def client_error(code: str, message: str = "injected", operation: str = "Op") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, operation)


class FaultyClient:
    """Delegates to a boto3 client, recording each call; ``faults[op](kwargs)`` may return an error to raise."""

    def __init__(self, client):
        self._client = client
        self.calls: list[tuple[str, dict, str, float]] = []
        self.faults: dict = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if name.startswith("_") or name == "meta" or not callable(attr):
            return attr

        def call(**kwargs):
            with self._lock:
                self.calls.append((name, kwargs, threading.current_thread().name, time.monotonic()))
            fault = self.faults.get(name)
            if fault is not None:
                exc = fault(kwargs)
                if exc is not None:
                    raise exc
            return attr(**kwargs)

        return call

    def ops(self) -> list[str]:
        return [c[0] for c in self.calls]
