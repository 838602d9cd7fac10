"""Text normalisation: what a transcript or a sentence to synthesise reads as, per language."""

from __future__ import annotations

import pytest
from voice_trainers.normalise import main, normalise

CASES = [
    # English (en-us: month first)
    ("en-us", "On 3/14/2024 we met.", "On March fourteenth twenty twenty-four we met."),
    ("en-us", "The 1990s were loud.", "The nineteen nineties were loud."),
    ("en-us", "Back in the '80s.", "Back in the eighties."),
    ("en-us", "It cost $1,250.50 in total.",
     "It cost one thousand two hundred and fifty dollars and fifty cents in total."),
    ("en-us", "Only $0.99!", "Only ninety-nine cents!"),
    ("en-us", "A €1 coin and £20.", "A one euro coin and twenty pounds."),
    ("en-us", "Dr. Smith saw Mr. Jones.", "Doctor Smith saw Mister Jones."),
    ("en-us", "They live on Main St.", "They live on Main Street."),
    ("en-us", "St. Louis is far.", "Saint Louis is far."),
    ("en-us", "Meet at 10:05 or 7:00.", "Meet at ten oh five or seven o'clock."),
    ("en-us", "It is 50% done, 3.5 times.", "It is fifty percent done, three point five times."),
    ("en-us", "The 21st and 2nd floors.", "The twenty-first and second floors."),
    ("en-us", "No. 7 has 1,000,000 fans.", "number seven has one million fans."),
    ("en-us", "In 2024 there were 12 cats.", "In twenty twenty-four there were twelve cats."),
    ("en-us", "Salt & pepper, A4 paper.", "Salt and pepper, A four paper."),
    # British English: day first
    ("en", "On 14/3/2024 we met.", "On the fourteenth of March twenty twenty-four we met."),
    # German
    ("de", "Am 14.3.2024 kam er.", "Am vierzehnten März zweitausendvierundzwanzig kam er."),
    ("de", "Es kostet 1.250,50 €.", "Es kostet eintausendzweihundertfünfzig Euro und fünfzig Cent."),
    ("de", "Dr. Meier wohnt in der Hauptstr. 5.", "Doktor Meier wohnt in der Hauptstraße fünf."),
    ("de", "Obst, z. B. Äpfel usw.", "Obst, zum Beispiel Äpfel und so weiter."),
    ("de", "Um 1:30 sind 3,5 % weg.", "Um ein Uhr dreißig sind drei Komma fünf Prozent weg."),
    ("de", "Die 1990er waren laut.", "Die neunzehnhundertneunziger waren laut."),
    # French and Spanish
    ("fr", "Le 14/03/2024, M. Dupont a payé 1 250,50 €.",
     "Le quatorze mars deux mille vingt-quatre, Monsieur Dupont a payé mille deux cent cinquante euros et"
     " cinquante centimes."),
    ("es", "El 1/03/2024 el Sr. García pagó 20 €.",
     "El primero de marzo de dos mil veinticuatro el señor García pagó veinte euros."),
]


@pytest.mark.parametrize(("voice", "text", "spoken"), CASES)
def test_a_text_reads_as_it_is_said(voice, text, spoken):
    """Numbers, dates, money, times, percentages and abbreviations come out as the words a reader says."""
    assert normalise(text, voice) == spoken


@pytest.mark.parametrize(("voice", "text", "spoken"), CASES)
def test_normalising_twice_changes_nothing(voice, text, spoken):
    """Training and inference may both normalise the same text: the second pass is a no-op."""
    assert normalise(normalise(text, voice), voice) == normalise(text, voice)


def test_a_date_whose_month_does_not_exist_is_not_read_as_a_date():
    """3/14/2024 for a day-first voice has no 14th month: the numbers are read, no month is made up."""
    assert "March" not in normalise("On 3/14/2024.", "en")
    assert "fourteen" in normalise("On 3/14/2024.", "en")


def test_a_language_without_rules_keeps_its_text():
    """An unknown language's text only has its spaces tidied: no English words are put into it."""
    assert normalise("  Xin chào   15 ", "vi") == "Xin chào 15"


def test_no_digit_is_left_for_espeak_ng_to_guess(capsys):
    """Whatever the text, a normalised one holds no digits; the command line prints the same."""
    text = "Call 555-0199 at 10:61, code 7B, 1,2,3 and 4.5.6"
    spoken = normalise(text, "en-us")
    assert not any(ch.isdigit() for ch in spoken)
    assert main(["--voice", "en-us", text]) == 0
    assert capsys.readouterr().out.strip() == spoken
