"""The stage command line: its argv, its environment, and exit 65 before any heavy import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from voice_trainers.cli import parse_args, resolve_profile, stage_environment
from voice_trainers.profiles import PROFILES
from voice_trainers.threads import torch_threads

from tests.trainers.conftest import TRAINERS_DIR
from tests.trainers.test_dataset import write_dataset


def run_stage(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The stage as the worker runs it: a new process, `python -m voice_trainers`, cwd elsewhere."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(TRAINERS_DIR), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "voice_trainers", *argv], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=60)


def stage_argv(mode: str, root: Path, *extra: str, language: str = "en") -> list[str]:
    return [mode, "--dataset", str(root / "dataset"), "--out", str(root / "out"),
            "--checkpoints", str(root / "ck"), "--language", language, "--profile", "ci", *extra]


def test_the_reference_trainers_argv_shape_parses(tmp_path):
    """mode, --dataset, --out, --checkpoints, --language, --profile and --steps are read as given."""
    args = parse_args(stage_argv("full", tmp_path, "--steps", "3"))
    assert (args.mode, args.dataset, args.out, args.checkpoints, args.language, args.profile, args.steps) == (
        "full", tmp_path / "dataset", tmp_path / "out", tmp_path / "ck", "en", "ci", 3)
    assert resolve_profile(args).total_steps == 3
    assert resolve_profile(parse_args(stage_argv("full", tmp_path))).total_steps == PROFILES["ci"].total_steps


@pytest.mark.parametrize("argv", [
    ["full", "--dataset", "rel/dataset", "--out", "/o", "--checkpoints", "/c", "--language", "en"],
    ["light", "--dataset", "/d", "--out", "/o", "--checkpoints", "/c", "--language", "en"],
    ["full", "--dataset", "/d", "--out", "/o", "--checkpoints", "/c", "--language", "en", "--steps", "0"],
    ["full", "--dataset", "/d", "--out", "/o", "--checkpoints", "/c", "--language", "en", "--profile", "huge"],
    ["train", "--dataset", "/d", "--out", "/o", "--checkpoints", "/c", "--language", "en"],
])
def test_a_bad_command_line_is_a_usage_error(argv, capsys):
    """A relative path, light without --full-model, zero steps, an unknown profile or mode exit 2."""
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2


def test_the_stage_is_offline_and_keeps_its_caches_in_the_checkpoint_dir(tmp_path):
    """The hub is off whatever the environment says, and numba/matplotlib write under the checkpoint dir."""
    env = stage_environment(tmp_path, {"HF_HUB_OFFLINE": "0"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert Path(env["NUMBA_CACHE_DIR"]).is_relative_to(tmp_path)
    assert Path(env["MPLCONFIGDIR"]).is_relative_to(tmp_path)
    assert "NUMBA_CACHE_DIR" not in stage_environment(tmp_path, {"NUMBA_CACHE_DIR": "/cache"})


@pytest.mark.parametrize(("value", "threads"), [("4", 4), ("1", 1), ("0", None), ("", None), ("many", None)])
def test_torch_threads_come_from_omp_num_threads(value, threads):
    """OMP_NUM_THREADS sets the intra-op threads; unset or nonsense lets torch decide."""
    assert torch_threads({"OMP_NUM_THREADS": value}) == threads
    assert torch_threads({}) is None


def test_a_language_without_an_espeak_voice_exits_65(tmp_path):
    """An unknown {language} is permanent: exit 65 with the reason on stderr."""
    write_dataset(tmp_path / "dataset", ["a", "b", "c", "d"])
    result = run_stage(*stage_argv("full", tmp_path, language="tlh"), tmp_path=tmp_path)
    assert result.returncode == 65
    assert "no espeak-ng voice for language 'tlh'" in result.stderr


@pytest.mark.parametrize("mode", ["embed", "full"])
def test_a_dataset_without_metadata_exits_65(tmp_path, mode):
    """A dataset folder with no metadata.csv fails for good in both stages that read it."""
    (tmp_path / "dataset").mkdir()
    result = run_stage(*stage_argv(mode, tmp_path), tmp_path=tmp_path)
    assert result.returncode == 65
    assert "unusable data: cannot read metadata.csv" in result.stderr


@pytest.mark.parametrize(("mode", "why"), [
    ("embed", "too little usable speech: 2.2 s recorded in all, at least 5 s needed"),
    ("full", "2 usable clips, at least 4 needed")])
def test_too_few_usable_clips_exit_65(tmp_path, mode, why):
    """Too little to train on (embed: less recorded than the minimum of speech; full: fewer clips than
    the minimum, the others too short) fails for good before torch loads."""
    write_dataset(tmp_path / "dataset", ["a", "b", "c", "d"], durations_s=[1, 1, 0.1, 0.1])
    result = run_stage(*stage_argv(mode, tmp_path), tmp_path=tmp_path)
    assert result.returncode == 65
    assert why in result.stderr


def test_the_torch_free_modules_import_nothing_heavy():
    """The modules the worker's tests and the stage's first checks use load no torch, Coqui or Resemblyzer."""
    code = ("import sys; import voice_trainers.cli, voice_trainers.full, voice_trainers.embed, voice_trainers.light,"
            " voice_trainers.piper_json; heavy = {'torch', 'TTS', 'resemblyzer', 'onnx', 'onnxruntime', 'librosa'};"
            " print(sorted(heavy & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(TRAINERS_DIR)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
