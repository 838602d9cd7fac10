"""``embed``: data preparation (voice_trainers.prepare) and the speaker's Resemblyzer centroid.

One stage for both because the speaker filter of preparation and ``speakers.pth`` are the same d-vectors:
Resemblyzer's GE2E encoder (256-d, inside the wheel) runs once per clip. The stage writes the prepared
dataset and its ``report.json`` into ``--prepared`` (the training and evaluate stages' ``--dataset``)
and ``speakers.pth`` (voice_trainers.speakers) into ``--out``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from importlib import metadata

import numpy as np

from voice_trainers.coqui import import_torch
from voice_trainers.dataset import SAMPLE_RATE_HZ, read_recordings
from voice_trainers.device import select_device
from voice_trainers.prepare import Judges, TooLittleSpeech, prepare
from voice_trainers.profiles import Profile
from voice_trainers.speakers import SPEAKERS_NAME, speaker_file, write_speakers


def phoneme_counter(profile: Profile, voice: str) -> Callable[[str], int]:
    """The spoken phonemes of a text as the full stage's tokenizer makes them (Coqui's espeak-ng
    phonemizer and vocabulary, built from the same config): punctuation and spaces do not count."""
    from TTS.tts.utils.text.tokenizer import TTSTokenizer

    from voice_trainers.coqui import build_config

    tokenizer, _ = TTSTokenizer.init_from_config(build_config(profile, voice, phoneme_cache=None))
    characters = tokenizer.characters
    not_spoken = set(characters.punctuations) | {" "}

    def count(text: str) -> int:
        symbols = (characters.id_to_char(i) for i in tokenizer.text_to_ids(text))
        return sum(1 for s in symbols if len(s) == 1 and s not in not_spoken)

    return count


def judges_for(profile: Profile, voice: str) -> tuple[Judges, str]:
    from voice_trainers.scoring import Utterance
    from voice_trainers.scoring.asr import Recogniser, error_rates
    from voice_trainers.scoring.similarity import SpeakerEncoder

    encoder = SpeakerEncoder()
    recogniser, why_not = Recogniser.for_voice(voice)
    if recogniser is None:
        print(f"NOTE no transcript check: {why_not}", flush=True)

    def transcribe(audio: np.ndarray, text: str) -> tuple[float | None, str]:
        assert recogniser is not None
        heard = recogniser.transcribe(Utterance(samples=audio, rate_hz=SAMPLE_RATE_HZ, text=text))
        rates = error_rates([text], [heard])
        return (rates[0] if rates is not None else None), heard

    judges = Judges(phonemes=phoneme_counter(profile, voice),
                    transcribe=transcribe if recogniser is not None else None,
                    embed=lambda audio: encoder.embed(Utterance(samples=audio, rate_hz=SAMPLE_RATE_HZ, text="")))
    return judges, f"resemblyzer {metadata.version('resemblyzer')} GE2E"


def run_embed(args: argparse.Namespace, profile: Profile, voice: str) -> None:
    # Before torch and the encoders load (seconds of a job's time): a dataset that cannot be read, or whose
    # recordings are shorter in all than the profile's minimum of speech, is refused at once, since
    # preparation only trims and leaves out.
    recordings = read_recordings(args.dataset)
    recorded_s = sum(clip.duration_s for clip in recordings)
    if recorded_s < profile.min_speech_s:
        raise TooLittleSpeech(f"too little usable speech: {recorded_s:.1f} s recorded in all,"
                              f" at least {profile.min_speech_s:g} s needed")
    torch = import_torch()
    # The encoder runs on the CPU (a few ms a clip), but the stage keeps its contract: a host without the
    # device asked for is not this job's fault (exit 70), and is found before any work.
    select_device(torch, profile.device)
    started_s = time.process_time()
    judges, encoder = judges_for(profile, voice)
    outcome, centre, cosines = prepare(recordings, args.prepared, profile, judges,
                                       lambda percent: print(f"PROGRESS {percent:.1f}", flush=True))
    kept = {piece.uid for piece in outcome.kept}
    write_speakers(args.out / SPEAKERS_NAME, speaker_file(centre, cosines, kept, encoder))
    print(f"wrote {SPEAKERS_NAME}: the centroid of {len(kept)} clip(s), {len(cosines)} cosine(s)"
          f" ({time.process_time() - started_s:.1f} CPU-s)", flush=True)
