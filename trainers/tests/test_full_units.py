"""The full stage's own decisions, in-process: which clips it trains on, and what it resumes from.

    cd trainers && .venv/bin/python -m pytest -q tests/test_full_units.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import voice_trainers
from voice_trainers.checkpoints import checkpoint_path, list_checkpoints, software_versions
from voice_trainers.coqui import build_config
from voice_trainers.dataset import Clip, UnusableData
from voice_trainers.full import (
    MAX_IDS_PER_CLIP,
    phoneme_id_limit,
    restore,
    save_checkpoint,
    training_fingerprint,
    usable_samples,
)
from voice_trainers.profiles import PROFILES

# The texts: each within the worker's 2,000 characters, each thousands of ids once espeak-ng spells it out.
DATES = "2024-01-01 " * 150
NUMBERS = ("1,2,3.4e5 $10 … 2024-01-01 " * 100)[:1600]
HAN = "漢" * 2000
# Sentences espeak-ng speaks at 150 words a minute in these many seconds (tests/make_dataset.py's first six).
SPOKEN = [
    ("The quick brown fox jumps over the lazy dog.", 3.44),
    ("A voice model learns to speak from a few recordings.", 3.54),
    ("Please call Stella and ask her to bring these things with her.", 3.93),
    ("Six spoons of fresh snow peas, five thick slabs of blue cheese.", 4.76),
    ("We also need a small plastic snake and a big toy frog for the kids.", 4.86),
    ("She can scoop these things into three red bags.", 3.26),
]


def tokenizer(voice: str):
    """The stage's tokenizer: the vocabulary Vits builds from the config, fed by the normaliser and Piper's
    phonemizer (voice_trainers.tokenizer), a blank between ids."""
    from TTS.tts.utils.text.tokenizer import TTSTokenizer
    from voice_trainers.tokenizer import PiperTokenizer

    built, _ = TTSTokenizer.init_from_config(build_config(PROFILES["ci"], voice, phoneme_cache=None))
    return PiperTokenizer.replacing(built, voice)


def clips(texts_and_durations: list[tuple[str, float]]) -> list[Clip]:
    return [Clip(uid=f"utt{i:05d}", text=text, wav_path=Path(f"/data/wavs/utt{i:05d}.wav"), duration_s=duration,
                 index=i) for i, (text, duration) in enumerate(texts_and_durations)]


@pytest.fixture(scope="module")
def english():
    return tokenizer("en-us")


def test_a_transcript_espeak_spells_out_at_length_is_left_out_with_its_reason(english, capsys, caplog):
    """Dates and numbers far longer in phonemes than their clip can say are left out by index; speech is kept."""
    dataset = clips([(DATES, 3.44), (NUMBERS, 3.54), *SPOKEN[2:]])
    samples = usable_samples(Path("/data"), dataset, english, min_clips=4)
    # A symbol outside the vocabulary is logged in one short line, never with the whole phoneme string.
    assert all(len(record.getMessage()) < 200 for record in caplog.records)
    assert [s["audio_unique_name"] for s in samples] == [f"#wavs/utt{i:05d}" for i in range(2, 6)]
    out = capsys.readouterr().out
    assert ("left out 2 clip(s) after phonemising:"
            " clip 0 (utt00000): 8689 phoneme ids for 3.4 s of audio, more than the 394 that fit it;"
            " clip 1 (utt00001): 8897 phoneme ids for 3.5 s of audio, more than the 404 that fit it\n") in out


def test_too_few_clips_left_is_unusable_data_after_the_reasons_are_printed(english, capsys):
    """With a clip left out for its length and one for phonemising to nothing, 3 of 5 are too few for 4."""
    dataset = clips([(DATES, 3.44), ("?!", 3.54), *SPOKEN[2:5]])
    with pytest.raises(UnusableData, match="^3 clips whose text phonemises to speech that fits their audio,"
                                           " at least 4 needed$"):
        usable_samples(Path("/data"), dataset, english, min_clips=4)
    out = capsys.readouterr().out
    assert "clip 0 (utt00000): 8689 phoneme ids" in out
    assert "clip 1 (utt00001): its text phonemises to nothing" in out


def test_conversational_speech_fits_up_to_the_longest_clip(english):
    """Six spoken sentences in one 23.8 s clip, and each on its own, are within the bound."""
    together = " ".join(text for text, _ in SPOKEN), sum(duration for _, duration in SPOKEN)
    dataset = clips([together, *SPOKEN])
    assert len(usable_samples(Path("/data"), dataset, english, min_clips=len(dataset))) == len(dataset)


def test_a_long_clip_is_capped_whatever_its_duration():
    """The bound grows with the duration but never past the cap that bounds the attention's memory."""
    assert phoneme_id_limit(0.5) < phoneme_id_limit(3.0) < phoneme_id_limit(10.0) <= MAX_IDS_PER_CLIP
    assert phoneme_id_limit(30.0) == phoneme_id_limit(1800.0) == MAX_IDS_PER_CLIP


def test_a_cjk_text_is_left_out_and_a_mandarin_sentence_kept(capsys):
    """2,000 Han characters in the longest ci clip are left out; a spoken Mandarin sentence of 6.6 s is kept."""
    mandarin = tokenizer("cmn")
    dataset = clips([(HAN, 20.0), ("我们今天去公园散步，天气非常好。", 6.6)])
    samples = usable_samples(Path("/data"), dataset, mandarin, min_clips=1)
    assert [s["audio_unique_name"] for s in samples] == ["#wavs/utt00001"]
    assert f"more than the {MAX_IDS_PER_CLIP} that fit it" in capsys.readouterr().out


def test_the_fingerprint_follows_the_coqui_and_adapter_versions():
    """A checkpoint of another Coqui or adapter version has another fingerprint, so it is not resumed."""
    from importlib import metadata

    versions = software_versions()
    assert versions == {"coqui-tts": metadata.version("coqui-tts"), "voice-trainers": voice_trainers.__version__}
    base = training_fingerprint("d", PROFILES["ci"], "en-us", versions)
    assert training_fingerprint("d", PROFILES["ci"], "en-us", dict(versions)) == base
    assert training_fingerprint("d", PROFILES["ci"], "en-us", {**versions, "coqui-tts": "0.29.0"}) != base
    assert training_fingerprint("d", PROFILES["ci"], "en-us", {**versions, "voice-trainers": "9.9.9"}) != base


FINGERPRINT = "f" * 64


class Run:
    """A tiny stand-in for the stage's training state: a model, two optimizers and their schedulers."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        self.optimizers = [torch.optim.AdamW(self.model[0].parameters(), lr=0.01),
                           torch.optim.AdamW(self.model[1].parameters(), lr=0.01)]
        self.schedulers = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9) for o in self.optimizers]

    def train(self, steps: int) -> None:
        for _ in range(steps):
            loss = self.model(torch.ones(2, 3)).square().sum()
            for optimizer in self.optimizers:
                optimizer.zero_grad()
            loss.backward()
            for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
                optimizer.step()
                scheduler.step()

    def save(self, checkpoints: Path, step: int) -> None:
        save_checkpoint(checkpoints, step, FINGERPRINT, self.model, self.optimizers, self.schedulers, keep=5,
                        torch=torch)

    def restore(self, checkpoints: Path) -> int:
        return restore(checkpoints, FINGERPRINT, self.model, self.optimizers, self.schedulers, torch)

    def state(self) -> tuple:
        return ({k: v.clone() for k, v in self.model.state_dict().items()},
                [repr(o.state_dict()) for o in self.optimizers], [repr(s.state_dict()) for s in self.schedulers])


def same_state(a: tuple, b: tuple) -> bool:
    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1:] == b[1:]


def spoil(path: Path, change) -> None:
    state = torch.load(path, weights_only=True)
    torch.save(change(state), path)


SPOILS = {
    "not a dict": lambda state: [state],
    "a key missing": lambda state: {k: v for k, v in state.items() if k != "schedulers"},
    # The first layer's weights fit and load_state_dict copies them before it raises on the second.
    "a parameter reshaped": lambda state: {**state, "model": {**state["model"], "1.weight": torch.zeros(5, 4)}},
    "a parameter renamed": lambda state: {**state, "model": {("1.kernel" if k == "1.weight" else k): v
                                                             for k, v in state["model"].items()}},
    # The first optimizer's state loads, the second's groups do not fit.
    "an optimizer that does not fit": lambda state: {**state, "optimizers": [
        state["optimizers"][0], {**state["optimizers"][1], "param_groups": []}]},
}


@pytest.mark.parametrize("how", list(SPOILS))
def test_a_checkpoint_that_does_not_restore_starts_training_over_from_the_untouched_state(tmp_path, capsys, how):
    """A checkpoint that loads but does not fit is removed and leaves the run exactly as a run from scratch."""
    trained = Run()
    trained.train(3)
    trained.save(tmp_path, 3)
    spoil(checkpoint_path(tmp_path, 3), SPOILS[how])
    fresh = Run()
    scratch = fresh.state()
    assert fresh.restore(tmp_path) == 0
    assert same_state(fresh.state(), scratch)
    assert list_checkpoints(tmp_path) == []
    out = capsys.readouterr().out
    assert "checkpoint step-00000003.pt cannot be restored (" in out and "training from scratch" in out


def test_an_older_checkpoint_that_fits_is_restored_after_a_newer_that_does_not(tmp_path, capsys):
    """The newest checkpoint holds no dict: the one before it resumes the run, whole."""
    trained = Run()
    trained.train(2)
    trained.save(tmp_path, 2)
    at_step_2 = trained.state()
    trained.train(2)
    trained.save(tmp_path, 4)
    spoil(checkpoint_path(tmp_path, 4), SPOILS["not a dict"])
    resumed = Run()
    assert resumed.restore(tmp_path) == 2
    assert same_state(resumed.state(), at_step_2)
    assert "Model restored from step 2 (step-00000002.pt)" in capsys.readouterr().out
