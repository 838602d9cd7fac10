"""The demo's second act without training: its pipeline copy in the ci profile, its flag, its refusal
without the trainer environment. The act itself (minutes of training) runs in tests/real."""

from __future__ import annotations

import io
import tomllib

import pytest

from pipeline.config import load_pipeline_config
from worker.ops import cli, demo


def _stages(path):
    return tomllib.loads(path.read_text())["stages"]


def test_the_ci_copy_of_the_real_pipeline_differs_only_in_the_profile(tmp_path):
    """pipeline_with_profile keeps every key of the shipped real pipeline and changes only each --profile value."""
    copy = demo.pipeline_with_profile(demo.REAL_PIPELINE, "ci", tmp_path / "ci.toml")
    shipped, derived = tomllib.loads(demo.REAL_PIPELINE.read_text()), tomllib.loads(copy.read_text())
    assert derived["artifacts"] == shipped["artifacts"]
    assert [s["argv"][s["argv"].index("--profile") + 1] for s in derived["stages"]] == ["ci"] * len(shipped["stages"])
    for stage in shipped["stages"]:
        stage["argv"][stage["argv"].index("--profile") + 1] = "ci"
    assert derived["stages"] == shipped["stages"]
    load_pipeline_config(copy, trainer_python="/usr/bin/python3")


def test_a_stage_without_a_profile_argument_is_refused(tmp_path):
    """A real pipeline whose stage has no --profile cannot be put in the ci profile: ValueError naming the stage."""
    source = tmp_path / "real.toml"
    source.write_text(demo.REAL_PIPELINE.read_text().replace('"--profile", "production"', '"--verbose"', 1))
    with pytest.raises(ValueError, match="'embed' has no single --profile"):
        demo.pipeline_with_profile(source, "ci", tmp_path / "ci.toml")


def test_strings_with_quotes_and_escapes_survive_the_copy(tmp_path):
    """A value with quotes, backslashes, braces and non-ASCII letters reads back the same from the copy."""
    odd = 'a "quoted" \\ back{{slash}} ünïcode\ttab'
    source = tmp_path / "real.toml"
    source.write_text(demo.REAL_PIPELINE.read_text().replace('"--language", "{language}"',
                                                             f'"--language", {demo._toml(odd)}', 1))
    copy = demo.pipeline_with_profile(source, "ci", tmp_path / "ci.toml")
    assert odd in _stages(copy)[0]["argv"]


def test_the_second_act_without_the_trainer_environment_says_how_to_build_it(monkeypatch, tmp_path):
    """`demo --real` with no trainers/.venv exits 1 at once, naming the make target that builds it."""
    monkeypatch.setattr(demo, "TRAINER_PYTHON", tmp_path / "missing" / "python")
    out = io.StringIO()
    assert demo.run_demo(out, real=True) == 1
    assert "make trainers/.venv/.installed" in out.getvalue()


def test_demo_takes_the_real_flag():
    """`python -m worker demo --real` parses to the second act; plain `demo` stays the reference trainer's."""
    parser = cli.build_parser()
    assert parser.parse_args(["demo", "--real"]).real is True
    assert parser.parse_args(["demo"]).real is False
