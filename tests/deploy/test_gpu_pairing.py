"""The GPU host and the production image, paired in config/gpu-pairing.toml: the template boots the AMI it
names, the trainer lock holds the torch and the CUDA major it names, and that CUDA major runs on the
driver minimum it and docs/operations.md state (NVIDIA's minor version compatibility). Nothing here
installs a CUDA torch."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.deploy.cfn import load_template
from tests.deploy.files import REPO, read_dockerfile

PAIRING = tomllib.loads((REPO / "config" / "gpu-pairing.toml").read_text())
LOCK = REPO / "requirements" / "trainers.lock"
OPERATIONS = REPO / "docs" / "operations.md"
# NVIDIA's CUDA minor version compatibility (CUDA Toolkit release notes, "CUDA Toolkit and
# Corresponding Driver Versions"): the oldest driver branch that runs every toolkit of a major. Kept
# here as well, so a pairing file that edits its own table to fit fails.
NVIDIA_MINIMUM_DRIVER = {12: 525, 13: 580}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock() -> dict[str, dict]:
    """Each pinned requirement of the lock: its version and its hashes."""
    pins: dict[str, dict] = {}
    current = None
    for line in LOCK.read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)==([^\s\\;]+)", line):
            current = pins.setdefault(_normalized(match.group(1)), {"version": match.group(2), "hashes": []})
        elif current is not None and (found := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            current["hashes"].append(found.group(1))
    return pins


def _cuda_major_of_lock(pins: dict[str, dict]) -> int:
    runtime = pins[_normalized(PAIRING["torch"]["cuda_runtime_package"])]["version"]
    return int(runtime.split(".")[0])


def test_the_pairing_file_carries_nvidias_table():
    """The file's CUDA-major -> driver table is NVIDIA's."""
    assert {int(k): v for k, v in PAIRING["cuda_driver_minimum"].items()} == NVIDIA_MINIMUM_DRIVER


def test_the_driver_minimum_runs_the_cuda_major_and_the_ami_ships_it():
    """The AMI's driver branch is at least the pairing's minimum, which is at least what the CUDA major
    needs."""
    host, torch = PAIRING["host"], PAIRING["torch"]
    assert host["driver_minimum"] >= NVIDIA_MINIMUM_DRIVER[torch["cuda_major"]]
    assert int(host["nvidia_driver_seen"].split(".")[0]) >= host["driver_minimum"]


def test_the_lock_holds_the_pairings_torch_and_cuda_major():
    """requirements/trainers.lock pins the pairing's torch (the PyPI build, no +cpu or +cuXXX local
    version) and CUDA runtime packages of the pairing's CUDA major only, so the driver minimum holds
    for what the image installs."""
    pins = _lock()
    assert pins["torch"]["version"] == PAIRING["torch"]["version"]
    assert _cuda_major_of_lock(pins) == PAIRING["torch"]["cuda_major"]
    assert NVIDIA_MINIMUM_DRIVER[_cuda_major_of_lock(pins)] <= PAIRING["host"]["driver_minimum"]
    majors = {int(m.group(1)) for name in pins if (m := re.fullmatch(r"nvidia-.*-cu(\d+)", name))}
    assert majors == {PAIRING["torch"]["cuda_major"]}


def test_the_lock_is_hashed_throughout():
    """Every pin carries at least one SHA-256, as --require-hashes needs."""
    pins = _lock()
    assert pins and not sorted(name for name, pin in pins.items() if not pin["hashes"])


def test_the_lock_covers_every_trainer_dependency():
    """Every dependency trainers/pyproject.toml declares is in the lock: one added without
    scripts/lock-trainers.sh fails here, not in the image build."""
    project = tomllib.loads((REPO / "trainers" / "pyproject.toml").read_text())["project"]
    names = {_normalized(re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]) for dep in project["dependencies"]}
    assert not sorted(names - set(_lock()))


def test_the_template_boots_the_paired_ami():
    """GpuAmiId's default is the pairing's SSM parameter."""
    param = load_template()["Parameters"]["GpuAmiId"]
    assert param["Default"] == PAIRING["host"]["ami_ssm_parameter"]


def test_dev_installs_and_constraints_pin_the_same_torch():
    """scripts/install-trainers.sh's dev install and trainers/constraints.txt pin the pairing's torch
    version (the dev loop gets the CPU wheel of it)."""
    version = PAIRING["torch"]["version"]
    script = (REPO / "scripts" / "install-trainers.sh").read_text()
    assert set(re.findall(r"torch==([0-9][^\s'\"]*)", script)) == {version}
    constraints = (REPO / "trainers" / "constraints.txt").read_text()
    assert re.findall(r"^torch==(\S+)$", constraints, re.MULTILINE) == [version]


def test_the_production_image_installs_the_lock_with_hashes():
    """Dockerfile.trainer copies requirements/ and runs the install script in prod mode, whose prod
    branch installs requirements/trainers.lock with --require-hashes and resolves nothing."""
    dockerfile = read_dockerfile(REPO / "Dockerfile.trainer")
    copied = " ".join(i.args for i in dockerfile if i.keyword == "COPY")
    assert "requirements/" in copied
    runs = " ".join(i.args for i in dockerfile if i.keyword == "RUN")
    assert "scripts/install-trainers.sh python /opt/trainers prod" in runs
    script = (REPO / "scripts" / "install-trainers.sh").read_text()
    prod = script[script.index("\nelse\n"):script.index("\nfi\n", script.index("\nelse\n"))]
    assert "--require-hashes --no-deps -r requirements/trainers.lock" in prod
    assert "--no-deps --no-build-isolation ./trainers" in prod
    assert "-c trainers/constraints.txt" not in prod


@pytest.mark.parametrize("fact", [
    lambda: PAIRING["host"]["ami_ssm_parameter"],
    lambda: f"| driver minimum | {PAIRING['host']['driver_minimum']} |",
    lambda: f"| CUDA major | {PAIRING['torch']['cuda_major']} |",
    lambda: f"torch | {PAIRING['torch']['version']} from PyPI, the CUDA {PAIRING['torch']['cuda_major']}.",
    lambda: "CUDA 12.x needs 525 or later, CUDA 13.x 580 or later",
])
def test_the_docs_state_the_pairing(fact):
    """docs/operations.md "The GPU pairing" states the file's AMI, driver minimum, torch and CUDA major,
    and NVIDIA's table."""
    assert fact() in " ".join(OPERATIONS.read_text().split())
