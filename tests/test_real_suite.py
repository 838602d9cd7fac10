"""Where the real end-to-end suite runs: never in `make test`, always in `make test-real`, both in CI."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REAL_TESTS = REPO / "tests" / "real"


def _recipe(target: str) -> tuple[str, list[str]]:
    """A Makefile rule's prerequisites and its recipe lines."""
    makefile = (REPO / "Makefile").read_text()
    rule = re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n)*)", makefile, re.MULTILINE)
    assert rule, f"no rule for {target} in the Makefile"
    return rule.group(1), [line.strip() for line in rule.group(2).splitlines()]


def test_the_default_collection_skips_the_real_tests(pytestconfig):
    """pytest's own directory filter leaves tests/real out of `make test` and keeps every other test folder in."""
    def ignored(path: Path) -> bool:
        return bool(pytestconfig.hook.pytest_ignore_collect(collection_path=path, config=pytestconfig))

    assert ignored(REAL_TESTS)
    assert not [p.name for p in (REPO / "tests").iterdir() if p.is_dir() and p != REAL_TESTS
                and (p / "__init__.py").exists() and ignored(p)]


def test_test_real_builds_the_trainer_environment_then_runs_the_real_tests():
    """`make test-real` depends on the trainer virtualenv, runs pytest on tests/real with the worker's interpreter,
    then the trainers' own tests with theirs."""
    prerequisites, recipe = _recipe("test-real")
    assert "$(TRAINER_STAMP)" in prerequisites.split() and "$(STAMP)" in prerequisites.split()
    assert recipe == ["$(BIN)/python -m pytest -q tests/real", "cd trainers && .venv/bin/python -m pytest -q tests"]


def test_demo_real_builds_the_trainer_environment_then_runs_the_second_act():
    """`make demo-real` depends on the trainer virtualenv and runs `python -m worker demo --real`."""
    prerequisites, recipe = _recipe("demo-real")
    assert "$(TRAINER_STAMP)" in prerequisites.split()
    assert recipe == ["$(BIN)/python -m worker demo --real"]


def test_ci_runs_the_suite_then_the_real_tests_and_stops_at_the_first_failure():
    """.ci/run runs `make test`, then `make test-real`, under `set -e`."""
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert "set -euo pipefail" in lines
    assert [line for line in lines if line.startswith("make")] == ["make test", "make test-real"]
