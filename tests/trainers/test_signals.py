"""SIGUSR1 asks for a checkpoint and training goes on; SIGTERM ends the stage now."""

from __future__ import annotations

import signal

import pytest
from voice_trainers.signals import EXIT_TERMINATED, StageSignals, Terminated


@pytest.fixture
def handlers_restored():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def test_a_checkpoint_signal_is_taken_once(handlers_restored):
    """Two SIGUSR1 before a step boundary ask for one checkpoint; the next boundary asks for none."""
    signals = StageSignals().install()
    assert signals.take_checkpoint_request() is False
    signal.raise_signal(signal.SIGUSR1)
    signal.raise_signal(signal.SIGUSR1)
    assert signals.take_checkpoint_request() is True
    assert signals.take_checkpoint_request() is False


def test_sigterm_interrupts_at_once(handlers_restored):
    """SIGTERM raises in the main thread instead of waiting for the step to end."""
    StageSignals().install()
    with pytest.raises(Terminated):
        signal.raise_signal(signal.SIGTERM)


def test_the_terminated_exit_code_is_retried_not_permanent():
    """143 is not the permanent 65, so a stopped stage's job is retried."""
    assert EXIT_TERMINATED == 143


def test_sigterm_is_not_swallowed_by_a_broad_except(handlers_restored):
    """Code that catches Exception (a fallback to an older checkpoint, say) still lets SIGTERM through."""
    StageSignals().install()
    with pytest.raises(Terminated):
        try:
            signal.raise_signal(signal.SIGTERM)
        except Exception:
            pass
