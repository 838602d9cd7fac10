"""Held-out sentences the evaluate stage synthesises: one shipped list per language (``<primary>.txt``),
never the job's own transcripts, so a model is scored on text it was not trained on.

Each list is plain sentences without digits (a recogniser writes words, so a digit would count as an
error of the model). The espeak-ng voice picks the list by its primary language: ``en-us``, ``en-gb``
read ``en.txt``; ``pt-br`` reads ``pt.txt``.
"""

from __future__ import annotations

from importlib import resources


def languages() -> list[str]:
    """The primary languages a list ships for."""
    return sorted(entry.name[:-4] for entry in resources.files(__name__).iterdir() if entry.name.endswith(".txt"))


def held_out(voice: str, count: int) -> list[str] | None:
    """The first ``count`` sentences for the espeak-ng ``voice``'s language, or None when none ships."""
    primary = voice.split("-", 1)[0]
    entry = resources.files(__name__) / f"{primary}.txt"
    if not entry.is_file():
        return None
    lines = [line.strip() for line in entry.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line][:count]
