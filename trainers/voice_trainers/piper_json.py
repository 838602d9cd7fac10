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
    blank: str | None,
    espeak_voice: str,
    language: str,
    sample_rate_hz: int,
    hop_length: int,
    noise_scale: float,
    length_scale: float,
    noise_w: float,
    add_blank: bool = True,
    bos: str | None = None,
    eos: str | None = None,
    normaliser_version: int | None = None,
) -> dict[str, Any]:
    """Piper's voice config for Coqui's vocabulary, so Piper's phoneme ids equal Coqui's token ids.

    Coqui (``add_blank``) puts its blank token between the phonemes and at both ends, and its BOS/EOS
    tokens around them when the config asks (``bos``/``eos`` given); Piper emits BOS, PAD, then each
    phoneme followed by PAD, then EOS. Mapping PAD to the blank id (no id without blanks) and BOS/EOS to
    Coqui's (no id without them) gives the same sequence (``voice_trainers.tokenizer``).
    """
    specials = {"blank": blank if add_blank else None, "bos": bos, "eos": eos}
    for name, token in specials.items():
        if token is not None and token not in vocab:
            raise ValueError(f"{name} token {token!r} is not in the vocabulary")
    if add_blank and blank is None:
        raise ValueError("add_blank needs a blank token")
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
    ids = list(vocab)
    phoneme_id_map[PIPER_PAD] = [ids.index(blank)] if add_blank and blank is not None else []
    phoneme_id_map[PIPER_BOS] = [ids.index(bos)] if bos is not None else []
    phoneme_id_map[PIPER_EOS] = [ids.index(eos)] if eos is not None else []
    extra: dict[str, Any] = {}
    if normaliser_version is not None:
        # Piper reads raw text: the product must run the same normaliser first (docs/trainer.md).
        extra["text_normaliser"] = {"module": "voice_trainers.normalise", "version": normaliser_version,
                                    "voice": espeak_voice}
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
        **extra,
    }
