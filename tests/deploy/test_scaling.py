"""The ECS layer's scaling: the policies as the template writes them, run by benchmarks/scaling_sim.py over
a burst of 100 jobs, a trickle and a silence, in simulated time, against the targets docs/operations.md
"Scaling" states:

- no overshoot: a scale-out never asks for more tasks than the jobs wanted within the metrics' lag;
- no idle tail: zero tasks within 5 minutes of the last job's end (it was 15 datapoints plus 900 s);
- idle GPU-minutes (tasks running without a job) at most 6 per job completed: a freed task waits for
  the scale-in's 3 datapoints and the metrics' 2-minute lag, not 15 datapoints and a cooldown."""

from __future__ import annotations

import math

import pytest

from benchmarks import scaling_sim
from tests.deploy.cfn import Resolver, load_template
from tests.deploy.test_ecs_layer import ECS_PARAMS

TAIL_TARGET_MINUTES = 5
IDLE_TARGET_PER_JOB = 6


@pytest.fixture(scope="module")
def stack():
    return Resolver(load_template(), **ECS_PARAMS)


@pytest.mark.parametrize("max_tasks", [None, "128"])
def test_the_template_s_policies_neither_overshoot_nor_linger(max_tasks):
    """At the template's MaxWorkerTasks (8) and at 128 (the burst fits), the simulated fleet never wants
    a task beyond the backlog, is at zero within 5 minutes of the last job, and idles little."""
    alarms, cap = scaling_sim.read_template(**({} if max_tasks is None else {"MaxWorkerTasks": max_tasks}))
    assert len(alarms) == 2  # one scale-out, one scale-in
    result = scaling_sim.simulate(alarms, cap)
    assert sum(result.busy) and result.zero_at is not None
    assert result.peak_overshoot <= 0, scaling_sim.report(result, "overshoot", trace=True)
    assert result.tail_minutes <= TAIL_TARGET_MINUTES
    assert result.idle_gpu_minutes <= IDLE_TARGET_PER_JOB * result.jobs_done
    assert result.jobs_done == sum(scaling_sim.arrivals().values())
    assert max(result.desired) == min(cap, max(result.wanted))  # it does reach what the burst wants


def test_the_policy_before_issue_29_misses_the_targets():
    """The same simulation, with the previous target tracking on running tasks, overshoots to the
    maximum and lingers: the targets tell the two apart."""
    alarms, cap = scaling_sim.read_template(MaxWorkerTasks="128")
    result = scaling_sim.simulate(alarms, cap, before=True)
    assert max(result.desired) == cap and result.peak_overshoot > 0
    assert result.tail_minutes > TAIL_TARGET_MINUTES
    assert result.idle_gpu_minutes > IDLE_TARGET_PER_JOB * result.jobs_done


def test_the_simulation_is_deterministic():
    """Simulated time only: two runs give the same figures."""
    alarms, cap = scaling_sim.read_template()
    first, second = scaling_sim.simulate(alarms, cap), scaling_sim.simulate(alarms, cap)
    assert (first.desired, first.idle_gpu_minutes) == (second.desired, second.idle_gpu_minutes)


def test_the_scale_out_cooldown_covers_a_new_instance_s_boot_and_pull(stack):
    """The scale-out cooldown is at least what the simulation takes for a task to run on a new
    instance (boot, registration, the production image's pull)."""
    policy = stack.resource("ScaleOutPolicy")["StepScalingPolicyConfiguration"]
    assert int(policy["Cooldown"]) >= scaling_sim.START_MINUTES * 60


@pytest.mark.parametrize("policy_id,sign", [("ScaleOutPolicy", 1), ("ScaleInPolicy", -1)])
def test_each_step_changes_the_count_by_at_most_the_excess_and_at_most_64(stack, policy_id, sign):
    """For every excess of 1 to 300 tasks, the step is between 1 and the excess (never more than is
    wanted, so never an overshoot), exact up to 8, and bounded by 64."""
    alarm_id = {"ScaleOutPolicy": "WorkersWantedAlarm", "ScaleInPolicy": "WorkersSurplusAlarm"}[policy_id]
    alarm = stack.resource(alarm_id)
    config = stack.resource(policy_id)["StepScalingPolicyConfiguration"]
    policy = scaling_sim.Policy([(scaling_sim._number(s.get("MetricIntervalLowerBound")),
                                  scaling_sim._number(s.get("MetricIntervalUpperBound")),
                                  int(s["ScalingAdjustment"])) for s in config["StepAdjustments"]], 0)
    for excess in range(1, 301):
        step = sign * policy.adjustment(sign * excess, float(alarm["Threshold"]))
        assert 1 <= step <= min(excess, 64), (excess, step)
        if excess <= 8:
            assert step == excess
    assert config["AdjustmentType"] == "ChangeInCapacity"


@pytest.mark.parametrize("visible,inflight,desired,excess", [
    (0, 0, None, 0), (3, 0, None, 3), (3, 2, 5, 0), (3, 2, 2, 3), (0, 1, 4, -3), (0, 0, 4, -4)])
def test_the_excess_counts_pending_tasks_as_asked_for(stack, visible, inflight, desired, excess):
    """The alarms' metric: ceil(jobs / target) minus the desired count, which includes tasks still
    pending (booting, pulling); no datapoint counts as zero."""
    for alarm_id in ("WorkersWantedAlarm", "WorkersSurplusAlarm"):
        alarm = stack.resource(alarm_id)
        (result,) = [m for m in alarm["Metrics"] if m["ReturnData"]]
        names = {m["Id"]: m["MetricStat"]["Metric"]["MetricName"] for m in alarm["Metrics"] if "MetricStat" in m}
        assert names == {"visible": "ApproximateNumberOfMessagesVisible",
                         "inflight": "ApproximateNumberOfMessagesNotVisible", "desired": "DesiredTaskCount"}
        assert scaling_sim.metric_math(result["Expression"], visible=visible, inflight=inflight,
                                       desired=desired) == excess


def test_target_two_halves_the_tasks_wanted():
    """BacklogPerTaskTarget divides the jobs: 5 jobs at target 2 want 3 tasks."""
    stack = Resolver(load_template(), **ECS_PARAMS, BacklogPerTaskTarget="2")
    (result,) = [m for m in stack.resource("WorkersWantedAlarm")["Metrics"] if m["ReturnData"]]
    assert scaling_sim.metric_math(result["Expression"], visible=5, inflight=0, desired=0) == math.ceil(5 / 2)


def test_scale_in_waits_three_datapoints_and_scale_out_none(stack):
    """Scale-out acts on the first datapoint (also from zero: no separate scale-from-zero alarm);
    scale-in on three in a row, so the gap between a job's delete and the next receive stops nothing."""
    out, in_ = stack.resource("WorkersWantedAlarm"), stack.resource("WorkersSurplusAlarm")
    assert (out["EvaluationPeriods"], out["DatapointsToAlarm"]) == (1, 1)
    assert (in_["EvaluationPeriods"], in_["DatapointsToAlarm"]) == (3, 3)
    assert out["AlarmActions"] == [stack.resolve({"Ref": "ScaleOutPolicy"})]
    assert in_["AlarmActions"] == [stack.resolve({"Ref": "ScaleInPolicy"})]
    target = stack.resource("WorkerScalableTarget")
    assert (target["MinCapacity"], target["MaxCapacity"]) == (0, "8")
