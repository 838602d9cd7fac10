"""Intelligibility: pocketsphinx 5.1.1's en-us model (acoustic model, dictionary and language model ship
inside the wheel) transcribes, jiwer 4.0 scores CER and WER against the sentence that was synthesised."""

from __future__ import annotations

import re
from importlib import metadata

import numpy as np

from voice_trainers.scoring.audio import SCORER_RATE_HZ, Utterance, to_scorer_rate

_NOT_A_WORD = re.compile(r"[^a-z']+")
_DIGITS = re.compile(r"\d+")
MAX_HMM_PER_FRAME = 2000


def normalise(text: str) -> str:
    """Lower case, digits as words, every other mark a space: what a recogniser's output looks like."""
    from num2words import num2words

    text = _DIGITS.sub(lambda m: " " + num2words(int(m.group()), lang="en") + " ", text.lower())
    return " ".join(_NOT_A_WORD.sub(" ", text.replace("-", " ")).split()).strip("'")


class Recogniser:
    """pocketsphinx for English; ``None`` from ``for_voice`` with the reason for other languages."""

    def __init__(self) -> None:
        from pocketsphinx import Decoder

        # The default config is the wheel's en-us model (pocketsphinx.get_model_path()): no download. At most
        # 2,000 active HMMs a frame (the default is 30,000): 2.4 times faster, the same CER on the en list.
        self._decoder = Decoder(samprate=SCORER_RATE_HZ, loglevel="FATAL", maxhmmpf=MAX_HMM_PER_FRAME)
        self.name = f"pocketsphinx {metadata.version('pocketsphinx')} en-us"

    @staticmethod
    def for_voice(voice: str) -> tuple[Recogniser | None, str | None]:
        if voice.split("-", 1)[0] != "en":
            return None, (f"no speech recogniser for espeak-ng voice {voice!r}: pocketsphinx ships an en-us"
                          " model only")
        return Recogniser(), None

    def transcribe(self, utterance: Utterance) -> str:
        pcm = (to_scorer_rate(utterance.samples, utterance.rate_hz) * 32767).astype(np.int16).tobytes()
        self._decoder.start_utt()
        self._decoder.process_raw(pcm, full_utt=True)
        self._decoder.end_utt()
        hyp = self._decoder.hyp()
        return hyp.hypstr if hyp is not None else ""


def error_rates(texts: list[str], transcripts: list[str]) -> tuple[float, float] | None:
    """(CER, WER) over all the utterances together, against the texts that were spoken; None when no
    text has a word left after normalisation."""
    import jiwer

    pairs = [(normalise(t), normalise(h)) for t, h in zip(texts, transcripts, strict=True)]
    pairs = [(t, h) for t, h in pairs if t]
    if not pairs:
        return None
    references = [t for t, _ in pairs]
    hypotheses = [h for _, h in pairs]
    return float(jiwer.cer(references, hypotheses)), float(jiwer.wer(references, hypotheses))
