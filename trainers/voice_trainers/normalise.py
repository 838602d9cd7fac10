"""Text normalisation per language: numbers, dates, currency, percentages and abbreviations become words.

The same function runs on every transcript before it is phonemised for training (``coqui.PiperTokenizer``),
on the evaluate stage's sentences, and must run on the product's text before Piper synthesises it: Piper
phonemises raw text, so a voice trained on "three fourteen" reads ``3/14`` as espeak-ng does ("three slash
fourteen"). It imports only the standard library and num2words (LGPL-2.1), not piper (GPL-3.0) nor torch,
so a consumer can ship it::

    python -m voice_trainers.normalise --voice en-us "Dr. Lee paid $1,250.50 on 3/14/2024."

The rules are keyed by the espeak-ng voice of the model's ``model.onnx.json`` (``espeak.voice``): ``en-us``
reads ``3/4/2024`` as March fourth, ``en`` (British) as the third of April. ``normalise`` is idempotent.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

from num2words import num2words

# Part of model.onnx.json (``text_normaliser``) and of the training fingerprint (through the adapter's
# version): raise it when a rule changes what a text reads as, since a voice is trained on these words.
VERSION = 1

_MONTHS = {
    "en": "January February March April May June July August September October November December",
    "de": "Januar Februar März April Mai Juni Juli August September Oktober November Dezember",
    "fr": "janvier février mars avril mai juin juillet août septembre octobre novembre décembre",
    "es": "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre",
    "it": "gennaio febbraio marzo aprile maggio giugno luglio agosto settembre ottobre novembre dicembre",
    "nl": "januari februari maart april mei juni juli augustus september oktober november december",
    "pt": "janeiro fevereiro março abril maio junho julho agosto setembro outubro novembro dezembro",
}


@dataclass(frozen=True)
class Money:
    one: str
    many: str
    cent_one: str
    cent_many: str


@dataclass(frozen=True)
class Rules:
    """How one language writes numbers and what its abbreviations stand for."""

    decimal: str
    thousands: str
    money: dict[str, Money]
    percent: str
    conjunction: str  # between the whole amount and the cents
    ampersand: str
    # (pattern, replacement): the pattern is matched case-sensitively at a word start.
    abbreviations: tuple[tuple[str, str], ...] = ()
    date: Callable[[int, int, int | None, Rules, str], str] | None = None
    # Voices whose dates are month/day/year ("3/14/2024"); every other voice reads day/month/year.
    month_first_voices: frozenset[str] = frozenset()
    # "10:30" read aloud (hours, minutes), or None: left to the number rules.
    time: Callable[[int, int], str] | None = None
    months: tuple[str, ...] = field(default=())


def _words(number: int | float, language: str, **kwargs: object) -> str:
    # num2words puts commas in English cardinals ("one thousand, two hundred"): a comma is a pause to espeak-ng.
    return num2words(number, lang=language, **kwargs).replace(",", "")


def _year(year: int, language: str) -> str:
    return _words(year, language, to="year")


def _date_en(day: int, month: int, year: int | None, rules: Rules, voice: str) -> str:
    ordinal = _words(day, "en", to="ordinal")
    tail = f" {_year(year, 'en')}" if year is not None else ""
    if voice == "en-us":
        return f"{rules.months[month - 1]} {ordinal}{tail}"
    return f"the {ordinal} of {rules.months[month - 1]}{tail}"


def _date_de(day: int, month: int, year: int | None, rules: Rules, voice: str) -> str:
    # The dative/accusative ending: "am vierzehnten März", "den vierzehnten März", as dates are mostly said.
    tail = f" {_year(year, 'de')}" if year is not None else ""
    return f"{_words(day, 'de', to='ordinal')}n {rules.months[month - 1]}{tail}"


def _date_cardinal(first: dict[str, str], link: str) -> Callable[[int, int, int | None, Rules, str], str]:
    """Romance and Dutch dates: a cardinal day ("quatorze mars", "catorce de marzo"), the first an ordinal."""

    def date(day: int, month: int, year: int | None, rules: Rules, voice: str) -> str:
        language = voice.split("-")[0]
        spoken = first.get(language) if day == 1 else None
        tail = f" {link}{_year(year, language)}" if year is not None else ""
        return f"{spoken or _words(day, language)} {link}{rules.months[month - 1]}{tail}"

    return date


_DOLLAR_EN = Money("dollar", "dollars", "cent", "cents")
RULES: dict[str, Rules] = {
    "en": Rules(
        decimal=".", thousands=",", percent="percent", conjunction="and", ampersand="and",
        money={"$": _DOLLAR_EN, "€": Money("euro", "euros", "cent", "cents"),
               "£": Money("pound", "pounds", "penny", "pence")},
        abbreviations=(
            (r"Dr\.", "Doctor"), (r"Mr\.", "Mister"), (r"Mrs\.", "Missus"), (r"Ms\.", "Miz"),
            (r"Prof\.", "Professor"), (r"St\.(?=\s+[A-Z])", "Saint"), (r"St\.", "Street"), (r"Ave\.", "Avenue"),
            (r"Rd\.", "Road"), (r"Mt\.", "Mount"), (r"Jr\.", "Junior"), (r"Sr\.", "Senior"), (r"vs\.", "versus"),
            (r"etc\.", "et cetera"), (r"e\.g\.", "for example"), (r"i\.e\.", "that is"),
            (r"approx\.", "approximately"), (r"No\.(?=\s*\d)", "number"),
        ),
        date=_date_en,
        month_first_voices=frozenset({"en-us"}),
        time=lambda hours, minutes: (f"{_words(hours, 'en')} o'clock" if minutes == 0 else
                                     f"{_words(hours, 'en')} oh {_words(minutes, 'en')}" if minutes < 10 else
                                     f"{_words(hours, 'en')} {_words(minutes, 'en')}"),
    ),
    "de": Rules(
        decimal=",", thousands=".", percent="Prozent", conjunction="und", ampersand="und",
        money={"€": Money("Euro", "Euro", "Cent", "Cent"), "$": Money("Dollar", "Dollar", "Cent", "Cent"),
               "£": Money("Pfund", "Pfund", "Penny", "Pence")},
        abbreviations=(
            (r"Dr\.", "Doktor"), (r"Prof\.", "Professor"), (r"Hr\.", "Herr"), (r"Hrn\.", "Herrn"), (r"Fr\.", "Frau"),
            (r"Str\.", "Straße"), (r"(?<=[a-zäöüß])str\.", "straße"), (r"Nr\.", "Nummer"),
            (r"z\.\s?B\.", "zum Beispiel"), (r"usw\.", "und so weiter"),
            (r"bzw\.", "beziehungsweise"), (r"ca\.", "circa"), (r"d\.\s?h\.", "das heißt"),
            (r"u\.\s?a\.", "unter anderem"), (r"etc\.", "et cetera"), (r"St\.", "Sankt"),
        ),
        date=_date_de,
        time=lambda hours, minutes: " ".join(
            ["ein" if hours == 1 else _words(hours, "de"), "Uhr"] + ([_words(minutes, "de")] if minutes else [])),
    ),
    "fr": Rules(
        decimal=",", thousands=" ", percent="pour cent", conjunction="et", ampersand="et",
        money={"€": Money("euro", "euros", "centime", "centimes"), "$": Money("dollar", "dollars", "cent", "cents")},
        abbreviations=(
            (r"M\.(?=\s+[A-Z])", "Monsieur"), (r"Mme\b", "Madame"), (r"Mlle\b", "Mademoiselle"),
            (r"Dr\b\.?", "Docteur"), (r"Ste\b\.?", "Sainte"), (r"St\b\.?", "Saint"), (r"etc\.", "et cetera"),
            (r"av\.", "avenue"), (r"bd\b\.?", "boulevard"),
        ),
        date=_date_cardinal({"fr": "premier"}, ""),
        time=lambda hours, minutes: " ".join(
            ["une heure" if hours == 1 else f"{_words(hours, 'fr')} heures"]
            + ([_words(minutes, "fr")] if minutes else [])),
    ),
    "es": Rules(
        decimal=",", thousands=".", percent="por ciento", conjunction="con", ampersand="y",
        money={"€": Money("euro", "euros", "céntimo", "céntimos"),
               "$": Money("dólar", "dólares", "centavo", "centavos")},
        abbreviations=(
            (r"Sr\.", "señor"), (r"Sra\.", "señora"), (r"Srta\.", "señorita"), (r"Dr\.", "doctor"),
            (r"Dra\.", "doctora"), (r"Ud\.", "usted"), (r"Uds\.", "ustedes"), (r"etc\.", "etcétera"),
            (r"Av\.", "avenida"), (r"pág\.", "página"),
        ),
        date=_date_cardinal({"es": "primero"}, "de "),
    ),
    "it": Rules(
        decimal=",", thousands=".", percent="per cento", conjunction="e", ampersand="e",
        money={"€": Money("euro", "euro", "centesimo", "centesimi"),
               "$": Money("dollaro", "dollari", "centesimo", "centesimi")},
        abbreviations=(
            (r"Sig\.ra", "signora"), (r"Sig\.", "signor"), (r"Dott\.", "dottor"), (r"Prof\.", "professor"),
            (r"ecc\.", "eccetera"), (r"p\.\s?es\.", "per esempio"),
        ),
        date=_date_cardinal({"it": "primo"}, ""),
    ),
    "nl": Rules(
        decimal=",", thousands=".", percent="procent", conjunction="en", ampersand="en",
        money={"€": Money("euro", "euro", "cent", "cent"), "$": Money("dollar", "dollar", "cent", "cent")},
        abbreviations=(
            (r"dhr\.", "de heer"), (r"mevr\.", "mevrouw"), (r"Dr\.", "dokter"), (r"bijv\.", "bijvoorbeeld"),
            (r"enz\.", "enzovoort"), (r"d\.w\.z\.", "dat wil zeggen"), (r"St\.", "Sint"),
        ),
        date=_date_cardinal({}, ""),
    ),
    "pt": Rules(
        decimal=",", thousands=".", percent="por cento", conjunction="e", ampersand="e",
        money={"€": Money("euro", "euros", "cêntimo", "cêntimos"),
               "$": Money("dólar", "dólares", "centavo", "centavos")},
        abbreviations=(
            (r"Sr\.", "senhor"), (r"Sra\.", "senhora"), (r"Dr\.", "doutor"), (r"Dra\.", "doutora"),
            (r"etc\.", "et cetera"), (r"Av\.", "avenida"),
        ),
        date=_date_cardinal({"pt": "primeiro"}, "de "),
    ),
}
RULES = {code: Rules(**{**rules.__dict__, "months": tuple(_MONTHS[code].split())}) for code, rules in RULES.items()}
_ENGLISH_ORDINAL = re.compile(r"\b(\d+)(st|nd|rd|th)\b")
_DECADE_EN = re.compile(r"\b(1[1-9]|20)(\d)0s\b")
_DECADE_SHORT_EN = re.compile(r"(?<!\w)['’](\d)0s\b")
_DECADE_DE = re.compile(r"\b(1[1-9]|20)(\d)0er\b")
_DIGITS = re.compile(r"\d+")
_TIME = re.compile(r"(?<![\w.:])([01]?\d|2[0-3]):([0-5]\d)(?![\w:])")
_SPACES = re.compile(r"\s+")


def languages() -> list[str]:
    """The primary languages normalised (the espeak-ng voice's first part: ``en`` for ``en-gb``)."""
    return sorted(RULES)


def rules_for(voice: str) -> Rules | None:
    return RULES.get(voice.split("-")[0])


def _amount_pattern(rules: Rules) -> str:
    """A number as the language writes it: two groups, the whole part (with its separators) and the fraction."""
    thousands = r"[ \u00a0\u202f]" if rules.thousands == " " else re.escape(rules.thousands)
    # A grouped number needs at least one full group ("1,250"); the fraction follows the decimal mark.
    return rf"(\d{{1,3}}(?:{thousands}\d{{3}})+|\d+)(?:{re.escape(rules.decimal)}(\d+))?"


def _to_number(whole: str, fraction: str | None) -> tuple[int, str | None]:
    return int(re.sub(r"\D", "", whole)), fraction


def _cardinal(whole: int, fraction: str | None, language: str) -> str:
    if fraction is None:
        return _words(whole, language)
    # Digits after the point are read one by one ("three point one four"), as num2words would round them.
    point = _words(1.5, language).split()[-2]
    return f"{_words(whole, language)} {point} {' '.join(_words(int(d), language) for d in fraction)}"


def _money(amount: str, symbol: str, rules: Rules, language: str) -> str:
    match = re.fullmatch(_amount_pattern(rules), amount)
    if match is None:
        return amount
    whole, fraction = _to_number(match.group(1), match.group(2))
    money = rules.money[symbol]
    spoken = f"{_words(whole, language)} {money.one if whole == 1 else money.many}"
    if fraction is not None and len(fraction) == 2 and int(fraction):
        cents = int(fraction)
        spoken_cents = f"{_words(cents, language)} {money.cent_one if cents == 1 else money.cent_many}"
        # "$0.99" is ninety-nine cents, not "zero dollars and…".
        spoken = spoken_cents if whole == 0 else f"{spoken} {rules.conjunction} {spoken_cents}"
    elif fraction is not None and int(fraction):
        return _cardinal(whole, fraction, language) + f" {money.many}"
    return spoken


def _money_match(match: re.Match[str], *, symbol: str, rules: Rules, language: str) -> str:
    return _money(match["before"] or match["after"], symbol, rules, language)


def _plural_en(words: str) -> str:
    head, _, last = words.rpartition(" ")
    last = last[:-1] + "ies" if last.endswith("y") else last + "s"
    return f"{head} {last}".strip()


def normalise(text: str, voice: str) -> str:
    """``text`` with numbers, dates, currency, percentages and abbreviations written out for ``voice``'s language.

    A language without rules keeps its text (only whitespace and Unicode composition are tidied).
    """
    text = _SPACES.sub(" ", unicodedata.normalize("NFC", text)).strip()
    rules = rules_for(voice)
    if rules is None:
        return text
    language = voice.split("-")[0]
    for pattern, spoken in rules.abbreviations:
        # A pattern may name its own left edge (German "Hauptstr."); otherwise it starts a word.
        start = "" if pattern.startswith("(?<=") else r"(?<![\w.])"
        text = re.sub(rf"{start}{pattern}(?=(\s|$|[,;:!?]))", spoken + "\0", text)
    # An abbreviation's full stop that also ended the text still ends it.
    text = re.sub(r"\0$", ".", text).replace("\0", "")
    amount = _amount_pattern(rules)
    date_separator = r"[./-]" if language in ("de", "nl") else r"[/]"
    day_first = voice not in rules.month_first_voices

    def date(match: re.Match[str]) -> str:
        first, second, year = int(match.group(1)), int(match.group(2)), match.group(3)
        day, month = (first, second) if day_first else (second, first)
        if not (1 <= month <= 12 and 1 <= day <= 31) or rules.date is None:
            return match.group(0)
        return rules.date(day, month, int(year) + (2000 if len(year) == 2 else 0), rules, voice)

    # A date needs its year: "3/4" alone may be a fraction, "14.3" a score.
    separator = date_separator
    text = re.sub(rf"(?<![\w.,/])(\d{{1,2}}){separator}(\d{{1,2}}){separator}(\d{{4}}|\d{{2}})(?![\w/]|[.,]\d)",
                  date, text)
    time = rules.time
    if time is not None:
        text = _TIME.sub(lambda m: time(int(m.group(1)), int(m.group(2))), text)
    if language == "en":
        text = _DECADE_EN.sub(lambda m: _plural_en(_year(int(m.group(1) + m.group(2) + "0"), "en")), text)
        text = _DECADE_SHORT_EN.sub(lambda m: _plural_en(_words(int(m.group(1)) * 10, "en")), text)
        text = _ENGLISH_ORDINAL.sub(lambda m: _words(int(m.group(1)), "en", to="ordinal"), text)
    elif language == "de":
        text = _DECADE_DE.sub(lambda m: _year(int(m.group(1) + m.group(2) + "0"), "de") + "er", text)
    for symbol in rules.money:
        escaped = re.escape(symbol)
        money = re.compile(rf"{escaped}\s?(?P<before>{amount})(?!\w)|(?<![\w.,])(?P<after>{amount})\s?{escaped}")
        text = money.sub(functools.partial(_money_match, symbol=symbol, rules=rules, language=language), text)
    text = re.sub(rf"(?P<amount>{amount})\s?%", lambda m: f"{m['amount']} {rules.percent}", text)

    def cardinal(match: re.Match[str]) -> str:
        whole, fraction = _to_number(match.group(1), match.group(2))
        if fraction is None and re.fullmatch(r"\d{4}", match.group(1)) and 1100 <= whole <= 2099:
            return _year(whole, language)
        return _cardinal(whole, fraction, language)

    text = re.sub(rf"(?<![\w.,]){amount}(?!\w)", cardinal, text)
    # Whatever digits are left (inside a word: "A4", "mp3") are read as cardinals, never as espeak-ng guesses.
    text = _DIGITS.sub(lambda m: f" {_words(int(m.group(0)), language)} ", text)
    text = re.sub(r"\s*&\s*", f" {rules.ampersand} ", text)
    return _SPACES.sub(" ", text).replace(" ,", ",").replace(" .", ".").strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m voice_trainers.normalise",
                                     description="Write out numbers, dates, currency and abbreviations.")
    parser.add_argument("--voice", required=True, help="the espeak-ng voice (model.onnx.json's espeak.voice)")
    parser.add_argument("text", nargs="*", help="the text (else stdin, one text a line)")
    args = parser.parse_args(argv)
    lines = [" ".join(args.text)] if args.text else sys.stdin.read().splitlines()
    for line in lines:
        print(normalise(line, args.voice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
