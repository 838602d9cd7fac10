"""The Store contract, part five: leases are stamped and judged on the store's clock, never a worker's.

``clock`` is the store's clock; a worker whose own clock is off is this process with
``worker.voice.records.rules.utc_now`` (the host clock every rule would otherwise reach for) moved.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.voice.records.conftest import JOB_ID, PROFILE_ID, submit
from worker.voice.records import rules

SHORT_LEASE_S = 10.0  # the small test of the issue: a skew past (lease - heartbeat) used to steal


def skew_this_workers_clock(monkeypatch, clock, skew_s: float) -> None:
    """This process's wall clock now reads the store's clock plus ``skew_s``."""
    monkeypatch.setattr(rules, "utc_now", lambda: clock.now + timedelta(seconds=skew_s))


@pytest.mark.parametrize("skew_s", [30, 300])
def test_a_skewed_worker_cannot_take_a_live_lease(store, clock, monkeypatch, skew_s):
    """A worker whose clock runs ahead by more than the lease is refused a job whose lease is live elsewhere."""
    submit(store)
    assert store.claim(JOB_ID, owner="w1", token="t1", lease_s=SHORT_LEASE_S).outcome == "claimed"
    clock.advance(1)
    skew_this_workers_clock(monkeypatch, clock, skew_s)
    refused = store.claim(JOB_ID, owner="w2", token="t2", lease_s=SHORT_LEASE_S)
    assert refused.outcome == "held" and refused.now == clock.now
    assert store.get_job(JOB_ID)["lease"]["token"] == "t1"
    assert store.find_stale() == []


@pytest.mark.parametrize("skew_s", [30, 300])
def test_a_crashed_skewed_workers_lease_ends_after_the_real_lease_length(store, clock, monkeypatch, skew_s):
    """A skewed worker's lease is stamped on the store's clock: it lapses after the lease length, not the skew."""
    submit(store)
    skew_this_workers_clock(monkeypatch, clock, skew_s)
    assert store.claim(JOB_ID, owner="w1", token="t1", lease_s=SHORT_LEASE_S).outcome == "claimed"
    job = store.get_job(JOB_ID)
    assert job["lease"]["expiresAt"] == clock.now + timedelta(seconds=SHORT_LEASE_S)
    assert job["heartbeatAt"] == clock.now and job["history"][-1]["start"] == clock.now
    monkeypatch.undo()
    clock.advance(SHORT_LEASE_S)  # w1 crashed: nobody renews
    assert [stale["_id"] for stale in store.find_stale()] == [JOB_ID]
    assert store.claim(JOB_ID, owner="w2", token="t2", lease_s=SHORT_LEASE_S).outcome == "claimed"


def test_a_skewed_holders_renewals_and_writes_are_stamped_on_the_store_clock(store, clock, monkeypatch):
    """Renewal, progress, the profile stamp and the final history entry all carry the store's time."""
    submit(store)
    skew_this_workers_clock(monkeypatch, clock, 300)
    attempt = store.claim(JOB_ID, owner="w1", token="t1", lease_s=SHORT_LEASE_S).attempt
    clock.advance(5)
    attempt.renew()
    attempt.progress("train_full", 50)
    job = store.get_job(JOB_ID)
    assert job["lease"]["expiresAt"] == clock.now + timedelta(seconds=SHORT_LEASE_S)
    assert job["heartbeatAt"] == clock.now and job["progress"]["updatedAt"] == clock.now
    assert store.get_profile(PROFILE_ID)["updatedAt"] == clock.now - timedelta(seconds=5)
    attempt.release()
    assert store.get_job(JOB_ID)["history"][-1]["end"] == clock.now


def test_the_store_tells_its_clock_and_a_hosts_offset_from_it(store, clock):
    """now() is the store's clock; clock_offset_s says how far a host's clock is behind it."""
    assert store.now() == clock.now
    assert store.clock_offset_s(lambda: clock.now - timedelta(seconds=30)) == 30.0
    assert store.clock_offset_s(lambda: clock.now + timedelta(seconds=12.5)) == -12.5
