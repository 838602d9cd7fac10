"""The evaluate stage's scorers tell good speech from bad (docs/trainer.md, "Evaluation", the discrimination table).

Inputs are made at test time: the job's recordings and a perfect clone are espeak-ng's ``en-us`` voice
(tests/make_dataset.py), another speaker is espeak-ng's ``en-us+f3``, and white noise and silence come from
numpy. Each is scored as if it were a model's output, by the same ``Scorers.score`` the stage uses.

    .venv/bin/python -m pytest -q tests/test_evaluate_scoring.py -s    # -s prints the table
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dataset import SENTENCES, make_dataset  # noqa: E402
from voice_trainers.dataset import load_clips  # noqa: E402
from voice_trainers.evaluate import split_reference  # noqa: E402
from voice_trainers.scoring import Scorers, Utterance  # noqa: E402
from voice_trainers.scoring.asr import error_rates, normalise  # noqa: E402
from voice_trainers.scoring.audio import sanity  # noqa: E402
from voice_trainers.scoring.similarity import centroid  # noqa: E402
from voice_trainers.sentences import held_out, languages  # noqa: E402

HELD_OUT = 4
NOISE_RMS = 0.1

# The bars proposed for the production profile's gate (docs/trainer.md, "Proposed gate"): every good row of
# the table clears them and every bad row fails at least one.
PROPOSED_PRODUCTION_GATE = {"min_speaker_similarity": 0.75, "max_cer": 0.75, "min_dnsmos_ovrl": 2.3,
                            "require_sanity": True}


def espeak_utterances(directory: Path, voice: str, texts: list[str]) -> list[Utterance]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for number, text in enumerate(texts):
        path = directory / f"{number}.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", "150", "-w", str(path), text], check=True, timeout=60)
        samples, rate_hz = soundfile.read(str(path), dtype="float32")
        out.append(Utterance(samples=samples, rate_hz=rate_hz, text=text))
    return out


def like(utterances: list[Utterance], make) -> list[Utterance]:
    """Utterances of the same lengths and texts whose samples ``make(n)`` returns."""
    return [Utterance(samples=make(len(u.samples)), rate_hz=u.rate_hz, text=u.text) for u in utterances]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Every kind of input scored: {row: (entry, transcripts)}."""
    root = tmp_path_factory.mktemp("discrimination")
    make_dataset(root / "dataset")
    clips = load_clips(root / "dataset", min_clip_s=0.5, max_clip_s=20.0, min_clips=4)
    scorers = Scorers("en-us")
    recordings = {}
    embeddings = {}
    for clip in clips:
        samples, rate_hz = soundfile.read(str(clip.wav_path), dtype="float32")
        recordings[clip.uid] = Utterance(samples=samples, rate_hz=rate_hz, text=clip.text)
        embeddings[clip.uid] = scorers.encoder.embed(recordings[clip.uid])
    speaker = centroid(list(embeddings.values()))
    held, rest = split_reference(clips, HELD_OUT)
    sentences = held_out("en-us", HELD_OUT)
    clone = espeak_utterances(root / "clone", "en-us", sentences)
    rng = np.random.default_rng(7)
    rows = {
        "own recordings (held out)": scorers.score([recordings[c.uid] for c in held],
                                                   centroid([embeddings[c.uid] for c in rest])),
        "same voice, held-out sentences": scorers.score(clone, speaker),
        "other voice (en-us+f3)": scorers.score(espeak_utterances(root / "f3", "en-us+f3", sentences), speaker),
        "white noise": scorers.score(like(clone, lambda n: (rng.standard_normal(n) * NOISE_RMS).astype(np.float32)),
                                     speaker),
        "silence": scorers.score(like(clone, lambda n: np.zeros(n, np.float32)), speaker),
    }
    print("\n| input | similarity | CER | WER | DNSMOS ovrl | sig | bak | sanity |")
    for name, (entry, heard) in rows.items():
        d = entry["dnsmos"]
        print(f"| {name} | {entry['speaker_similarity']:.2f} | {entry['cer']:.2f} | {entry['wer']:.2f} |"
              f" {d['ovrl']:.2f} | {d['sig']:.2f} | {d['bak']:.2f} |"
              f" {'ok' if entry['sanity']['ok'] else '; '.join(entry['sanity']['problems'])} |  heard: {heard}")
    return {name: entry for name, (entry, _heard) in rows.items()}


def test_the_speakers_own_voice_scores_higher_similarity_than_another_voice(table):
    other = table["other voice (en-us+f3)"]["speaker_similarity"]
    assert table["own recordings (held out)"]["speaker_similarity"] > other + 0.05
    assert table["same voice, held-out sentences"]["speaker_similarity"] > other + 0.05


def test_similarity_alone_does_not_catch_noise_dnsmos_and_cer_do(table):
    """White noise scores far below speech on DNSMOS and is not transcribed (CER at least 0.9)."""
    noise, speech = table["white noise"], table["same voice, held-out sentences"]
    assert noise["dnsmos"]["ovrl"] < speech["dnsmos"]["ovrl"] - 1.0
    assert noise["dnsmos"]["sig"] < speech["dnsmos"]["sig"] - 1.0
    assert noise["cer"] >= 0.9
    assert noise["cer"] > speech["cer"] + 0.3


def test_silence_fails_the_sanity_check(table):
    silence = table["silence"]
    assert not silence["sanity"]["ok"]
    assert any(p.startswith("silent") for p in silence["sanity"]["problems"])
    assert silence["sanity"]["rms_dbfs"] == -120.0
    assert silence["cer"] >= 0.9


def test_espeak_speech_is_transcribed_with_a_cer_far_below_noises(table):
    for name in ("own recordings (held out)", "same voice, held-out sentences"):
        assert table[name]["cer"] < 0.7, name
        assert table[name]["asr"].startswith("pocketsphinx ")
        assert table[name]["sanity"]["ok"], table[name]["sanity"]


def test_the_proposed_production_gate_passes_the_good_rows_and_fails_every_bad_one(table):
    gate = PROPOSED_PRODUCTION_GATE

    def passes(entry):
        return (entry["speaker_similarity"] >= gate["min_speaker_similarity"] and entry["cer"] <= gate["max_cer"]
                and entry["dnsmos"]["ovrl"] >= gate["min_dnsmos_ovrl"] and entry["sanity"]["ok"])

    assert passes(table["own recordings (held out)"])
    assert passes(table["same voice, held-out sentences"])
    for bad in ("other voice (en-us+f3)", "white noise", "silence"):
        assert not passes(table[bad]), bad


# --- the parts, on made-up arrays (fast) ---------------------------------------------------------------


def tone(seconds: float, amplitude: float, rate_hz: int = 16_000) -> np.ndarray:
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    return (amplitude * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def bursts(seconds: float, rate_hz: int = 16_000) -> np.ndarray:
    """Speech-like in level: a tone in syllable-long bursts (peak 0.5, some 8.6 dB over the RMS)."""
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    return (0.5 * np.sin(2 * np.pi * 220 * t) * np.abs(np.sin(2 * np.pi * 2 * t)) ** 4).astype(np.float32)


def test_sanity_passes_a_plausible_output_and_names_each_problem():
    text = "x" * 20  # 1.5 s for 20 characters: 0.075 s a character
    good = sanity([Utterance(bursts(1.5), 16_000, text)])
    assert good["ok"] and good["problems"] == [], good
    assert good["peak_dbfs"] == pytest.approx(20 * np.log10(0.5), abs=0.1)
    assert good["peak_dbfs"] - good["rms_dbfs"] > 8
    assert good["seconds_per_char"] == pytest.approx(0.075)
    steady = sanity([Utterance(tone(1.5, 0.3), 16_000, text)])
    assert steady["problems"] == ["not speech-like: peak only 3.0 dB over RMS (a buzz or a square wave; speech"
                                  " has 6 dB and more)"]
    assert steady["rms_dbfs"] == pytest.approx(20 * np.log10(0.3 / np.sqrt(2)), abs=0.1)
    clipped = sanity([Utterance(np.clip(bursts(1.5) * 8, -1, 1), 16_000, text)])
    assert not clipped["ok"] and clipped["clipped_fraction"] > 0.1
    assert [p for p in clipped["problems"] if p.startswith("clipped")]
    fast = sanity([Utterance(bursts(0.2), 16_000, text)])
    assert not fast["ok"] and fast["problems"][0].startswith("pace 0.010")
    slow = sanity([Utterance(bursts(8.0), 16_000, text)])
    assert not slow["ok"] and slow["problems"][0].startswith("pace 0.400")
    quiet = sanity([Utterance(bursts(1.5), 16_000, text), Utterance(np.zeros(24_000, np.float32), 16_000, text)])
    assert quiet["problems"] == ["1 of 2 utterance(s) silent or empty"]
    broken = np.full(24_000, np.nan, np.float32)
    assert "24000 non-finite sample(s)" in sanity([Utterance(broken, 16_000, text)])["problems"][0]
    assert sanity([Utterance(np.zeros(0, np.float32), 16_000, text)])["problems"] == ["no audio at all"]


def test_error_rates_compare_the_transcript_with_the_text_spoken():
    assert normalise("Well-known: 42 cats, isn't it?") == "well known forty two cats isn't it"
    assert error_rates(["The cat sat."], ["the cat sat"]) == (0.0, 0.0)
    cer, wer = error_rates(["The cat sat."], ["the hat sat"])
    assert cer == pytest.approx(1 / 11) and wer == pytest.approx(1 / 3)
    assert error_rates(["The cat sat."], [""]) == (1.0, 1.0)
    assert error_rates(["..."], ["anything"]) is None


def test_dnsmos_scores_an_empty_output_instead_of_looping_for_ever():
    from voice_trainers.scoring.dnsmos import Dnsmos

    scores = Dnsmos().score(Utterance(np.zeros(0, np.float32), 22_050, "nothing"))
    assert set(scores) == {"ovrl", "sig", "bak"} and all(1.0 <= v <= 5.0 for v in scores.values())


def test_english_is_recognised_and_other_languages_say_why_not():
    from voice_trainers.scoring.asr import Recogniser

    recogniser, why = Recogniser.for_voice("en-gb")
    assert recogniser is not None and why is None
    recogniser, why = Recogniser.for_voice("de")
    assert recogniser is None and "pocketsphinx ships an en-us model only" in why


def test_held_out_sentences_ship_per_language_and_are_none_of_the_training_texts():
    assert set(languages()) >= {"en", "de", "fr", "es", "it", "pt", "nl"}
    training = {normalise(s) for s in SENTENCES}
    for language in languages():
        sentences = held_out(language, 100)
        assert len(sentences) >= 8, language
        assert not any(re.search(r"\d", s) for s in sentences), language
        assert not training & {normalise(s) for s in sentences}, language
    assert held_out("en-us", 2) == held_out("en", 8)[:2]
    assert held_out("pt-br", 3) == held_out("pt", 3)
    assert held_out("cmn", 2) is None


def test_the_numpy_features_are_librosas_and_dnsmos_is_speechmoss():
    """scoring/features.py stands in for librosa (whose numba compile costs seconds per process): the same
    mel spectrograms for Resemblyzer's and DNSMOS's settings, and the same DNSMOS as speechmos's ``run``."""
    import librosa
    from speechmos import dnsmos as speechmos_dnsmos
    from voice_trainers.scoring.dnsmos import Dnsmos
    from voice_trainers.scoring.features import melspectrogram, power_to_db

    rng = np.random.default_rng(3)
    y = (rng.standard_normal(16_000 * 3) * 0.1).astype(np.float32) * bursts(3.0)
    for n_fft, hop, n_mels in ((400, 160, 40), (321, 160, 120)):
        ours = melspectrogram(y, 16_000, n_fft, hop, n_mels)
        theirs = librosa.feature.melspectrogram(y=y, sr=16_000, n_fft=n_fft, hop_length=hop, n_mels=n_mels)
        assert ours.shape == theirs.shape
        assert np.max(np.abs(ours - theirs)) <= 1e-5 * np.max(np.abs(theirs))
        assert np.max(np.abs(power_to_db(ours) - librosa.power_to_db(theirs, ref=np.max))) < 1e-3
    speech = np.concatenate([y, y, y, y]).astype(np.float64)  # 12 s: four windows
    theirs = speechmos_dnsmos.run(speech, 16_000)
    ours = Dnsmos().score(Utterance(speech, 16_000, "x"))
    assert ours == pytest.approx({"ovrl": theirs["ovrl_mos"], "sig": theirs["sig_mos"], "bak": theirs["bak_mos"]},
                                 abs=1e-4)


def test_the_reference_is_held_out_from_the_centroid_it_is_scored_against():
    from voice_trainers.dataset import Clip

    clips = [Clip(uid=f"u{i}", text="t", wav_path=Path(f"/{i}.wav"), duration_s=1.0, index=i) for i in range(9)]
    held, rest = split_reference(clips, 3)
    assert [c.uid for c in held] == ["u1", "u3", "u5"]
    assert [c.uid for c in rest] == ["u0", "u2", "u4", "u6", "u7", "u8"]
    held, rest = split_reference(clips[:2], 8)
    assert [c.uid for c in held] == ["u1"] and [c.uid for c in rest] == ["u0"]
