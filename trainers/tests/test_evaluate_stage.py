"""``python -m voice_trainers evaluate``: the stage, end to end on a ci model trained here (a few minutes).

A 16-clip espeak-ng dataset is trained with the ci profile (``full``, then ``light``), then the stage scores
both models: the report has exactly the shape the worker's gate reads, a NOTE line and PROGRESS lines,
and it runs with the Hugging Face hub switched off (everything loads from wheels).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dataset import make_dataset  # noqa: E402
from voice_trainers.dataset import read_metadata  # noqa: E402
from voice_trainers.evaluate import SENTENCES_PER_PROFILE  # noqa: E402
from voice_trainers.sentences import held_out  # noqa: E402

TRAINERS = Path(__file__).resolve().parents[1]
MODEL_KEYS = {"speaker_similarity", "cer", "wer", "asr", "asr_unavailable", "dnsmos", "sanity"}
SANITY_KEYS = {"ok", "problems", "rms_dbfs", "peak_dbfs", "clipped_fraction", "seconds_per_char"}


def stage(mode: str, root: Path, *extra: str, language: str = "en", out: str | None = None,
          timeout: int = 900) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "voice_trainers", mode, "--dataset", str(root / "dataset"),
            "--out", str(root / "output" / (out or mode)), "--checkpoints", str(root / "checkpoints" / mode),
            "--language", language, "--profile", "ci", *extra]
    # The worker's allow-list, and no way to the network's model hubs.
    env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "TMPDIR", "OMP_NUM_THREADS") if key in os.environ}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=TRAINERS, env=env)


def evaluate_args(root: Path) -> list[str]:
    return ["--full-model", str(root / "output" / "full" / "model.pth"),
            "--light-model", str(root / "output" / "light" / "model.onnx")]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    make_dataset(root / "dataset")
    full = stage("full", root)
    assert full.returncode == 0, full.stderr[-3000:]
    light = stage("light", root, "--full-model", str(root / "output" / "full" / "model.pth"))
    assert light.returncode == 0, light.stderr[-3000:]
    result = stage("evaluate", root, *evaluate_args(root), out="eval")
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((root / "output" / "eval" / "quality.json").read_text(encoding="utf-8"))
    return root, result, report


def check_entry(entry: dict) -> None:
    assert set(entry) == MODEL_KEYS
    assert -1.0 <= entry["speaker_similarity"] <= 1.0
    assert entry["asr"].startswith("pocketsphinx 5.1.1 en-us") and entry["asr_unavailable"] is None
    assert entry["cer"] >= 0 and entry["wer"] >= 0
    assert set(entry["dnsmos"]) == {"ovrl", "sig", "bak"}
    assert all(1.0 <= v <= 5.0 for v in entry["dnsmos"].values())
    assert set(entry["sanity"]) == SANITY_KEYS and entry["sanity"]["ok"] == (entry["sanity"]["problems"] == [])
    for value in (entry["speaker_similarity"], entry["cer"], *entry["dnsmos"].values()):
        assert math.isfinite(value)


def test_the_report_has_the_shape_the_gate_reads(job):
    _root, _result, report = job
    assert set(report) == {"version", "language", "sentences", "models", "reference", "cost"}
    assert report["version"] == 1 and report["language"] == "en"
    assert set(report["models"]) == {"full", "light"}
    for entry in (*report["models"].values(), report["reference"]):
        check_entry(entry)
    assert set(report["cost"]) == {"cpu_s", "wall_s", "peak_rss_mib"}
    assert report["cost"]["cpu_s"] > 0 and report["cost"]["wall_s"] > 0 and report["cost"]["peak_rss_mib"] > 100


def test_the_models_speak_held_out_sentences_never_the_jobs_transcripts(job):
    root, _result, report = job
    assert report["sentences"] == held_out("en-us", SENTENCES_PER_PROFILE["ci"])
    assert not {text for _uid, text in read_metadata(root / "dataset")} & set(report["sentences"])


def test_the_reference_is_the_jobs_own_voice_and_scores_as_speech(job):
    """The recordings (espeak-ng) are sane speech, well transcribed and close to their own speaker."""
    reference = job[2]["reference"]
    assert reference["speaker_similarity"] > 0.8
    assert reference["cer"] < 0.7
    assert reference["sanity"]["ok"]


def test_a_note_line_sums_up_and_progress_rises_to_100(job):
    _root, result, report = job
    notes = [line for line in result.stdout.splitlines() if line.startswith("NOTE quality")]
    assert len(notes) == 1 and len(notes[0]) <= 500
    full = report["models"]["full"]
    assert f"full: similarity {full['speaker_similarity']:.2f}, cer {full['cer']:.2f}" in notes[0]
    assert "light: similarity" in notes[0] and "reference: similarity" in notes[0]
    progress = [float(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("PROGRESS ")]
    assert progress == sorted(progress) and progress[0] == 0 and progress[-1] == 100


def test_a_language_without_held_out_sentences_exits_65(job):
    root = job[0]
    result = stage("evaluate", root, *evaluate_args(root), language="ja", out="eval-ja", timeout=300)
    assert result.returncode == 65
    assert "no held-out sentences for espeak-ng voice 'ja'" in result.stderr
    assert not (root / "output" / "eval-ja" / "quality.json").exists()


def test_a_missing_model_is_retried_not_permanent(job):
    root = job[0]
    argv = ["--full-model", str(root / "output" / "full" / "model.pth"),
            "--light-model", str(root / "output" / "light" / "absent.onnx")]
    result = stage("evaluate", root, *argv, out="eval-missing", timeout=300)
    assert result.returncode not in (0, 65)
    assert "absent.onnx is missing" in result.stderr


def test_evaluate_needs_both_models():
    result = subprocess.run([sys.executable, "-m", "voice_trainers", "evaluate", "--dataset", "/d", "--out", "/o",
                             "--checkpoints", "/c", "--language", "en", "--full-model", "/m.pth"],
                            capture_output=True, text=True, timeout=60, cwd=TRAINERS)
    assert result.returncode == 2 and "evaluate needs --full-model and --light-model" in result.stderr
