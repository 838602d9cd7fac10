"""Speaker similarity: Resemblyzer 0.1.4's GE2E encoder (inside the wheel), the cosine between an output's
d-vector and the centroid of the job's own recordings."""

from __future__ import annotations

import numpy as np

from voice_trainers.scoring.audio import SCORER_RATE_HZ, Utterance, to_scorer_rate
from voice_trainers.scoring.features import melspectrogram


def _mel_frames(wav: np.ndarray) -> np.ndarray:
    """Resemblyzer's ``audio.wav_to_mel_spectrogram`` (25 ms windows, 10 ms steps, 40 mels, not log), in
    numpy: librosa's would cost a numba compile per process (scoring/features.py)."""
    return melspectrogram(wav, SCORER_RATE_HZ, 400, 160, 40).astype(np.float32).T


class SpeakerEncoder:
    def __init__(self) -> None:
        from resemblyzer import VoiceEncoder, audio

        # The encoder looks the function up on the module at each call.
        audio.wav_to_mel_spectrogram = _mel_frames
        self._encoder = VoiceEncoder(device="cpu", verbose=False)

    def embed(self, utterance: Utterance) -> np.ndarray:
        """The unit d-vector of an utterance: Resemblyzer's preprocessing (volume normalised, long silences
        cut by its VAD); an output with nothing the VAD keeps is embedded as it is, so silence still gets a
        measured score (and fails the sanity check)."""
        from resemblyzer import preprocess_wav

        audio = to_scorer_rate(utterance.samples, utterance.rate_hz)
        # Already at 16 kHz: no source rate, so Resemblyzer does not resample (with librosa) again.
        wav = preprocess_wav(audio) if np.any(audio) else np.zeros(0, np.float32)
        if len(wav) == 0:
            wav = audio if len(audio) else np.zeros(SCORER_RATE_HZ, np.float32)
        return unit(self._encoder.embed_utterance(wav))


def unit(vector: np.ndarray) -> np.ndarray:
    vector = np.asarray(vector, dtype=np.float64)
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


def centroid(embeddings: list[np.ndarray]) -> np.ndarray:
    """The unit mean of unit d-vectors: the speaker, as the job's recordings show them."""
    return unit(np.mean(np.stack(embeddings), axis=0))


def mean_cosine(embeddings: list[np.ndarray], target: np.ndarray) -> float:
    return float(np.mean([float(np.dot(unit(e), unit(target))) for e in embeddings]))
