"""The training tokenizer: Piper's own phonemizer, so the light voice hears at inference the ids it was trained on.

Piper (``PiperVoice.synthesize``) phonemises a text with its bundled espeak-ng, clause by clause, splits it
into sentences and feeds the ONNX one sentence at a time: ``^ _ p1 _ p2 _ … pn _ $`` through the voice's
``phoneme_id_map``. This tokenizer phonemises with the same code (``PiperVoice.phonemize``) and encodes each
sentence with Coqui's vocabulary, its blank between the symbols and at both ends (and BOS/EOS when the
config asks for them); a text of several sentences is the sentences' ids one after the other, as Piper's own
trainer builds them. ``piper_json`` writes the map that turns Piper's sequence into exactly these ids.

Imports Coqui and piper (GPL-3.0, in the trainers' process only): call it from a stage, never from the worker.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any

from piper.config import PhonemeType, PiperConfig
from piper.phoneme_ids import DEFAULT_PHONEME_ID_MAP
from piper.voice import PiperVoice
from TTS.tts.utils.text import phonemizers
from TTS.tts.utils.text.phonemizers.base import BasePhonemizer
from TTS.tts.utils.text.tokenizer import TTSTokenizer

from voice_trainers.dataset import UnusableData
from voice_trainers.normalise import normalise, rules_for
from voice_trainers.piper_json import PIPER_BOS, PIPER_EOS, PIPER_PAD
from voice_trainers.sentences import held_out

log = logging.getLogger(__name__)
# The config's ``phonemizer``: Coqui builds it with the model, for any voice Piper's espeak-ng has (Coqui's
# own "espeak" backend takes Debian's voice names only, and would phonemise differently anyway).
PHONEMIZER_NAME = "piper_espeak"


def piper_symbols() -> list[str]:
    """The phonemes and punctuation of Piper's standard voices (its default id map), in that map's order.

    Single code points only: Piper decomposes espeak-ng's output (NFD) into code points, so tone digits,
    combining marks (nasal ``̃``, dental ``̪``) and ``;`` are all symbols; its diphthong entries are used
    only by voices that merge vowel clusters, which these are not.
    """
    return [symbol for symbol in DEFAULT_PHONEME_ID_MAP
            if len(symbol) == 1 and symbol not in (PIPER_PAD, PIPER_BOS, PIPER_EOS)]


def _phonemizer(voice: str) -> PiperVoice:
    """A PiperVoice without a model: its ``phonemize`` is the code ``synthesize`` runs first."""
    config = PiperConfig(num_symbols=0, num_speakers=1, sample_rate=0, espeak_voice=voice, phoneme_id_map={},
                         phoneme_type=PhonemeType.ESPEAK)
    return PiperVoice(session=None, config=config)  # type: ignore[arg-type,unused-ignore]  # no ONNX needed


def sentence_phonemes(text: str, voice: str) -> list[list[str]]:
    """Piper's phonemes of ``text`` (already normalised), one list per sentence, as ``synthesize`` gets them."""
    return [sentence for sentence in _phonemizer(voice).phonemize(text) if sentence]


def dropped_symbols(text: str, voice: str, vocabulary: Iterable[str]) -> list[str]:
    """The symbols of ``text``'s phonemes (normalised first) that ``vocabulary`` lacks, in order of appearance."""
    known = set(vocabulary)
    missing: dict[str, None] = {}
    for sentence in sentence_phonemes(normalise(text, voice), voice):
        for symbol in sentence:
            if symbol not in known:
                missing[symbol] = None
    return list(missing)


class PiperEspeak(BasePhonemizer):
    """Piper's phonemizer behind Coqui's phonemizer interface (the sentences joined, as the tokenizer trains)."""

    def __init__(self, language: str = "en-us", punctuations: str = ";:,.!?", keep_puncs: bool = True) -> None:
        super().__init__(language, punctuations=punctuations, keep_puncs=keep_puncs)

    @staticmethod
    def name() -> str:
        return PHONEMIZER_NAME

    @classmethod
    def is_available(cls) -> bool:
        return True

    def version(self) -> str:
        from importlib import metadata

        return metadata.version("piper-tts")

    @staticmethod
    def supported_languages() -> dict[str, str]:
        # Which languages a job may use is voice_trainers.languages' decision, not the phonemizer's.
        return {}

    def is_supported_language(self, language: str) -> bool:
        # Any voice name Piper's espeak-ng takes (en-gb-x-rp, say), not only the list the worker knows.
        return True

    def phonemize(self, text: str, separator: str = "", language: str | None = None) -> str:
        voice = language or self.language
        return "".join(itertools.chain.from_iterable(sentence_phonemes(normalise(text, voice), voice)))

    def _phonemize(self, text: str, separator: str) -> str:
        return self.phonemize(text)


def register() -> None:
    """Make ``PHONEMIZER_NAME`` a phonemizer Coqui can build from a config (call before ``Vits(config)``)."""
    phonemizers.get_default_phonemizer("en-us")  # Coqui fills its registry on first use: fill it first
    phonemizers.PHONEMIZERS[PHONEMIZER_NAME] = PiperEspeak


class UnsupportedLanguage(UnusableData):
    """The job's language would lose what makes it speech in this model: any job in it fails alike (exit 65)."""


def language_problem(voice: str, vocabulary: Iterable[str]) -> str | None:
    """Why ``voice``'s language cannot be trained on a model of ``vocabulary`` (None: it can).

    It can when its text is normalised, it has held-out sentences to be scored on, and every one of them
    keeps all its phonemes (tone digits and combining marks included) through the vocabulary.
    """
    if rules_for(voice) is None:
        return f"no text normalisation for espeak-ng voice {voice!r} (voice_trainers.normalise)"
    sentences = held_out(voice, 1_000)
    if not sentences:
        return f"no held-out sentences for espeak-ng voice {voice!r} (voice_trainers/sentences)"
    known = list(vocabulary)
    for sentence in sentences:
        dropped = dropped_symbols(sentence, voice, known)
        if dropped:
            shown = " ".join(f"{symbol!r} (U+{ord(symbol):04X})" for symbol in dropped[:5])
            return f"the vocabulary drops {shown} from {voice!r}'s phonemes of {sentence!r}"
    return None


def check_language(tokenizer: PiperTokenizer) -> None:
    """Refuse (exit 65) a language the model's vocabulary (the base's, with one) cannot carry whole."""
    problem = language_problem(tokenizer.voice, tokenizer.characters.vocab)
    if problem is not None:
        raise UnsupportedLanguage(f"language not supported by this model: {problem}")


class PiperTokenizer(TTSTokenizer):
    """Coqui's tokenizer interface, fed by the normaliser and Piper's phonemizer (module docstring)."""

    def __init__(self, *, characters: Any, voice: str, add_blank: bool, use_eos_bos: bool, phonemizer: Any) -> None:
        # use_phonemes stays true so Coqui's dataset caches the ids (its phoneme cache) instead of
        # recomputing them each epoch; the phonemizer object is never called, text_to_ids replaces it.
        super().__init__(use_phonemes=True, text_cleaner=None, characters=characters, phonemizer=phonemizer,
                         add_blank=add_blank, use_eos_bos=use_eos_bos)
        self.voice = voice

    @classmethod
    def replacing(cls, tokenizer: TTSTokenizer, voice: str) -> PiperTokenizer:
        """This tokenizer with the vocabulary and blank/BOS/EOS settings of the one Coqui built from a config."""
        return cls(characters=tokenizer.characters, voice=voice, add_blank=tokenizer.add_blank,
                   use_eos_bos=tokenizer.use_eos_bos, phonemizer=tokenizer.phonemizer)

    def text_to_ids(self, text: str, language: str | None = None) -> list[int]:
        sentences = sentence_phonemes(normalise(text, self.voice), self.voice)
        return list(itertools.chain.from_iterable(self.sentence_ids(sentence) for sentence in sentences))

    def encode(self, text: str) -> list[int]:
        """Coqui's encoding, without logging the whole text on each unknown symbol (one short line instead)."""
        ids = []
        for symbol in text:
            try:
                ids.append(self.characters.char_to_id(symbol))
            except KeyError:
                if symbol not in self.not_found_characters:
                    self.not_found_characters.append(symbol)
                    log.warning("symbol %r (U+%04X) is not in the vocabulary: left out", symbol, ord(symbol))
        return ids

    def sentence_ids(self, phonemes: list[str]) -> list[int]:
        ids = self.encode("".join(phonemes))
        if self.add_blank:
            ids = self.intersperse_blank_char(ids)
        if self.use_eos_bos:
            ids = self.pad_with_bos_eos(ids)
        return ids


def install(model: Any, voice: str) -> PiperTokenizer:
    """Give a Coqui ``Vits`` the Piper tokenizer for ``voice``, keeping the vocabulary its config built.

    The full stage then calls ``check_language``; the light and evaluate stages read a model it trained.
    """
    tokenizer = PiperTokenizer.replacing(model.tokenizer, voice)
    model.tokenizer = tokenizer
    return tokenizer
