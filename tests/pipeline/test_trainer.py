"""The reference trainer: real deterministic outputs, checkpoints and resume, exit codes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipeline.config import StageSpec
from pipeline.dataset import build_dataset
from pipeline.reference_trainer import (
    EXIT_MISSING_INPUT,
    EXIT_UNUSABLE_DATA,
    decode_arrays,
    encode_arrays,
)
from pipeline.stages import StageContext, run_stage
from tests.pipeline.test_dataset import write_inputs
from worker.core.errors import Stopped
from worker.core.stop import StopSignal

REPO = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^step \d+/\d+ loss", re.MULTILINE)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trainer")
    inputs = write_inputs(root / "in")
    build_dataset([(p, t) for p, t, _ in inputs], root / "ds")
    return root / "ds"


def train(mode: str, dataset: Path, out: Path, ckpt: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pipeline.reference_trainer", mode, "--dataset", str(dataset),
            "--out", str(out), "--checkpoints", str(ckpt), "--language", "en", *extra]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)


def train_all(dataset: Path, root: Path) -> dict[str, bytes]:
    for mode, out, extra in [("embed", "full", ()), ("full", "full", ()),
                             ("light", "light", ("--full-model", str(root / "full/model.pth")))]:
        done = train(mode, dataset, root / out, root / f"ckpt-{mode}", *extra)
        assert done.returncode == 0, done.stderr
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "ckpt" not in p.parts[-2]}


def full_stage(ckpt_steps: int, delay_s: float) -> StageSpec:
    return StageSpec(
        name="train_full",
        argv=("{python}", "-m", "pipeline.reference_trainer", "full", "--dataset", "{dataset_dir}",
              "--out", "{output_dir}/full", "--checkpoints", "{checkpoint_dir}",
              "--steps", str(ckpt_steps), "--step-delay-s", str(delay_s)),
        outputs=("full/model.pth", "full/config.json"),
        resumable=True,
        permanent_exit_codes=frozenset({65}),
    )


def context(dataset: Path, root: Path) -> StageContext:
    return StageContext(dataset_dir=dataset, output_dir=root / "output", checkpoints_root=root / "ckpt",
                        log_dir=root / "logs", job_id="j", language="en")


def test_same_input_gives_byte_identical_artifacts(dataset, tmp_path):
    """Two independent runs over the same dataset produce byte-for-byte the same five files."""
    first = train_all(dataset, tmp_path / "one")
    second = train_all(dataset, tmp_path / "two")
    assert sorted(first) == ["full/config.json", "full/model.pth", "full/speakers.pth",
                             "light/model.onnx", "light/model.onnx.json"]
    assert first == second


def test_array_files_do_not_depend_on_the_clock(monkeypatch):
    """Model files written at different times are byte-identical (no zip timestamps leak in)."""
    arrays = {"b": np.arange(3.0), "a": np.array("text"), "step": np.array(7)}
    monkeypatch.setattr("time.time", lambda: 1_000_000_000.0)
    first = encode_arrays(arrays)
    monkeypatch.setattr("time.time", lambda: 1_700_000_000.0)
    assert encode_arrays(arrays) == first
    decoded = decode_arrays(first)
    assert str(decoded["a"]) == "text" and int(decoded["step"]) == 7


def test_artifacts_hold_real_derived_values(dataset, tmp_path):
    """The embedding is unit length, the full model is a float predictor, the light one int8."""
    files = train_all(dataset, tmp_path)
    speakers = decode_arrays(files["full/speakers.pth"])
    assert np.linalg.norm(speakers["embedding"]) == pytest.approx(1.0, rel=1e-5)
    assert int(speakers["utterances"]) == 3
    model = decode_arrays(files["full/model.pth"])
    assert model["weights"].shape == (81, 80) and np.any(model["weights"] != 0)
    light = decode_arrays(files["light/model.onnx"])
    assert light["weights_int8"].dtype == np.int8 and light["weights_int8"].shape == (21, 20)
    config = json.loads(files["full/config.json"])
    assert config["language"] == "en" and config["audio"]["sample_rate"] == 22_050
    assert config["training"]["final_loss"] < 1.0  # standardised targets start at a loss of ~1


def test_stopped_training_resumes_from_checkpoint_with_fewer_steps(dataset, tmp_path):
    """Kill the trainer mid-run, run again: it resumes, runs fewer steps, and ends identical to a fresh run."""
    steps = 30
    ctx = context(dataset, tmp_path / "resumed")
    stop = StopSignal()

    def stop_halfway(stage, percent):
        if percent >= 50:
            stop.set("shutdown")

    with pytest.raises(Stopped):
        run_stage(full_stage(steps, 0.05), ctx, stop, stop_halfway, grace_s=2.0)
    assert list((tmp_path / "resumed/ckpt/train_full").glob("ckpt-*.npz"))
    assert not (ctx.output_dir / "full/model.pth").exists()

    resumed = run_stage(full_stage(steps, 0.0), ctx, StopSignal(), lambda s, p: None)
    resumed_log = resumed.log_path.read_text()
    fresh_ctx = context(dataset, tmp_path / "fresh")
    fresh = run_stage(full_stage(steps, 0.0), fresh_ctx, StopSignal(), lambda s, p: None)
    fresh_steps = len(STEP_LINE.findall(fresh.log_path.read_text()))
    resumed_steps = len(STEP_LINE.findall(resumed_log))

    assert "resumed from checkpoint at step" in resumed_log
    assert fresh_steps == steps
    assert 0 < resumed_steps <= steps // 2 + 1
    assert (ctx.output_dir / "full/model.pth").read_bytes() == (
        fresh_ctx.output_dir / "full/model.pth"
    ).read_bytes()


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(dataset, tmp_path):
    """A torn newest checkpoint is discarded and training resumes from the one before it."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    assert train("full", dataset, out, ckpt, "--steps", "6").returncode == 0
    newest = ckpt / "ckpt-000006.npz"
    newest.write_bytes(newest.read_bytes()[:100])
    again = train("full", dataset, out, ckpt, "--steps", "6")
    assert again.returncode == 0, again.stderr
    assert "resumed from checkpoint at step 5" in again.stdout
    assert len(STEP_LINE.findall(again.stdout)) == 1


def test_checkpoints_from_other_data_are_not_resumed(dataset, tmp_path):
    """Checkpoints made for a different dataset are ignored and training starts over."""
    other = tmp_path / "other"
    shutil.copytree(dataset, other)
    (other / "metadata.csv").write_text(
        "\n".join((other / "metadata.csv").read_text().split("\n")[:2]) + "\n", encoding="utf-8"
    )
    ckpt = tmp_path / "ckpt"
    assert train("full", dataset, tmp_path / "a", ckpt, "--steps", "4").returncode == 0
    run = train("full", other, tmp_path / "b", ckpt, "--steps", "4")
    assert run.returncode == 0 and "resumed" not in run.stdout
    assert len(STEP_LINE.findall(run.stdout)) == 4


def _no_metadata(ds: Path) -> None:
    (ds / "metadata.csv").unlink()


def _bad_row(ds: Path) -> None:
    (ds / "metadata.csv").write_text("utt00000|only two\n", encoding="utf-8")


def _missing_wav(ds: Path) -> None:
    (ds / "wavs/utt00001.wav").unlink()


def _wrong_rate(ds: Path) -> None:
    sf.write(ds / "wavs/utt00000.wav", np.full(8_000, 0.1), 8_000, subtype="PCM_16")


def _empty_metadata(ds: Path) -> None:
    (ds / "metadata.csv").write_text("", encoding="utf-8")


def _not_utf8(ds: Path) -> None:
    (ds / "metadata.csv").write_bytes(b"utt00000|\xff\xfe|x\n")


@pytest.mark.parametrize("mode", ["embed", "full"])
@pytest.mark.parametrize(
    "damage", [_no_metadata, _bad_row, _missing_wav, _wrong_rate, _empty_metadata, _not_utf8],
    ids=["no-metadata", "bad-row", "missing-wav", "wrong-rate", "no-wavs", "not-utf8"],
)
def test_unusable_data_exits_65(dataset, tmp_path, damage, mode):
    """Missing or malformed metadata and unusable WAVs end the trainer with exit code 65 and no output."""
    broken = tmp_path / "ds"
    shutil.copytree(dataset, broken)
    damage(broken)
    done = train(mode, broken, tmp_path / "out", tmp_path / "ckpt")
    assert done.returncode == EXIT_UNUSABLE_DATA, done.stderr
    assert "unusable data" in done.stderr
    assert not any(p.is_file() for p in (tmp_path / "out").rglob("*"))


def test_light_without_full_model_exits_66(dataset, tmp_path):
    """The light mode needs its teacher; without it the exit is the retryable 66, not 65."""
    done = train("light", dataset, tmp_path / "out", tmp_path / "ckpt",
                 "--full-model", str(tmp_path / "absent.pth"))
    assert done.returncode == EXIT_MISSING_INPUT
