"""The pipeline config's [quality] table (the evaluation report and its gate) and [pipeline] stand_in."""

from __future__ import annotations

import pytest

from pipeline.config import QualityConfig, QualityGate, parse_pipeline_config
from tests.pipeline.test_config import good_config
from worker.core.errors import ConfigError


def with_eval(**tables) -> dict:
    config = good_config()
    config["stages"].append({"name": "evaluate", "argv": ["{python}", "-m", "x", "{output_dir}"],
                             "outputs": ["eval/quality.json"]})
    config.update(tables)
    return config


def test_no_tables_no_report_and_no_stand_in():
    config = parse_pipeline_config(good_config())
    assert config.quality is None and config.stand_in is False


def test_a_report_with_a_gate():
    config = parse_pipeline_config(with_eval(quality={
        "report": "./eval/quality.json",
        "gate": {"min_speaker_similarity": 0.7, "max_cer": 0.3, "min_dnsmos_ovrl": 3, "require_sanity": True}}))
    assert config.quality == QualityConfig("eval/quality.json", QualityGate(0.7, 0.3, 3.0, True))


def test_a_report_without_a_gate_is_report_only():
    config = parse_pipeline_config(with_eval(quality={"report": "eval/quality.json"}))
    assert config.quality == QualityConfig("eval/quality.json", None)


def test_a_gate_with_some_bars_applies_only_those():
    config = parse_pipeline_config(with_eval(quality={"report": "eval/quality.json", "gate": {"max_cer": 0.5}}))
    assert config.quality is not None and config.quality.gate == QualityGate(max_cer=0.5)


def test_stand_in():
    assert parse_pipeline_config(good_config() | {"pipeline": {"stand_in": True}}).stand_in is True


@pytest.mark.parametrize(("tables", "says"), [
    ({"quality": {"report": "eval/other.json"}}, "quality.report: 'eval/other.json' is not among any stage's outputs"),
    ({"quality": {"report": "../quality.json"}}, "quality.report: '../quality.json' escapes the output dir"),
    ({"quality": {}}, "quality.report: must be a string path"),
    ({"quality": {"report": "eval/quality.json", "bar": 1}}, "quality: unknown key 'bar'"),
    ({"quality": {"report": "eval/quality.json", "gate": {"min_speaker_similarity": 2}}},
     "quality.gate.min_speaker_similarity: must be a number -1..1, got 2"),
    ({"quality": {"report": "eval/quality.json", "gate": {"max_cer": -0.1}}},
     "quality.gate.max_cer: must be a number at least 0, got -0.1"),
    ({"quality": {"report": "eval/quality.json", "gate": {"min_dnsmos_ovrl": True}}},
     "quality.gate.min_dnsmos_ovrl: must be a number 1..5, got True"),
    ({"quality": {"report": "eval/quality.json", "gate": {"require_sanity": "yes"}}},
     "quality.gate.require_sanity must be true or false"),
    ({"quality": {"report": "eval/quality.json", "gate": {"min_cer": 0.1}}}, "quality.gate: unknown key 'min_cer'"),
    ({"quality": "eval/quality.json"}, "quality must be a table"),
    ({"pipeline": {"stand_in": "yes"}}, "pipeline.stand_in must be true or false"),
    ({"pipeline": {"standin": True}}, "pipeline: unknown key 'standin'"),
])
def test_each_problem_is_one_line(tables, says):
    with pytest.raises(ConfigError) as caught:
        parse_pipeline_config(with_eval(**tables))
    assert any(line.startswith(f"pipeline config: {says}") for line in caught.value.problems), caught.value.problems
