"""The languages a deployment of the real trainers takes: others are refused at submit, with the list."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from worker.core.errors import InvalidMessage
from worker.settings import load_settings
from worker.voice.input_policy import InputPolicy
from worker.voice.languages import trainer_languages
from worker.voice.submit import prepare

TABLE = trainer_languages()


def payload(language: str | None) -> dict:
    metadata = {"directoryName": "user-1-voice-1"} | ({"language": language} if language is not None else {})
    return {"_doc": {"_id": "j1"}, "jobId": "j1", "profileId": "p1", "metadata": metadata,
            "input": [{"recordingUrl": "https://media.example.com/1.wav", "originalText": "Hello."}]}


@pytest.mark.parametrize(("language", "voice"), [
    ("en", "en-us"), ("en-US", "en-us"), ("en-GB", "en"), ("en_AU", "en"), ("pt-BR", "pt-br"), ("pt", "pt"),
    ("fr-CA", "fr"), ("de-AT", "de"), ("es-MX", "es-419"), ("zh-TW", "cmn"), ("vi", "vi"), ("xx", None),
])
def test_a_code_resolves_to_the_voice_the_trainers_use(language, voice):
    """The worker maps codes to espeak-ng voices as the stages do (the trainers' test checks every code)."""
    assert TABLE.voice(language) == voice


@pytest.mark.parametrize("language", ["en", "en-GB", "pt-BR", "de", "fr-CA", "es", "it", "nl", None])
def test_a_supported_language_is_accepted_at_submit(language):
    """A job in a language the trainers support (or none: English) passes the trainers' policy."""
    _body, job, _key = prepare(payload(language), InputPolicy(languages=TABLE))
    assert job.language == (language or "en")


@pytest.mark.parametrize("language", ["vi", "zh", "yue", "th", "ja", "ru", "xx"])
def test_an_unsupported_language_is_refused_at_submit_with_the_supported_list(language):
    """Tonal, CJK and other unsupported languages are refused in one line that lists what is supported."""
    with pytest.raises(InvalidMessage) as refused:
        prepare(payload(language), InputPolicy(languages=TABLE))
    lines = str(refused.value).splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"metadata.language: language '{language}' is not supported")
    assert "supported: " + ", ".join(TABLE.supported) in lines[0]


def test_without_the_trainers_any_well_formed_language_is_accepted():
    """The reference trainer reads every language alike: with no table, 'vi' passes."""
    _body, job, _key = prepare(payload("vi"), InputPolicy())
    assert job.language == "vi"


def test_a_deployment_that_runs_the_real_trainers_checks_the_language():
    """TRAINER_PYTHON set means the real trainers run: the worker's input policy carries their table."""
    assert load_settings({"TRAINER_PYTHON": "/opt/trainers/bin/python"}).input_policy().languages is TABLE
    assert load_settings({}).input_policy().languages is None


def test_the_shipped_table_is_consistent():
    """Every supported voice is an espeak-ng voice, and so is every alias and default it maps to."""
    data = json.loads((resources.files("worker.voice") / "languages.json").read_text(encoding="utf-8"))
    voices = set(data["espeakVoices"])
    assert set(data["supported"]) <= voices
    assert set(data["aliases"].values()) | set(data["primaryDefaults"].values()) <= voices
    assert "en-us" in data["supported"] and "vi" not in data["supported"]
