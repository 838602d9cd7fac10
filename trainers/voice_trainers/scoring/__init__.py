"""The evaluate stage's scorers (docs/trainer.md, "Evaluation"): speaker similarity (Resemblyzer),
intelligibility (pocketsphinx + jiwer), naturalness (DNSMOS, speechmos's ONNX models) and a sanity check.

Every model is loaded from its wheel; nothing is downloaded. ``Scorers.score`` turns a list of
utterances into one entry of ``quality.json``'s ``models``.
"""

from __future__ import annotations

import numpy as np

from voice_trainers.scoring.asr import Recogniser, error_rates
from voice_trainers.scoring.audio import Utterance, sanity
from voice_trainers.scoring.dnsmos import Dnsmos
from voice_trainers.scoring.similarity import SpeakerEncoder, mean_cosine

__all__ = ["Scorers", "Utterance"]


class Scorers:
    """The three models, loaded once: the encoder, the recogniser (None for a language it cannot hear)
    and DNSMOS."""

    def __init__(self, voice: str) -> None:
        self.encoder = SpeakerEncoder()
        self.recogniser, self.asr_unavailable = Recogniser.for_voice(voice)
        self.dnsmos = Dnsmos()

    def score(self, utterances: list[Utterance], speaker: np.ndarray,
              embeddings: list[np.ndarray] | None = None) -> tuple[dict, list[str]]:
        """One model's entry (similarity to ``speaker``, a unit centroid; CER/WER; DNSMOS; sanity) and the
        recogniser's transcripts (for the log: the report's schema has no place for them). ``embeddings``:
        the utterances' d-vectors when they are known already."""
        if embeddings is None:
            embeddings = [self.encoder.embed(u) for u in utterances]
        similarity = mean_cosine(embeddings, speaker)
        cer = wer = None
        asr_name, unavailable = None, self.asr_unavailable
        transcripts: list[str] = []
        if self.recogniser is not None:
            transcripts = [self.recogniser.transcribe(u) for u in utterances]
            rates = error_rates([u.text for u in utterances], transcripts)
            if rates is None:
                unavailable = "no text with a word to score against"
            else:
                cer, wer = (round(r, 4) for r in rates)
                asr_name = self.recogniser.name
        entry = {
            "speaker_similarity": round(similarity, 4),
            "cer": cer,
            "wer": wer,
            "asr": asr_name,
            "asr_unavailable": unavailable if cer is None else None,
            "dnsmos": self.dnsmos.mean(utterances),
            "sanity": sanity(utterances),
        }
        return entry, transcripts
