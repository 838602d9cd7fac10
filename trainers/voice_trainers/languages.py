"""``{language}`` (a code like ``en``, ``pt-BR``) to the espeak-ng voice that phonemises it."""

from __future__ import annotations

import re

# The voices of Debian's espeak-ng 1.51 (`espeak-ng --voices`) that Coqui's phonemizer and Piper's
# bundled espeak-ng both have, minus dialect variants (`-x-...`) nobody asks for by code.
ESPEAK_VOICES = frozenset(
    "af am an ar as az ba be bg bn bpy bs ca cmn cs cv cy da de el en-029 en-gb en-gb-scotland en-us eo es es-419"
    " et eu fa fi fr-be fr-ch fr-fr ga gd gn grc gu hak haw he hi hr ht hu hy hyw ia id io is it ja jbo ka kk kl kn"
    " ko kok ku ky la lb lfn lt ltg lv mi mk ml mr ms mt my nb nci ne nl nog om or pa pap piqd pl pt pt-br py qdb"
    " qu quc qya ro ru ru-lv sd shn si sjn sk sl smj sq sr sv sw ta te th tk tn tr tt ug uk ur uz vi yue".split()
)

# A bare language, or a region espeak-ng has no voice for, falls back to this voice.
_PRIMARY_DEFAULT = {
    "en": "en-us",
    "fr": "fr-fr",
    "zh": "cmn",
    "no": "nb",
    "pt": "pt",
    "es": "es",
}
# Codes whose espeak-ng name differs from the lower-cased BCP 47 tag.
_ALIASES = {
    "zh-cn": "cmn",
    "zh-hans": "cmn",
    "zh-tw": "cmn",
    "zh-hant": "cmn",
    "zh-hk": "yue",
    "nb-no": "nb",
    "nn": "nb",
    "pt-pt": "pt",
    "en-au": "en-gb",
    "en-nz": "en-gb",
    "en-ie": "en-gb",
    "en-in": "en-gb",
    "en-za": "en-gb",
    "en-ca": "en-us",
    "es-mx": "es-419",
    "es-ar": "es-419",
    "es-co": "es-419",
    "es-us": "es-419",
    "fr-ca": "fr-fr",
    "iw": "he",
    "in": "id",
}
_CODE = re.compile(r"[a-z]{2,3}(-[a-z0-9]{2,8})*")


def espeak_voice(language: str) -> str | None:
    """The espeak-ng voice for a language code, or None when there is none (the stage exits 65)."""
    code = language.strip().replace("_", "-").lower()
    if not _CODE.fullmatch(code):
        return None
    if code in _ALIASES:
        return _ALIASES[code]
    if code in ESPEAK_VOICES and code not in _PRIMARY_DEFAULT:
        return code
    primary = code.split("-", 1)[0]
    if primary in _PRIMARY_DEFAULT:
        return _PRIMARY_DEFAULT[primary]
    if primary in ESPEAK_VOICES:
        return primary
    return None
