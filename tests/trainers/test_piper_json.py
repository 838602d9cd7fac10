"""The Piper voice config written next to the ONNX: Coqui's vocabulary, Piper's special symbols."""

from __future__ import annotations

import json

import pytest
from voice_trainers.piper_json import piper_voice_config

VOCAB = ["<PAD>", "<BLNK>", "a", "b", "ə", " ", "!", ","]


def config(vocab=VOCAB, blank="<BLNK>"):
    return piper_voice_config(vocab=vocab, blank=blank, espeak_voice="en-us", language="en",
                              sample_rate_hz=22050, hop_length=256, noise_scale=0.667, length_scale=1.0,
                              noise_w=0.8)


def test_each_phoneme_maps_to_its_coqui_token_id():
    """Every one-character entry of the vocabulary keeps its index as its Piper id."""
    ids = config()["phoneme_id_map"]
    assert {k: v for k, v in ids.items() if k not in "_^$"} == {"a": [2], "b": [3], "ə": [4], " ": [5], "!": [6], ",": [7]}


def test_piper_pad_is_the_blank_and_bos_eos_add_nothing():
    """Piper's "_" is Coqui's blank id and "^"/"$" are empty, so Piper builds Coqui's blank-interspersed sequence."""
    ids = config()["phoneme_id_map"]
    assert ids["_"] == [1] and ids["^"] == [] and ids["$"] == []
    assert "<PAD>" not in ids and "<BLNK>" not in ids


def test_piper_builds_the_same_ids_as_coqui():
    """Piper's rule (BOS, PAD, each phoneme then PAD, EOS) over this map gives Coqui's add_blank sequence."""
    ids = config()["phoneme_id_map"]
    phonemes = ["a", "ə", " ", "b", "!"]
    piper = ids["^"] + ids["_"] + [i for p in phonemes for i in ids[p] + ids["_"]] + ids["$"]
    coqui = [1]
    for p in phonemes:
        coqui += [VOCAB.index(p), 1]
    assert piper == coqui


def test_the_config_has_what_piper_reads():
    """Sample rate, espeak voice, one speaker, the symbol count and the inference scales, as JSON."""
    data = json.loads(json.dumps(config(), ensure_ascii=False))
    assert data["audio"]["sample_rate"] == 22050
    assert data["espeak"] == {"voice": "en-us"}
    assert data["phoneme_type"] == "espeak"
    assert data["num_symbols"] == len(VOCAB)
    assert data["num_speakers"] == 1 and data["speaker_id_map"] == {}
    assert data["inference"] == {"noise_scale": 0.667, "length_scale": 1.0, "noise_w": 0.8}
    assert data["hop_length"] == 256
    assert data["language"] == {"code": "en"}


@pytest.mark.parametrize(("vocab", "blank"), [
    (["<BLNK>", "_", "a"], "<BLNK>"),
    (["<BLNK>", "a", "a"], "<BLNK>"),
    (["<PAD>", "a"], "<BLNK>"),
])
def test_a_vocabulary_piper_cannot_represent_is_refused(vocab, blank):
    """A symbol colliding with Piper's specials, a repeated symbol or a missing blank raises."""
    with pytest.raises(ValueError):
        config(vocab, blank)


def test_a_config_with_bos_eos_and_no_blanks_maps_them_to_coqui_s_ids():
    """BOS/EOS map to Coqui's ids when the model adds them; without blanks Piper's pad adds no id."""
    vocab = ["<PAD>", "<EOS>", "<BOS>", "a", "b"]
    ids = piper_voice_config(vocab=vocab, blank=None, add_blank=False, bos="<BOS>", eos="<EOS>",
                             espeak_voice="en-us", language="en", sample_rate_hz=22050, hop_length=256,
                             noise_scale=0.667, length_scale=1.0, noise_w=0.8)["phoneme_id_map"]
    assert ids["^"] == [2] and ids["$"] == [1] and ids["_"] == []
    piper = ids["^"] + ids["_"] + [i for p in ["a", "b"] for i in ids[p] + ids["_"]] + ids["$"]
    assert piper == [2, 3, 4, 1]


def test_the_normaliser_is_named_for_the_product():
    """model.onnx.json names the text normaliser and its version, which the product runs before Piper."""
    data = piper_voice_config(vocab=VOCAB, blank="<BLNK>", espeak_voice="de", language="de-AT", sample_rate_hz=22050,
                              hop_length=256, noise_scale=0.667, length_scale=1.0, noise_w=0.8, normaliser_version=1)
    assert data["text_normaliser"] == {"module": "voice_trainers.normalise", "version": 1, "voice": "de"}
