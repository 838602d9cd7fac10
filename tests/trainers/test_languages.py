"""{language} codes to espeak-ng voices; a language with no voice is unusable data."""

from __future__ import annotations

import pytest
from voice_trainers.languages import ESPEAK_VOICES, espeak_voice


@pytest.mark.parametrize(("language", "voice"), [
    ("en", "en-us"), ("en-US", "en-us"), ("en-GB", "en"), ("en_GB", "en"), ("en-AU", "en"),
    ("pt-BR", "pt-br"), ("pt", "pt"), ("pt-PT", "pt"), ("fr", "fr"), ("fr-CA", "fr"), ("fr-BE", "fr-be"),
    ("de", "de"), ("de-AT", "de"), ("es", "es"), ("es-MX", "es-419"), ("zh", "cmn"), ("zh-TW", "cmn"),
    ("zh-HK", "yue"), ("no", "nb"), ("nb-NO", "nb"), ("ja", "ja"), (" it ", "it"),
])
def test_a_language_code_maps_to_its_espeak_voice(language, voice):
    """A bare language gets its main voice, a region its own voice when espeak-ng has one, else the main one."""
    assert espeak_voice(language) == voice


@pytest.mark.parametrize("language", ["", "xx", "klingon", "e", "en us", "en-", "../en", "tlh-Latn"])
def test_a_language_without_an_espeak_voice_has_none(language):
    """Unknown or malformed codes give no voice (the stage then exits 65)."""
    assert espeak_voice(language) is None


def test_every_mapped_voice_is_a_known_espeak_voice():
    """The aliases and defaults only ever name voices in the list."""
    from voice_trainers import languages

    assert set(languages._ALIASES.values()) <= ESPEAK_VOICES
    assert set(languages._PRIMARY_DEFAULT.values()) <= ESPEAK_VOICES
