"""config/pipeline.real.toml: a valid pipeline whose argv the trainer package accepts."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from voice_trainers.cli import parse_args

from pipeline.config import load_pipeline_config

REAL = Path(__file__).resolve().parents[2] / "config" / "pipeline.real.toml"
PLACEHOLDERS = {"{dataset_dir}": "/w/job/dataset", "{output_dir}": "/w/job/output",
                "{checkpoint_dir}": "/w/job/checkpoints/s", "{language}": "pt-BR", "{device}": "cuda"}


def test_the_real_pipeline_runs_the_four_trainer_stages():
    """embed, train_full, train_light, evaluate through {trainer_python} -m voice_trainers, 65 permanent, the five
    artifacts and the evaluation report the [quality] table names."""
    config = load_pipeline_config(REAL, trainer_python=sys.executable)
    assert [s.name for s in config.stages] == ["embed", "train_full", "train_light", "evaluate"]
    assert config.quality is not None and config.quality.report == "eval/quality.json"
    for stage, mode in zip(config.stages, ["embed", "full", "light", "evaluate"], strict=True):
        assert list(stage.argv[:4]) == ["{trainer_python}", "-m", "voice_trainers", mode]
        assert list(stage.permanent_exit_codes) == [65]
    outputs = [o for s in config.stages for o in s.outputs]
    assert sorted(outputs) == ["eval/quality.json", "full/config.json", "full/model.pth", "full/speakers.pth",
                               "light/model.onnx", "light/model.onnx.json", "prep/clips.tar", "prep/report.json"]


def test_embed_prepares_the_dataset_every_later_stage_reads():
    """embed reads the worker's dataset and writes prep/; train_full, train_light and evaluate read prep/."""
    stages = load_pipeline_config(REAL, trainer_python=sys.executable).stages
    datasets = {s.name: s.argv[list(s.argv).index("--dataset") + 1] for s in stages}
    assert datasets == {"embed": "{dataset_dir}", "train_full": "{output_dir}/prep",
                        "train_light": "{output_dir}/prep", "evaluate": "{output_dir}/prep"}
    embed = list(stages[0].argv)
    assert embed[embed.index("--prepared") + 1] == "{output_dir}/prep"


def test_the_gpu_stages_declare_cuda_and_pass_it_to_the_trainer():
    """embed and train_full declare device cuda and take --device {device}: never a silent CPU run."""
    stages = {s.name: s for s in load_pipeline_config(REAL, trainer_python=sys.executable).stages}
    for name in ("embed", "train_full"):
        assert stages[name].device == "cuda"
        argv = list(stages[name].argv)
        assert argv[argv.index("--device") + 1] == "{device}"


def test_only_train_full_resumes_and_takes_the_checkpoint_signal():
    """train_full keeps its checkpoints and gets SIGUSR1 on shutdown; the one-pass stages do neither."""
    stages = {s.name: s for s in load_pipeline_config(REAL, trainer_python=sys.executable).stages}
    assert stages["train_full"].resumable and stages["train_full"].checkpoint_signal == signal.SIGUSR1
    assert not stages["embed"].resumable and stages["embed"].checkpoint_signal is None
    assert not stages["train_light"].resumable and stages["train_light"].checkpoint_signal is None


def test_each_stage_argv_parses_in_the_trainer():
    """After substitution every stage's argv is a valid voice_trainers command line, in the production profile."""
    for stage in load_pipeline_config(REAL, trainer_python=sys.executable).stages:
        argv = []
        for arg in stage.argv[3:]:
            for placeholder, value in PLACEHOLDERS.items():
                arg = arg.replace(placeholder, value)
            argv.append(arg)
        args = parse_args(argv)
        assert args.profile == "production" and args.language == "pt-BR"
        assert str(args.out).startswith("/w/job/output/")


def test_the_production_pipeline_holds_every_model_to_the_measured_bars():
    """The shipped real pipeline gates both models on similarity, CER, DNSMOS and sanity: below a bar, no commit."""
    gate = load_pipeline_config(REAL, trainer_python=sys.executable).quality.gate
    assert gate is not None
    assert (gate.min_speaker_similarity, gate.max_cer, gate.min_dnsmos_ovrl, gate.require_sanity) == (
        0.75, 0.75, 2.3, True)
