"""The two training profiles."""

from __future__ import annotations

from voice_trainers.profiles import PROFILES


def test_the_ci_profile_is_a_tiny_single_speaker_vits():
    """ci: one discriminator period, 16-frame segments, 6 global steps with a checkpoint every 2."""
    ci = PROFILES["ci"]
    assert ci.model_args["periods_multi_period_discriminator"] == [2]
    assert ci.model_args["spec_segment_size"] == 16
    assert (ci.total_steps, ci.checkpoint_every_steps) == (6, 2)
    assert "use_speaker_embedding" not in ci.model_args


def test_every_profile_checkpoints_within_its_run_and_keeps_a_bounded_number():
    """Each profile writes at least one checkpoint before its end and keeps one to a few of them."""
    for profile in PROFILES.values():
        assert 0 < profile.checkpoint_every_steps < profile.total_steps
        assert 1 <= profile.keep_checkpoints <= 3
        assert profile.min_clips >= 1 and 0 < profile.min_clip_s < profile.max_clip_s


def test_profiles_fingerprint_differently():
    """The profile is part of a checkpoint's fingerprint, so ci checkpoints never resume a production run."""
    assert PROFILES["ci"].fingerprint_fields() != PROFILES["production"].fingerprint_fields()
