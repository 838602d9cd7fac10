"""Naturalness: DNSMOS P.835 (overall, signal, background) from the ONNX model speechmos 0.0.1.1 ships
(``dnsmos_models/sig_bak_ovr.onnx``, MIT), run with onnxruntime here. ``model_v8.onnx`` beside it is
DNSMOS's P.808 figure, which the report does not keep, so it is not run.

speechmos's own ``dnsmos.run`` is not used, for two reasons: it computes its features with librosa, whose
first import compiles numba kernels for 10-25 s of CPU in every fresh process; and it loops for ever on an
empty array (it doubles the audio until it is 9 s long). This is its algorithm: windows of 9.01 s every
second, the raw P.835 outputs mapped through DNSMOS's published polynomials, the mean over the windows;
with one change for speed: an output shorter than 9.01 s is repeated to 9.01 s and scored as one window
(speechmos doubles it and scores every window of the doubled audio, the same sound shifted; on espeak-ng
sentences the figures differ from speechmos's by 0.1 at most). An output shorter than half a second is
padded with silence to half a second (what it would sound like).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from voice_trainers.scoring.audio import SCORER_RATE_HZ, Utterance, to_scorer_rate

INPUT_S = 9.01
MIN_SAMPLES = SCORER_RATE_HZ // 2
# DNSMOS's calibration of the raw outputs (speechmos.dnsmos.DNSMOS.get_polyfit_val, not personalised).
_OVRL = np.poly1d([-0.06766283, 1.11546468, 0.04602535])
_SIG = np.poly1d([-0.08397278, 1.22083953, 0.0052439])
_BAK = np.poly1d([-0.13166888, 1.60915514, -0.39604546])


def model_dir() -> Path:
    """speechmos's model folder, found without importing speechmos (which imports librosa)."""
    spec = importlib.util.find_spec("speechmos")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("speechmos is not installed: DNSMOS's models come from its wheel")
    return Path(next(iter(spec.submodule_search_locations))) / "dnsmos_models"


class Dnsmos:
    def __init__(self, threads: int | None = None) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        models = model_dir()
        providers = ["CPUExecutionProvider"]
        self._p835 = onnxruntime.InferenceSession(str(models / "sig_bak_ovr.onnx"), options, providers=providers)

    def score(self, utterance: Utterance) -> dict[str, float]:
        audio = to_scorer_rate(utterance.samples, utterance.rate_hz)
        if len(audio) < MIN_SAMPLES:
            audio = np.concatenate([audio, np.zeros(MIN_SAMPLES - len(audio), np.float32)])
        needed = int(INPUT_S * SCORER_RATE_HZ)
        if len(audio) < needed:
            audio = np.tile(audio, -(-needed // len(audio)))[:needed]
        hops = int(np.floor(len(audio) / SCORER_RATE_HZ) - INPUT_S) + 1
        ovrl, sig, bak = [], [], []
        for hop in range(hops):
            segment = audio[hop * SCORER_RATE_HZ : hop * SCORER_RATE_HZ + needed]
            if len(segment) < needed:
                continue
            raw_sig, raw_bak, raw_ovrl = self._p835.run(None, {"input_1": segment[np.newaxis].astype(np.float32)})[0][0]
            sig.append(_SIG(raw_sig))
            bak.append(_BAK(raw_bak))
            ovrl.append(_OVRL(raw_ovrl))
        return {"ovrl": float(np.mean(ovrl)), "sig": float(np.mean(sig)), "bak": float(np.mean(bak))}

    def mean(self, utterances: list[Utterance]) -> dict[str, float]:
        scores = [self.score(u) for u in utterances]
        return {key: round(float(np.mean([s[key] for s in scores])), 4) for key in ("ovrl", "sig", "bak")}
