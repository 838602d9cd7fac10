"""The ``model.onnx.json`` Piper reads next to an ONNX exported from a Coqui VITS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Piper's own symbols: PAD goes between phonemes, BOS/EOS around the sentence.
PIPER_PAD = "_"
PIPER_BOS = "^"
PIPER_EOS = "$"


def piper_voice_config(
    *,
    vocab: Sequence[str],
    blank: str,
    espeak_voice: str,
    language: str,
    sample_rate_hz: int,
    hop_length: int,
    noise_scale: float,
    length_scale: float,
    noise_w: float,
) -> dict[str, Any]:
    """Piper's voice config for Coqui's vocabulary, so Piper's phoneme ids equal Coqui's token ids.

    Coqui (``add_blank``) puts its blank token between the phonemes and at both ends and adds no
    BOS/EOS; Piper emits BOS, PAD, then each phoneme followed by PAD, then EOS. Mapping PAD to the
    blank id and BOS/EOS to no id at all gives the same sequence.
    """
    if blank not in vocab:
        raise ValueError(f"blank token {blank!r} is not in the vocabulary")
    phoneme_id_map: dict[str, list[int]] = {}
    for index, symbol in enumerate(vocab):
        # Multi-character entries (<PAD>, <BLNK>, ...) are Coqui's special tokens, never a phoneme.
        if len(symbol) != 1:
            continue
        if symbol in (PIPER_PAD, PIPER_BOS, PIPER_EOS):
            raise ValueError(f"vocabulary symbol {symbol!r} collides with Piper's special symbols")
        if symbol in phoneme_id_map:
            raise ValueError(f"vocabulary symbol {symbol!r} appears twice")
        phoneme_id_map[symbol] = [index]
    phoneme_id_map[PIPER_PAD] = [list(vocab).index(blank)]
    phoneme_id_map[PIPER_BOS] = []
    phoneme_id_map[PIPER_EOS] = []
    return {
        "audio": {"sample_rate": sample_rate_hz, "quality": "custom"},
        "espeak": {"voice": espeak_voice},
        "language": {"code": language},
        "phoneme_type": "espeak",
        "num_symbols": len(vocab),
        "num_speakers": 1,
        "speaker_id_map": {},
        "hop_length": hop_length,
        "inference": {"noise_scale": noise_scale, "length_scale": length_scale, "noise_w": noise_w},
        "phoneme_id_map": phoneme_id_map,
    }
