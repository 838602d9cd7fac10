"""What the loop and the heartbeat need from a queue: ``Queue``, a protocol, and the ``Message`` it hands out.

``Worker`` (``worker.core.loop``) and ``Lease`` (``worker.core.lease``) take any ``Queue``; nothing in
them names a broker. Two implement it, in the way dramatiq's ``Broker`` has its brokers:

    worker.core.queue.Queue        the SQS adapter (its other methods serve submit, the reconciler
                                   and the DLQ tools, never the loop)
    worker.core.testing.MemoryQueue  the same contract in memory, timed by a ``FakeClock``

The contract each method keeps, whichever queue implements it:

- ``receive`` takes at most one message and makes it invisible for ``visibility_timeout_s`` from its
  receipt (the lease starts with the receipt); None when no message came within ``wait_s``.
- ``extend`` (the heartbeat's renewal) and ``set_visibility`` *reset* the message's visibility to
  ``timeout_s`` from now, never add to it; ``release`` makes it visible at once.
- ``delete`` removes it for good; ``dead_letter`` copies its body with why it failed to the dead-letter
  queue and answers whether it did (False: there is none); the loop deletes only after True.
- A receipt that no longer holds the message is refused with ``LeaseLost``; any other failure of the
  broker, after its own retries, is a ``QueueError``. Nothing else leaves a method.

tests/core/test_broker.py holds both implementations to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from worker.core.errors import WorkerError


@dataclass(frozen=True)
class Message:
    """One received message. ``received_at_s`` is on the monotonic clock of the receiving process."""

    message_id: str
    receipt_handle: str = field(repr=False)
    body: str = field(repr=False)
    receive_count: int
    received_at_s: float
    attributes: dict[str, str] = field(default_factory=dict, repr=False)
    message_attributes: dict[str, Any] = field(default_factory=dict, repr=False)


@runtime_checkable
class Queue(Protocol):
    """The queue the loop and the heartbeat use: exactly the calls they make (see the module docstring)."""

    def receive(self, *, wait_s: int, visibility_timeout_s: int) -> Message | None: ...

    def extend(self, message: Message, timeout_s: int) -> None: ...

    def set_visibility(self, message: Message, timeout_s: int) -> None: ...

    def release(self, message: Message) -> None: ...

    def delete(self, message: Message) -> None: ...

    def dead_letter(self, message: Message, error: WorkerError) -> bool: ...
