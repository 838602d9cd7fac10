"""The attempt's record lease: renewed on each tick, lost when it cannot be renewed before it lapses."""

from __future__ import annotations

import pytest

from tests.support import FlakyStore
from worker.core.errors import LeaseLost, Stopped
from worker.core.stop import StopSignal
from worker.core.testing import FakeClock
from worker.voice.records.attempt import Attempt, StoreLease
from worker.voice.records.errors import StaleWrite, StoreError


class Renewals:
    """The one store call a StoreLease makes: renew_lease, answering whether a cancel was requested."""

    cancel_requested = False

    def renew_lease(self, job_id, token, lease_s, gpu_seconds=None):
        return self.cancel_requested


def flaky_store() -> FlakyStore:
    return FlakyStore(Renewals())


def make(lease_s=300.0, margin_s=60.0):
    store, clock, stop = flaky_store(), FakeClock(), StopSignal()
    attempt = Attempt(store, "j", "p", "t", lease_s)
    return StoreLease(attempt, stop, margin_s=margin_s, clock=clock), store, clock, stop


def test_store_outage_shorter_than_the_lease_is_retried():
    """A failed renewal well before the record lease lapses is an ordinary, retried failure."""
    lease, store, clock, _ = make()
    store.fail(StoreError("down"))
    clock.now += 200  # 100 s of lease left, more than one tick (60 s)
    with pytest.raises(StoreError):
        lease.renew()


def test_store_outage_reaching_the_lease_end_loses_the_lease():
    """Renewals failing until less than one tick of record lease is left lose the lease."""
    lease, store, clock, _ = make()
    store.fail(StoreError("down"))
    clock.now += 250  # 50 s left: the next tick would come after another worker could claim
    with pytest.raises(LeaseLost):
        lease.renew()


def test_a_successful_renewal_moves_the_lapse_forward():
    """Each successful renewal restarts the record lease from when it was sent."""
    lease, store, clock, _ = make()
    clock.now += 200
    lease.renew()
    store.fail(StoreError("down"))
    clock.now += 200  # 100 s after the last success: still fine
    with pytest.raises(StoreError):
        lease.renew()


def test_a_refused_renewal_is_a_lost_lease_and_a_cancel_flag_stops_the_work():
    """A renewal matching no record loses the lease; cancelRequested sets the stop signal."""
    lease, store, _, stop = make()
    store.wrapped.cancel_requested = True
    lease.renew()
    assert stop.reason == Stopped.CANCELLED
    store.fail(StaleWrite("token replaced"))
    with pytest.raises(LeaseLost):
        lease.renew()


def test_no_renewal_after_the_end():
    """After end() (the attempt's final write) renewals do nothing."""
    lease, store, _, _ = make()
    lease.end()
    lease.renew()
    assert store.calls == []


def test_the_local_lease_check_passes_while_renewals_keep_the_record_lease_ahead():
    """ensure_live (the check before each upload part) passes from a renewal until one margin before the lease ends."""
    lease, store, clock, _ = make()
    clock.now += 200
    lease.ensure_live()
    lease.renew()
    clock.now += 239  # 61 s of the renewed lease left, more than the 60 s margin
    lease.ensure_live()


def test_the_local_lease_check_fails_once_the_record_lease_may_lapse():
    """Without a successful renewal, ensure_live raises LeaseLost one margin before the record lease ends."""
    lease, store, clock, _ = make()
    store.fail(StoreError("down"))
    clock.now += 240
    with pytest.raises(LeaseLost):
        lease.ensure_live()


def test_the_local_lease_deadline_counts_from_when_the_claim_was_sent():
    """A claim that took a while (its profile stamp) leaves less local lease: the deadline starts at the send."""
    store, clock, stop = flaky_store(), FakeClock(), StopSignal()
    sent_s = clock.now
    clock.now += 100  # the claim's second swap was slow
    lease = StoreLease(Attempt(store, "j", "p", "t", 300.0), stop, margin_s=60.0, clock=clock, claim_sent_s=sent_s)
    clock.now += 141  # 241 s after the send: under one margin left of the store's lease
    with pytest.raises(LeaseLost):
        lease.ensure_live()


def test_a_cancel_flag_is_ignored_once_an_earlier_attempt_began_the_commit():
    """With honour_cancel off (the commit is under way), a renewal that reads cancelRequested stops nothing."""
    store, clock, stop = flaky_store(), FakeClock(), StopSignal()
    lease = StoreLease(Attempt(store, "j", "p", "t", 300.0), stop, clock=clock, honour_cancel=False)
    store.wrapped.cancel_requested = True
    lease.renew()
    assert not stop.is_set()
