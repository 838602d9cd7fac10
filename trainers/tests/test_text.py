"""The text side: the light voice is fed the ids it was trained on, and only languages that survive are taken."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from piper.config import PiperConfig
from piper.voice import PiperVoice
from voice_trainers.coqui import NOISE_SCALE_DP, build_config
from voice_trainers.languages import ESPEAK_VOICES, WORKER_TABLE, default_vocabulary, espeak_voice, worker_table
from voice_trainers.normalise import normalise
from voice_trainers.profiles import PROFILES
from voice_trainers.tokenizer import (
    PiperTokenizer,
    UnsupportedLanguage,
    check_language,
    dropped_symbols,
    language_problem,
)

REPO = Path(__file__).resolve().parents[2]
# Numbers, currency, dates, abbreviations, ";", "—", quotes and ellipses: where Coqui's phonemes and Piper's
# used to part (issue #30, item 1).
SENTENCES = {
    "en-us": [
        "I paid $1,250.50 for it.",
        "On 3/14/2024 the shop opened at 9.",
        "Dr. Smith lives on Main St. near St. Paul's.",
        "It was cold; we stayed in.",
        "The answer — if there is one — can wait.",
        "She said \"never\" and 'always'.",
        "Well... I suppose so.",
        "Wait… what? Really!",
        "In the 1990s, 50% of the 21st floor cost £3.",
        "For four more doors, or more.",
    ],
    "de": [
        "Am 14.3.2024 zahlte Dr. Meier 1.250,50 € für die Hauptstr. 5; das war teuer.",
        "Er sagte „nein“ — und ging… z. B. nach Hause.",
    ],
    "fr": ["Le 14/03/2024, M. Dupont a payé 1 250,50 € ; c'est « cher »… non ?"],
}


def tokenizer_for(voice: str, config=None) -> PiperTokenizer:
    from TTS.tts.utils.text.tokenizer import TTSTokenizer

    coqui, _ = TTSTokenizer.init_from_config(config or build_config(PROFILES["ci"], voice, phoneme_cache=None))
    return PiperTokenizer.replacing(coqui, voice)


def piper_for(tokenizer: PiperTokenizer) -> PiperVoice:
    """Piper as a user runs the light voice: the model.onnx.json the light stage writes for a model of this
    tokenizer (``light_voice_config``), through Piper's own config reader (no ONNX needed for the ids)."""
    from voice_trainers.light import light_voice_config

    # The config writer reads only the model's tokenizer and config.
    model = SimpleNamespace(tokenizer=tokenizer,
                            config=build_config(PROFILES["ci"], tokenizer.voice, phoneme_cache=None))
    config = light_voice_config(model, tokenizer.voice, "x")
    return PiperVoice(session=None, config=PiperConfig.from_dict(json.loads(json.dumps(config))))  # type: ignore[arg-type]


def inference_ids(piper: PiperVoice, text: str) -> list[list[int]]:
    """What PiperVoice.synthesize feeds the ONNX, one sequence per sentence, for normalised text."""
    return [piper.phonemes_to_ids(sentence) for sentence in piper.phonemize(normalise(text, piper.config.espeak_voice))
            if sentence]


@pytest.mark.parametrize(("voice", "text"), [(v, t) for v, texts in SENTENCES.items() for t in texts])
def test_the_training_ids_are_the_ids_piper_feeds_at_inference(voice, text):
    """For every sentence, the ids the full model trains on are exactly those Piper feeds the light voice."""
    tokenizer = tokenizer_for(voice)
    sequences = inference_ids(piper_for(tokenizer), text)
    training = tokenizer.text_to_ids(text)
    assert sequences and all(sequences)
    assert training == list(itertools.chain.from_iterable(sequences))
    assert not tokenizer.not_found_characters


def test_the_ids_agree_with_bos_and_eos_and_without_blanks():
    """A base whose config adds BOS/EOS and no blanks gets a Piper map that reproduces that too."""
    config = build_config(PROFILES["ci"], "en-us", phoneme_cache=None)
    config.add_blank, config.enable_eos_bos_chars = False, True
    tokenizer = tokenizer_for("en-us", config)
    assert tokenizer.use_eos_bos and not tokenizer.add_blank
    text = "Dr. Lee paid $5; then — nothing..."
    assert tokenizer.text_to_ids(text) == list(itertools.chain.from_iterable(inference_ids(piper_for(tokenizer), text)))


def test_a_semicolon_and_a_tone_digit_are_symbols_of_the_vocabulary():
    """The from-scratch vocabulary is Piper's: ';', tone digits and combining marks all have ids."""
    vocabulary = tokenizer_for("en-us").characters.vocab
    for symbol in [";", "1", "5", "\u0303", "\u032a", "ɔ", "ɚ"]:
        assert symbol in vocabulary


def test_tones_are_lost_by_a_vocabulary_without_digits_and_kept_by_piper_s():
    """Vietnamese tones are espeak-ng digits: Coqui's IPAPhonemes drops them, the Piper vocabulary keeps them."""
    from TTS.tts.utils.text.characters import IPAPhonemes

    text = "Xin chào các bạn."
    assert {"2", "6"} <= set(dropped_symbols(text, "vi", IPAPhonemes().vocab))
    assert dropped_symbols(text, "vi", tokenizer_for("vi").characters.vocab) == []


def test_a_base_vocabulary_that_drops_a_language_s_phonemes_is_refused_before_training():
    """French with a (base's) vocabulary lacking the nasal tilde exits 65 naming the symbol."""
    from TTS.tts.utils.text.characters import IPAPhonemes

    config = build_config(PROFILES["ci"], "fr", phoneme_cache=None)
    config.characters = IPAPhonemes(characters=IPAPhonemes().characters.replace("\u0303", "")).to_config()
    tokenizer = tokenizer_for("fr", config)
    with pytest.raises(UnsupportedLanguage, match="U\\+0303"):
        check_language(tokenizer)
    check_language(tokenizer_for("fr"))


def test_a_language_without_held_out_sentences_or_normalisation_is_not_supported():
    """Vietnamese keeps its tones in the vocabulary but has neither: it is refused, and says why."""
    problem = language_problem("vi", default_vocabulary())
    assert problem is not None and "normalisation" in problem


def test_every_accepted_language_keeps_every_phoneme_of_its_sentences():
    """Each language the worker accepts round-trips all its held-out sentences through the vocabulary."""
    from voice_trainers.sentences import held_out

    table = json.loads((REPO / WORKER_TABLE).read_text(encoding="utf-8"))
    vocabulary = default_vocabulary()
    assert {"en-us", "en", "de", "fr", "es", "it", "nl", "pt", "pt-br"} <= set(table["supported"])
    for voice in table["supported"]:
        for sentence in held_out(voice, 1_000) or []:
            assert dropped_symbols(sentence, voice, vocabulary) == [], (voice, sentence)
        assert tokenizer_for(voice).text_to_ids((held_out(voice, 1) or [""])[0])


def test_the_worker_s_language_table_is_what_the_trainers_compute():
    """worker/voice/languages.json has not drifted (regenerate: python -m voice_trainers.languages --write)."""
    shipped = json.loads((REPO / WORKER_TABLE).read_text(encoding="utf-8"))
    assert shipped == worker_table(default_vocabulary())


def test_the_worker_resolves_every_code_to_the_trainers_voice():
    """The worker's code-to-voice resolution over its table agrees with the stages' for every kind of code."""
    spec = importlib.util.spec_from_file_location("worker_languages", REPO / "worker/voice/languages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    data = json.loads((REPO / WORKER_TABLE).read_text(encoding="utf-8"))
    table = module.LanguageTable(espeak_voices=frozenset(data["espeakVoices"]), aliases=data["aliases"],
                                 primary_defaults=data["primaryDefaults"], supported=tuple(data["supported"]))
    codes = set(ESPEAK_VOICES) | set(data["aliases"]) | set(data["primaryDefaults"])
    codes |= {f"{code}-XX" for code in list(codes)} | {c.upper().replace("-", "_") for c in codes}
    codes |= {"", "xx", "klingon", "en us", "tlh-Latn", "zh_Hans", "de-AT", "en-029"}
    for code in sorted(codes):
        assert table.voice(code) == espeak_voice(code), code


def test_the_light_voice_s_duration_noise_is_the_full_model_s():
    """model.onnx.json's noise settings are read from the full model's config: the two speak alike."""
    from TTS.tts.models.vits import Vits
    from voice_trainers.light import light_voice_config
    from voice_trainers.tokenizer import install

    model = Vits(build_config(PROFILES["ci"], "en-us", phoneme_cache=None))
    install(model, "en-us")
    piper = light_voice_config(model, "en-us", "en")
    args = model.config.model_args
    assert piper["inference"] == {"noise_scale": args.inference_noise_scale, "length_scale": args.length_scale,
                                  "noise_w": args.inference_noise_scale_dp}
    assert args.inference_noise_scale_dp == NOISE_SCALE_DP == 0.8
    assert piper["text_normaliser"]["voice"] == "en-us"


def test_the_light_stage_loads_the_full_model_strictly(tmp_path):
    """A model.pth missing one generator tensor is refused, not filled with random weights."""
    import torch
    from TTS.tts.models.vits import Vits
    from voice_trainers.coqui import portable_config
    from voice_trainers.light import load_full_model

    config = build_config(PROFILES["ci"], "en-us", phoneme_cache=None)
    config.model_args.init_discriminator = False
    model = Vits(config)
    (tmp_path / "config.json").write_text(json.dumps(portable_config(model.config)), encoding="utf-8")
    state = model.state_dict()
    torch.save({"model": state, "step": 1}, tmp_path / "model.pth")
    loaded = load_full_model(tmp_path / "model.pth")
    assert isinstance(loaded.tokenizer, PiperTokenizer)
    state.pop(next(iter(state)))
    torch.save({"model": state, "step": 1}, tmp_path / "model.pth")
    with pytest.raises(RuntimeError, match="does not fit"):
        load_full_model(tmp_path / "model.pth")


def test_the_full_stage_refuses_a_language_it_cannot_carry_before_training(tmp_path):
    """As the worker runs it: Vietnamese (no normaliser, no held-out sentences) exits 65 before any step."""
    import os
    import subprocess

    from make_dataset import make_dataset

    make_dataset(tmp_path / "dataset", clips=6)
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", "HOME": os.environ.get("HOME", "/root")}
    result = subprocess.run(
        [sys.executable, "-m", "voice_trainers", "full", "--dataset", str(tmp_path / "dataset"), "--out",
         str(tmp_path / "out"), "--checkpoints", str(tmp_path / "ck"), "--language", "vi", "--profile", "ci"],
        capture_output=True, text=True, env=env, cwd="/", stdin=subprocess.DEVNULL, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 65, log[-3000:]
    assert "language not supported by this model: no text normalisation for espeak-ng voice 'vi'" in \
        log.strip().splitlines()[-1]
    assert "step 1/" not in log


def test_the_evaluate_stage_normalises_what_it_gives_piper(monkeypatch):
    """The light model is scored on normalised sentences, as the product must feed Piper."""
    import numpy as np
    import piper
    from voice_trainers.evaluate import synthesise_light

    heard: list[str] = []

    class Recording:
        config = SimpleNamespace(espeak_voice="en-us", sample_rate=22050)

        def synthesize(self, text):
            heard.append(text)
            yield SimpleNamespace(audio_float_array=np.zeros(10, np.float32))

    monkeypatch.setattr(piper.PiperVoice, "load", staticmethod(lambda path: Recording()))
    synthesise_light(Path("model.onnx"), ["Dr. Lee came at 10:30 on 3/14/2024."])
    assert heard == ["Doctor Lee came at ten thirty on March fourteenth twenty twenty-four."]


def test_a_symbol_outside_the_vocabulary_is_logged_in_one_short_line(caplog):
    """A long text meeting a symbol the (base's) vocabulary lacks logs the symbol once, not the phonemes."""
    from TTS.tts.utils.text.characters import IPAPhonemes

    config = build_config(PROFILES["ci"], "en-us", phoneme_cache=None)
    config.characters = IPAPhonemes(characters=IPAPhonemes().characters.replace("ɚ", "")).to_config()
    tokenizer = tokenizer_for("en-us", config)
    with caplog.at_level("WARNING"):
        ids = tokenizer.text_to_ids("The water under the bridge was never better. " * 40)
    assert ids and tokenizer.not_found_characters == ["ɚ"]
    assert [record.getMessage() for record in caplog.records] == [
        "symbol 'ɚ' (U+025A) is not in the vocabulary: left out"]
