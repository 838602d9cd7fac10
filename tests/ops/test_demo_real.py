"""The demo's second act without training: its pipeline copy in the ci profile, its flag, its refusal
without the trainer environment. The act itself (minutes of training) runs in tests/real."""

from __future__ import annotations

import io
import re
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
    assert {k: v for k, v in derived.items() if k != "stages"} == {k: v for k, v in shipped.items() if k != "stages"}
    load_pipeline_config(copy, trainer_python="/usr/bin/python3")


def test_the_cpu_copy_sets_every_declared_device_and_may_replace_the_gate(tmp_path):
    """device= replaces each stage's declared device (none added), gate= replaces [quality.gate] or drops it."""
    source = demo.REAL_PIPELINE  # its stages declare cuda, its [quality.gate] is production's
    assert tomllib.loads(source.read_text())["quality"]["gate"]
    copy = demo.pipeline_with_profile(source, "ci", tmp_path / "ci.toml", device="cpu",
                                      gate={"min_dnsmos_ovrl": 9.5})
    derived = tomllib.loads(copy.read_text())
    assert [s.get("device") for s in derived["stages"]] == ["cpu", "cpu", None, None]
    assert derived["quality"] == {"report": "eval/quality.json", "gate": {"min_dnsmos_ovrl": 9.5}}
    report_only = tomllib.loads(demo.pipeline_with_profile(source, "ci", tmp_path / "r.toml", gate={}).read_text())
    assert report_only["quality"] == {"report": "eval/quality.json"}
    assert [s.get("device") for s in report_only["stages"]] == ["cuda", "cuda", None, None]


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


def _figures(similarity, cer, ovrl, ok, problems=()):
    return {"speakerSimilarity": similarity, "cer": cer, "wer": cer, "asr": "whisper", "asrUnavailable": None,
            "dnsmos": {"ovrl": ovrl, "sig": ovrl, "bak": ovrl}, "sanity": {"ok": ok, "problems": list(problems)}}


def test_the_second_act_prints_a_block_of_scores_per_model_and_the_recordings():
    """score_lines: a titled block per model of the record's quality, then the recordings', each with its own
    similarity, CER, DNSMOS overall and sanity; the gate's decision in the heading."""
    quality = {"report": "eval/quality.json", "gate": {"applied": False, "passed": True, "failed": []},
               "models": {"full": _figures(0.4712, 1.0, 1.351, False, ["silent"]),
                          "light": _figures(0.3849, 0.96, 1.281, True)},
               "reference": _figures(0.9317, 0.05, 3.02, True)}
    text = "\n".join(demo.score_lines(quality))
    assert "eval/quality.json; gate: none configured, report only" in text
    blocks = re.split(r"\n  (?! )", text)[1:]  # a block: its title two spaces in, its lines four
    assert [b.splitlines()[0] for b in blocks] == ["full model", "light model", "reference (the recordings themselves)"]
    for block, (similarity, cer, ovrl, sane) in zip(blocks, [("0.47", "1.00", "1.35", "NOT ok: silent"),
                                                            ("0.38", "0.96", "1.28", "ok"),
                                                            ("0.93", "0.05", "3.02", "ok")], strict=True):
        assert f"speaker similarity  {similarity}\n" in block + "\n"
        assert f"CER                 {cer}\n" in block + "\n"
        assert f"DNSMOS overall      {ovrl}\n" in block + "\n"
        assert block.endswith(f"sanity              {sane}")
    refused = demo.score_lines(quality | {"gate": {"applied": True, "passed": False,
                                                   "failed": ["full.speaker_similarity 0.47 < 0.90"]}})
    assert "gate: below the bar: full.speaker_similarity 0.47 < 0.90" in refused[0]


def test_a_job_without_scores_says_so():
    """No quality on the record (an older worker, a pipeline without [quality]): one line, no invented scores."""
    assert demo.score_lines(None) == ["\nno scores: the job record has no quality report"]
    assert demo.score_lines({"models": {}}) == ["\nno scores: the job record has no quality report"]
