"""The spot stop budget: from EC2's interruption notice to the message's release, within the two minutes
the notice gives, for every value the template allows, read from the template and the worker's own
settings and constants (docs/operations.md "The stop budget").

    notice -> seen by the worker's watch      SPOT_INTERRUPTION_CHECK_SECONDS + one look (token PUT and
                                              notice GET through the relay, each at most a connect and
                                              a read of worker/core/imds.py's TIMEOUT_S)
           -> checkpoint signal, grace        SHUTDOWN_GRACE_SECONDS (the stage checkpoints meanwhile)
           -> stage stop                      settings.stage_stop_grace_s (SIGTERM -> SIGKILL)
           -> final checkpoint push           pipeline/remote_work.py FINAL_PUSH_BUDGET_S
           -> release                         RELEASE_S: one ChangeMessageVisibility (stated allowance)
"""

from __future__ import annotations

import itertools

import pytest

from pipeline.remote_work import FINAL_PUSH_BUDGET_S
from tests.deploy.cfn import Resolver, load_template
from tests.deploy.files import REPO
from tests.deploy.test_ecs_layer import ECS_PARAMS, RELEASE_MARGIN_S, _container, _env
from worker.core import imds
from worker.settings import SPOT_NOTICE_S, load_settings

# One SQS call that normally answers in tens of milliseconds; the worker gives it no bound of its own
# (docs/operations.md "The stop budget" says so).
RELEASE_S = RELEASE_MARGIN_S
# Two requests (the token, the notice), each a connect and a read of at most TIMEOUT_S.
LOOK_S = 2 * 2 * imds.TIMEOUT_S


def _param(name: str) -> dict:
    return load_template()["Parameters"][name]


def budget_s(env: dict[str, str]) -> dict[str, float]:
    settings = load_settings({k: env[k] for k in
                              ("SHUTDOWN_GRACE_SECONDS", "SPOT_INTERRUPTION_CHECK_SECONDS", "IMDS_ENDPOINT")})
    assert settings.spot_interruption_check_s > 0, "no spot watch: SIGTERM would come only after the drain"
    return {"seen": settings.spot_interruption_check_s + LOOK_S, "grace": settings.shutdown_grace_s,
            "stage stop": settings.stage_stop_grace_s, "final push": FINAL_PUSH_BUDGET_S,
            "release": RELEASE_S}


def _values(name: str) -> list[str]:
    spec = _param(name)
    return sorted({str(spec["Default"]), str(spec.get("MaxValue", spec["Default"])), str(spec["MinValue"])})


@pytest.mark.parametrize(("grace", "check"), list(itertools.product(
    _values("ShutdownGraceSeconds"), _values("SpotCheckSeconds"))))
def test_every_allowed_grace_and_check_fit_the_two_minutes_from_the_notice(grace, check):
    """For the template's default, smallest and largest grace and check interval, notice to release
    takes at most 120 s."""
    stack = Resolver(load_template(), **ECS_PARAMS, ShutdownGraceSeconds=grace, SpotCheckSeconds=check)
    parts = budget_s(_env(_container(stack, "WorkerTaskDefinition")))
    assert sum(parts.values()) <= SPOT_NOTICE_S == 120, parts


def test_the_largest_grace_is_what_the_budget_leaves():
    """ShutdownGraceSeconds' MaxValue is the budget's remainder at the largest check interval, rounded
    down: a larger one would not fit, a much smaller one would waste the notice."""
    stack = Resolver(load_template(), **ECS_PARAMS, ShutdownGraceSeconds="0",
                     SpotCheckSeconds=str(_param("SpotCheckSeconds")["MaxValue"]))
    parts = budget_s(_env(_container(stack, "WorkerTaskDefinition")))
    left_s = SPOT_NOTICE_S - sum(parts.values())
    assert int(_param("ShutdownGraceSeconds")["MaxValue"]) == int(left_s)


def test_the_standalone_task_definition_fits_the_budget_too():
    """config/ecs-task-definition.json has the watch on and a grace that fits."""
    import json

    container = json.loads((REPO / "config" / "ecs-task-definition.json").read_text())["containerDefinitions"][0]
    env = {pair["name"]: pair["value"] for pair in container["environment"]}
    assert sum(budget_s(env).values()) <= SPOT_NOTICE_S


def test_stop_timeout_still_covers_a_plain_sigterm():
    """A SIGTERM without a notice (a deploy, a scale-in, the agent's drain) gets the same sequence
    after the grace within stopTimeout."""
    stack = Resolver(load_template(), **ECS_PARAMS, ShutdownGraceSeconds=str(_param("ShutdownGraceSeconds")["MaxValue"]))
    container = _container(stack, "WorkerTaskDefinition")
    parts = budget_s(_env(container))
    assert sum(parts.values()) - parts["seen"] <= container["StopTimeout"] <= 120


def test_docs_state_the_budget():
    """docs/operations.md states the budget with these numbers."""
    text = (REPO / "docs" / "operations.md").read_text()
    stack = Resolver(load_template(), **ECS_PARAMS)
    parts = budget_s(_env(_container(stack, "WorkerTaskDefinition")))
    total = sum(parts.values())
    assert f"{total:g} s" in text, total
    assert f"at most {_param('ShutdownGraceSeconds')['MaxValue']}" in text
