"""config/worker.env.example: every setting once, in settings.py's groups, with its true default."""

from __future__ import annotations

from dataclasses import MISSING

import pytest

from tests.deploy.files import REPO, read_env_example, settings_groups
from worker.settings import ENV_NAMES, FIELD_OF_ENV, daemon_problems, load_settings

EXAMPLE = REPO / "config" / "worker.env.example"
FIELD_OF = {env: f.name for env, f in FIELD_OF_ENV.items()}


@pytest.fixture(scope="module")
def example():
    return read_env_example(EXAMPLE)


def test_names_every_setting_exactly_once_and_nothing_else(example):
    """Each ENV_NAMES entry has one line, and no line names a variable the worker does not read."""
    lines, _ = example
    names = [line.name for line in lines]
    assert sorted(names) == sorted(ENV_NAMES)


def test_follows_the_order_and_groups_of_settings_py(example):
    """Names appear in settings.py's field order under the same ``# --- group`` headings."""
    lines, groups = example
    assert [line.name for line in lines] == list(ENV_NAMES)
    assert groups == settings_groups()


def test_every_line_has_a_one_line_meaning(example):
    """Each variable has a comment line right above it saying what it means."""
    lines, _ = example
    assert all(len(line.comment) > 10 for line in lines), [line.name for line in lines if not line.comment]


def test_commented_values_are_the_real_defaults(example):
    """Each ``#NAME=value`` shows exactly what Settings uses when NAME is unset."""
    lines, _ = example
    defaults = load_settings({})
    for line in (entry for entry in lines if not entry.active):
        field = FIELD_OF_ENV[line.name]
        if line.value == "":
            # Empty means unset: the default must be "nothing" (or computed, like WORKER_ID).
            assert field.default in (None, "") or field.default_factory is not MISSING, line.name
        else:
            shown = load_settings({line.name: line.value})
            assert getattr(shown, FIELD_OF[line.name]) == getattr(defaults, FIELD_OF[line.name]), line.name


def test_active_lines_are_exactly_the_required_settings(example):
    """Uncommented lines are marked REQUIRED, load as valid daemon settings, and each one is needed."""
    lines, _ = example
    active = {line.name: line.value for line in lines if line.active}
    assert all(line.comment.startswith("REQUIRED") for line in lines if line.active)
    assert not any(line.comment.startswith("REQUIRED") for line in lines if not line.active)
    assert daemon_problems(load_settings(active)) == []
    for name in active:
        without = {k: v for k, v in active.items() if k != name}
        assert daemon_problems(load_settings(without)), f"{name} is marked required but is not"
