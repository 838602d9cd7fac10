"""Pipeline config: loading, one line per problem, per-element placeholder substitution."""

from __future__ import annotations

import copy
import signal
from pathlib import Path

import pytest

from pipeline.config import (
    REQUIRED_ARTIFACTS,
    load_pipeline_config,
    parse_pipeline_config,
    placeholder_problems,
    render_argv,
)
from tests.support import ARTIFACT_KEYS
from worker.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def good_config() -> dict:
    return {
        "artifacts": {
            "fullModel": "full/model.pth",
            "fullConfig": "full/config.json",
            "speakerEmbeddings": "full/speakers.pth",
            "lightModel": "light/model.onnx",
            "lightConfig": "light/model.onnx.json",
        },
        "stages": [
            {
                "name": "train_full",
                "argv": ["{python}", "-m", "x", "--out", "{output_dir}/full", "{checkpoint_dir}"],
                "outputs": ["full/model.pth", "full/config.json", "full/speakers.pth"],
                "resumable": True,
                "permanent_exit_codes": [65],
                "timeout_seconds": 60,
            },
            {
                "name": "light",
                "argv": ["{python}", "{dataset_dir}", "{log_dir}", "{job_id}", "{language}"],
                "outputs": ["light/model.onnx", "light/model.onnx.json"],
            },
        ],
    }


def problems_of(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_pipeline_config(data, source="cfg")
    return caught.value.problems


def test_shipped_default_config_is_valid():
    """The repository's config/pipeline.toml loads, declares every required artifact and maps each of
    its artifacts to a stage output."""
    config = load_pipeline_config(REPO / "config" / "pipeline.toml")
    assert config.artifact_keys == ARTIFACT_KEYS
    assert set(REQUIRED_ARTIFACTS) <= set(config.artifact_keys)
    produced = {out for stage in config.stages for out in stage.outputs}
    assert set(config.artifacts.values()) <= produced
    assert all(65 in stage.permanent_exit_codes for stage in config.stages)
    assert any(stage.resumable for stage in config.stages)


def test_good_config_parses_into_stage_specs():
    """A valid mapping yields stage specs with normalised fields and timeout in seconds."""
    config = parse_pipeline_config(good_config())
    first = config.stages[0]
    assert first.name == "train_full" and first.resumable and first.timeout_s == 60.0
    assert first.permanent_exit_codes == frozenset({65})
    assert config.stages[1].resumable is False and config.stages[1].timeout_s is None


def _mutate(path: str, value):
    def apply(data: dict) -> dict:
        data = copy.deepcopy(data)
        target = data
        keys = path.split(".")
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        last = keys[-1]
        if value is _DELETE:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
        return data

    return apply


_DELETE = object()

BAD_CONFIGS = [
    ("unknown placeholder", _mutate("stages.0.argv", ["{python}", "{secret}"]), "unknown placeholder {secret}"),
    ("format spec", _mutate("stages.0.argv", ["{python!r}"]), "takes no format spec"),
    ("attribute access", _mutate("stages.0.argv", ["{python.real}"]), "unknown placeholder"),
    ("unbalanced brace", _mutate("stages.0.argv", ["{python"]), "malformed braces"),
    ("missing artifact", _mutate("artifacts.lightConfig", _DELETE), "missing required key 'lightConfig'"),
    ("artifact key not a plain name", _mutate("artifacts.6th", "full/model.pth"), "key '6th' is not a plain name"),
    ("added artifact not produced", _mutate("artifacts.vocoder", "full/vocoder.pth"),
     "artifacts.vocoder: 'full/vocoder.pth' is not among any stage's outputs"),
    ("no artifacts table", _mutate("artifacts", _DELETE), "missing [artifacts]"),
    ("absolute artifact", _mutate("artifacts.fullModel", "/etc/passwd"), "is absolute"),
    ("escaping artifact", _mutate("artifacts.fullModel", "../x/model.pth"), "escapes the output dir"),
    ("escaping output", _mutate("stages.1.outputs", ["light/../../x"]), "escapes the output dir"),
    ("absolute output", _mutate("stages.1.outputs", ["/tmp/x"]), "is absolute"),
    ("manifest dir output", _mutate("stages.1.outputs", [".manifests/x.json"]), "reserved"),
    ("placeholder output", _mutate("stages.1.outputs", ["{output_dir}/x"]), "placeholder"),
    ("unsafe stage name", _mutate("stages.1.name", "../evil"), "not a safe path component"),
    ("duplicate stage name", _mutate("stages.1.name", "train_full"), "duplicate stage name"),
    ("empty argv", _mutate("stages.1.argv", []), "argv is empty"),
    ("argv not strings", _mutate("stages.1.argv", ["python", 3]), "argv must be an array of strings"),
    ("artifact not produced", _mutate("artifacts.lightModel", "light/other.onnx"), "not among any stage's outputs"),
    ("output declared twice", _mutate("stages.1.outputs", ["full/model.pth", "light/model.onnx", "light/model.onnx.json"]), "already declared"),
    ("resumable not bool", _mutate("stages.0.resumable", "yes"), "resumable must be true or false"),
    ("exit codes not ints", _mutate("stages.0.permanent_exit_codes", [65, "x"]), "permanent_exit_codes"),
    ("exit code zero", _mutate("stages.0.permanent_exit_codes", [0]), "permanent_exit_codes"),
    ("timeout negative", _mutate("stages.0.timeout_seconds", -5), "timeout_seconds must be a positive"),
    ("timeout bool", _mutate("stages.0.timeout_seconds", True), "timeout_seconds must be a positive"),
    ("unknown stage key", _mutate("stages.0.shell", True), "unknown key 'shell'"),
    ("unknown top key", _mutate("extra", 1), "unknown top-level key 'extra'"),
    ("no stages", _mutate("stages", _DELETE), "missing [[stages]]"),
    ("artifact not a string", _mutate("artifacts.fullModel", 7), "must be a string path"),
]


@pytest.mark.parametrize(
    ("mutate", "fragment"), [(m, f) for _, m, f in BAD_CONFIGS], ids=[i for i, _, _ in BAD_CONFIGS]
)
def test_each_bad_config_reports_its_problem(mutate, fragment):
    """Each kind of mistake is rejected at load time with a line that names it."""
    problems = problems_of(mutate(good_config()))
    assert any(fragment in line for line in problems), problems
    assert all(line.startswith("cfg: ") for line in problems)


def test_a_config_may_add_artifacts_beyond_the_required_set_kept_in_its_order():
    """The required keys are a floor, not the set: an added artifact that a stage produces is part of
    the config's artifacts, in the table's own order."""
    data = good_config()
    data["artifacts"] = {"vocoder": "full/vocoder.pth", **data["artifacts"]}
    data["stages"][0]["outputs"].append("full/vocoder.pth")
    config = parse_pipeline_config(data)
    assert config.artifact_keys == ("vocoder", *REQUIRED_ARTIFACTS)
    assert config.artifacts["vocoder"] == "full/vocoder.pth"


def test_several_problems_give_one_line_each():
    """Three independent mistakes produce three separate lines, not one merged message."""
    data = good_config()
    data["stages"][0]["argv"] = ["{python}", "{nope}"]
    data["stages"][1]["name"] = "bad name"
    del data["artifacts"]["fullConfig"]
    problems = problems_of(data)
    assert len(problems) == 3, problems
    assert any("{nope}" in p for p in problems)
    assert any("bad name" in p for p in problems)
    assert any("fullConfig" in p for p in problems)


def test_load_reports_missing_file_and_bad_toml(tmp_path):
    """A missing or unparsable file is a ConfigError, never a raw OSError or TOML error."""
    with pytest.raises(ConfigError, match="not found"):
        load_pipeline_config(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[artifacts\nfullModel = ", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_pipeline_config(broken)


def test_render_argv_substitutes_inside_each_element_only():
    """A value with spaces and shell syntax stays one literal argv element; {{ }} are literal braces."""
    values = {"python": "/usr/bin/python3", "job_id": "; rm -rf x $(id) | &", "language": "en"}
    argv = render_argv(["{python}", "--job={job_id}", "{{literal}}", "{language}-{language}"], values)
    assert argv == ["/usr/bin/python3", "--job=; rm -rf x $(id) | &", "{literal}", "en-en"]


def test_placeholder_problems_accepts_known_and_escaped_braces():
    """Known placeholders and doubled braces pass validation; anything else is named."""
    assert placeholder_problems("{output_dir}/full/{{x}}") == []
    assert placeholder_problems("{HOME}") == ["unknown placeholder {HOME}"]


def test_a_checkpoint_signal_is_read_by_name_and_only_a_handleable_one():
    """checkpoint_signal takes a signal name a trainer can handle; SIGTERM, SIGKILL or a number is refused."""
    data = good_config()
    data["stages"][0]["checkpoint_signal"] = "SIGUSR1"
    config = parse_pipeline_config(data)
    assert config.stages[0].checkpoint_signal == signal.SIGUSR1 and config.stages[1].checkpoint_signal is None
    for bad in ("SIGTERM", "SIGKILL", 10, "usr1"):
        data["stages"][0]["checkpoint_signal"] = bad
        assert any("checkpoint_signal must be one of" in line for line in problems_of(data))


def trainer_config() -> dict:
    data = good_config()
    data["stages"][0]["argv"] = ["{trainer_python}", "-m", "voice_trainers", "full"]
    return data


def test_trainer_python_stands_for_the_setting_and_is_checked_at_load(tmp_path):
    """{trainer_python} renders to TRAINER_PYTHON, which must be an absolute executable when a stage uses it."""
    assert any("TRAINER_PYTHON is not set" in line for line in problems_of(trainer_config()))
    for bad, why in (("bin/python", "not an absolute path"), (str(tmp_path / "absent"), "not an executable")):
        with pytest.raises(ConfigError) as caught:
            parse_pipeline_config(trainer_config(), trainer_python=bad)
        assert any(why in line for line in caught.value.problems)
    interpreter = tmp_path / "python"
    interpreter.write_text("#!/bin/sh\n")
    interpreter.chmod(0o755)
    config = parse_pipeline_config(trainer_config(), trainer_python=str(interpreter))
    assert config.trainer_python == str(interpreter)
    assert render_argv(config.stages[0].argv, {"trainer_python": str(interpreter)})[0] == str(interpreter)
    # A config that does not use it needs no trainer environment.
    assert parse_pipeline_config(good_config()).trainer_python == ""
