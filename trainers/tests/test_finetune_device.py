"""The device a stage runs on (``--device``, else the profile's) and the probe, where torch sees no GPU.

    cd trainers && .venv/bin/python -m pytest -q tests/test_finetune_device.py

Asking for ``cuda`` where torch sees none exits 70 (the host is unfit) with one line saying what is missing,
before any training: never a silent run on the CPU. The stages run with ``CUDA_VISIBLE_DEVICES`` empty, so
a host with a GPU sees none either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from make_dataset import make_dataset
from voice_trainers.cli import parse_args, resolve_profile
from voice_trainers.device import EXIT_HOST_UNFIT, HostUnfit, select_device
from voice_trainers.probe import driver_version

PROBE_FIELDS = {"torch", "cuda_runtime", "cuda_available", "device_count", "driver_version", "cuda_driver_api",
                "device_name", "device_total_memory_bytes", "device_capability", "cudnn"}
WHY = (f"torch {torch.__version__} is a build without CUDA" if torch.version.cuda is None else
       f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees 0 CUDA device(s): no driver, no GPU,"
       f" or CUDA_VISIBLE_DEVICES hides it")
NO_CUDA = f"--device cuda asked for, but {WHY}; not training on the CPU instead"


def stage(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", "HOME": os.environ.get("HOME", "/root"),
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "voice_trainers", *argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=env, cwd="/", timeout=300)


def stage_argv(mode: str, root: Path, *extra: str, profile: str = "ci") -> list[str]:
    return [mode, "--dataset", str(root / "dataset"), "--out", str(root / "out"), "--checkpoints", str(root / "ck"),
            "--language", "en", "--profile", profile, *extra]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("device")
    make_dataset(root / "dataset", clips=4)
    return root


@pytest.mark.parametrize("mode", ["full", "embed"])
def test_cuda_asked_for_on_a_host_without_it_exits_70_before_any_work(dataset, mode):
    """full and embed exit 70 with one line naming what is missing; no step, no embedding, no output."""
    result = stage(*stage_argv(mode, dataset, "--device", "cuda"))
    assert result.returncode == EXIT_HOST_UNFIT == 70, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == f"host unfit: {NO_CUDA}"
    assert "step 1/" not in result.stdout and "VITS:" not in result.stdout and "wrote" not in result.stdout
    assert not list((dataset / "out").glob("*"))


def test_the_production_profile_asks_for_cuda_and_ci_for_the_cpu(tmp_path):
    """Without --device a stage runs where its profile says: production on cuda, ci on the CPU; --device wins."""
    assert resolve_profile(parse_args(stage_argv("full", tmp_path, profile="production"))).device == "cuda"
    assert resolve_profile(parse_args(stage_argv("embed", tmp_path, profile="production"))).device == "cuda"
    assert resolve_profile(parse_args(stage_argv("full", tmp_path))).device == "cpu"
    assert resolve_profile(parse_args(stage_argv("full", tmp_path, "--device", "cpu", profile="production"))
                           ).device == "cpu"
    with pytest.raises(SystemExit):
        parse_args(stage_argv("full", tmp_path, "--device", "tpu"))


def test_select_device_never_falls_back_to_the_cpu(monkeypatch):
    """cuda without CUDA raises HostUnfit; cpu is the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(HostUnfit, match="^" + NO_CUDA.replace("+", r"\+").replace("(", r"\(") + "$"):
        select_device(torch, "cuda")
    assert select_device(torch, "cpu") == torch.device("cpu")


def test_the_probe_prints_one_json_line_and_exits_0():
    """`python -m voice_trainers probe`: one line of JSON, every documented field, no CUDA here."""
    result = stage("probe")
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()
    report = json.loads(line)
    assert set(report) == PROBE_FIELDS
    assert report["cuda_available"] is False and report["device_count"] == 0
    assert report["torch"] == torch.__version__ and report["cuda_runtime"] == torch.version.cuda
    assert report["device_name"] is None and report["device_total_memory_bytes"] is None


@pytest.mark.parametrize(("text", "version"), [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n", "550.54.15"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.10  Release Build  (dvs-builder@U16)\n",
     "570.86.10"),
    ("garbage\n", None),
])
def test_the_driver_version_is_read_from_the_nvidia_kernel_module(tmp_path, text, version):
    """Both the proprietary and the open kernel module's banner; anything else (or no file) is None."""
    (tmp_path / "version").write_text(text)
    assert driver_version(tmp_path / "version") == version
    assert driver_version(tmp_path / "absent") is None
