"""The ECS layer's scaling, simulated in simulated time: the policies and alarms exactly as
config/cloudformation.yaml writes them, over a synthetic arrival curve (a burst, a trickle, a silence).

    .venv/bin/python benchmarks/scaling_sim.py                 # the template's defaults, then MaxWorkerTasks=128
    .venv/bin/python benchmarks/scaling_sim.py --max-tasks 8 --trace

What is read from the template (resolved with its parameter defaults): the alarms' metric-math expression,
threshold, comparison and datapoints to alarm; each policy's steps and cooldown; the scalable target's
maximum. What is modelled (stated, not measured; docs/operations.md "Scaling"):

- time moves in 60 s ticks; CloudWatch datapoints are METRIC_LAG_MINUTES late (the alarm at minute t
  reads the queue and the service as they were at t - 2: the period, then Container Insights' and
  SQS's publishing delay);
- an alarm in ALARM invokes its policy at every evaluation (Application Auto Scaling's behaviour);
  a step-scaling scale-out inside its cooldown adds only what exceeds the step that started the
  cooldown; a scale-in inside its cooldown does nothing;
- a new task runs START_MINUTES after it is asked for (an instance's boot and registration, and the
  production image's pull), then takes a visible job at once; a job takes JOB_MINUTES;
- scale-in stops pending tasks first, then idle ones; a task running a job is protected and stops when
  its job ends, if the service still has too many.

Figures: tasks over time, peak overshoot (at a scale-out, the tasks desired beyond the most the jobs
wanted within the metrics' lag), idle GPU-minutes (running tasks without a job, per job completed too), the tail
(minutes from the last job's end to zero tasks). No wall clock: the same input gives the same figures.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.deploy.cfn import Resolver, load_template  # noqa: E402 - after the path

ECS_PARAMS = {"CreateEcsLayer": "true", "SubnetIds": "subnet-0a1b2c3d", "SecurityGroupIds": "sg-0a1b2c3d",
              "ImageTag": "1.0.0", "MongoUriSecretArn": "arn:aws:secretsmanager:eu-west-1:123456789012:secret:m"}
START_MINUTES = 9  # boot + ECS registration + a multi-GB image pull on a new GPU instance
JOB_MINUTES = (40, 55, 70)  # job lengths, taken in turn
METRIC_LAG_MINUTES = 2


def arrivals() -> dict[int, int]:
    """Jobs sent per minute: 100 at once, then one every 10 minutes for two hours, then nothing."""
    sent = {0: 100}
    for minute in range(30, 150, 10):
        sent[minute] = sent.get(minute, 0) + 1
    return sent


@dataclass
class Policy:
    steps: list[tuple[float | None, float | None, int]]
    cooldown_s: int

    def adjustment(self, value: float, threshold: float) -> int:
        diff = value - threshold
        for lower, upper, step in self.steps:
            if (lower is None or diff >= lower) and (upper is None or diff < upper):
                return step
        return 0


@dataclass
class Alarm:
    expression: str
    threshold: float
    comparison: str
    datapoints: int
    policy: Policy

    def breaching(self, value: float) -> bool:
        if self.comparison == "GreaterThanOrEqualToThreshold":
            return value >= self.threshold
        if self.comparison == "LessThanOrEqualToThreshold":
            return value <= self.threshold
        raise ValueError(self.comparison)


def metric_math(expression: str, **values: float | None) -> float:
    """The few metric-math functions the scaling alarms use, on one datapoint per id."""
    python = expression.replace("CEIL(", "_ceil(").replace("FILL(", "_fill(")
    if re.search(r"[A-Z]{2,}\(", python):
        raise ValueError(f"metric math this simulation does not know: {expression}")
    helpers = {"_ceil": math.ceil, "_fill": lambda v, d: d if v is None else v}
    return eval(python, {"__builtins__": {}}, {**helpers, **values})  # noqa: S307 - our own template


def read_template(**params: str) -> tuple[list[Alarm], int]:
    stack = Resolver(load_template(), **ECS_PARAMS, **params)
    resources = stack.template["Resources"]
    alarms = []
    for name, spec in resources.items():
        if spec["Type"] != "AWS::CloudWatch::Alarm" or not stack.exists(name):
            continue
        alarm = stack.resource(name)
        actions = spec["Properties"].get("AlarmActions", [])
        policies = [a["Ref"] for a in actions if isinstance(a, dict) and "Ref" in a
                    and resources.get(a["Ref"], {}).get("Type") == "AWS::ApplicationAutoScaling::ScalingPolicy"]
        if not policies:
            continue
        (policy_id,) = policies
        config = stack.resource(policy_id)["StepScalingPolicyConfiguration"]
        steps = [(_number(s.get("MetricIntervalLowerBound")), _number(s.get("MetricIntervalUpperBound")),
                  int(s["ScalingAdjustment"])) for s in config["StepAdjustments"]]
        (result,) = [m for m in alarm["Metrics"] if m["ReturnData"]]
        alarms.append(Alarm(result["Expression"], float(alarm["Threshold"]), alarm["ComparisonOperator"],
                            int(alarm.get("DatapointsToAlarm", alarm["EvaluationPeriods"])),
                            Policy(steps, int(config["Cooldown"]))))
    maximum = int(stack.resource("WorkerScalableTarget")["MaxCapacity"])
    return alarms, maximum


def _number(value) -> float | None:
    return None if value is None else float(value)


@dataclass
class Task:
    ready_at: int
    job_ends_at: int | None = None


@dataclass
class Result:
    desired: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    busy: list[int] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    wanted: list[int] = field(default_factory=list)
    idle_gpu_minutes: int = 0
    booting_gpu_minutes: int = 0
    busy_gpu_minutes: int = 0
    last_job_end: int = 0
    jobs_done: int = 0
    zero_at: int | None = None

    @property
    def peak_overshoot(self) -> int:
        """The most tasks a scale-out asked for beyond the most the jobs wanted within the metrics' lag
        before it (what the alarm could know), 0 when never."""
        rises = [self.desired[t] - max(self.wanted[max(0, t - METRIC_LAG_MINUTES):t + 1])
                 for t in range(1, len(self.desired)) if self.desired[t] > self.desired[t - 1]]
        return max([0, *rises])

    @property
    def tail_minutes(self) -> int:
        return (self.zero_at if self.zero_at is not None else len(self.desired)) - self.last_job_end


def simulate(alarms: list[Alarm], maximum: int, target: float = 1.0, minutes: int = 24 * 60,
             before: bool = False) -> Result:
    """Run the arrival curve through the template's alarms and policies (``before``: through the
    policy the template had before issue #29, modelled by hand in ``_before``)."""
    sent = arrivals()
    visible, lengths = 0, 0
    tasks: list[Task] = []
    desired = 0
    history: list[tuple[int, int, int, int]] = []  # (visible, inflight, desired, running) each minute
    breaches = [0] * len(alarms)
    cooldown = {"out_until": -1, "out_step": 0, "in_until": -1}
    result = Result()
    total = sum(sent.values())
    done = 0
    for now in range(minutes):
        visible += sent.get(now, 0)
        # Jobs end, tasks that are ready take jobs.
        for task in tasks:
            if task.job_ends_at is not None and task.job_ends_at <= now:
                task.job_ends_at = None
                done += 1
                result.jobs_done = done
                result.last_job_end = now
        # Scale-in leftovers: a protected task whose job ended stops now if the service has too many.
        _trim(tasks, desired, now)
        for task in tasks:
            if task.ready_at <= now and task.job_ends_at is None and visible:
                visible -= 1
                task.job_ends_at = now + JOB_MINUTES[lengths % len(JOB_MINUTES)]
                lengths += 1
        inflight = sum(1 for t in tasks if t.job_ends_at is not None)
        # The alarms read the previous minute's datapoints.
        if before and len(history) >= METRIC_LAG_MINUTES:
            desired = _before(history[-METRIC_LAG_MINUTES], desired, maximum, target, now, cooldown)
        elif len(history) >= METRIC_LAG_MINUTES:
            v, i, d, _ = history[-METRIC_LAG_MINUTES]
            for n, alarm in enumerate(alarms):
                value = metric_math(alarm.expression, visible=v, inflight=i, desired=d)
                breaches[n] = breaches[n] + 1 if alarm.breaching(value) else 0
                if breaches[n] >= alarm.datapoints:
                    step = alarm.policy.adjustment(value, alarm.threshold)
                    desired = _apply(step, alarm.policy, desired, maximum, now, cooldown)
        # The service starts or stops tasks toward the desired count.
        while len(tasks) < desired:
            tasks.append(Task(ready_at=now + START_MINUTES))
        _trim(tasks, desired, now)
        running = [t for t in tasks if t.ready_at <= now]
        history.append((visible, inflight, desired, len(running)))
        busy = sum(1 for t in running if t.job_ends_at is not None)
        result.desired.append(desired)
        result.running.append(len(running))
        result.busy.append(busy)
        result.backlog.append(visible + inflight)
        result.wanted.append(min(maximum, math.ceil((visible + inflight) / target)))
        result.idle_gpu_minutes += len(running) - busy
        result.busy_gpu_minutes += busy
        result.booting_gpu_minutes += len(tasks) - len(running)
        if done == total and not tasks and result.zero_at is None:
            result.zero_at = now
            break
    return result


def _before(datapoint, desired: int, maximum: int, target: float, now: int, state: dict) -> int:
    """The pre-#29 template, by hand: target tracking of (visible + in flight) / RUNNING tasks at the
    target, scale-out cooldown 300 s, scale-in after 15 low datapoints (below 90 % of the target) and
    a 900 s cooldown; a step policy adds 1 while jobs are visible and no task is desired."""
    visible, inflight, _, running = datapoint
    if desired == 0:
        return 1 if visible > 0 else 0
    if running == 0:  # the ratio has no value: target tracking does nothing
        return desired
    metric = (visible + inflight) / running
    state["low"] = state.get("low", 0) + 1 if metric < 0.9 * target else 0
    if metric > target and now >= state.get("before_out_until", -1):
        state["before_out_until"] = now + 5
        return min(maximum, max(desired, math.ceil(desired * metric / target)))
    if state["low"] >= 15 and now >= state.get("before_in_until", -1):
        state["before_in_until"] = now + 15
        state["low"] = 0
        return max(0, math.ceil(desired * metric / target))
    return desired


def _apply(step: int, policy: Policy, desired: int, maximum: int, now: int, cooldown: dict) -> int:
    if step > 0:
        if now < cooldown["out_until"]:
            extra = step - cooldown["out_step"]
            if extra <= 0:
                return desired
            cooldown["out_step"] = step
            return min(maximum, desired + extra)
        cooldown["out_until"] = now + policy.cooldown_s // 60
        cooldown["out_step"] = step
        return min(maximum, desired + step)
    if step < 0:
        if now < cooldown["in_until"]:
            return desired
        cooldown["in_until"] = now + policy.cooldown_s // 60
        return max(0, desired + step)
    return desired


def _trim(tasks: list[Task], desired: int, now: int) -> None:
    """Stop tasks beyond the desired count: pending ones first, then idle ones; busy ones are protected."""
    for pick in (lambda t: t.ready_at > now, lambda t: t.job_ends_at is None):
        for task in [t for t in tasks if pick(t)]:
            if len(tasks) <= desired:
                return
            tasks.remove(task)


def report(result: Result, label: str, trace: bool) -> str:
    lines = [f"{label}:",
             f"  peak tasks desired {max(result.desired)}, peak overshoot {result.peak_overshoot} task(s)",
             f"  GPU-minutes: busy {result.busy_gpu_minutes}, idle {result.idle_gpu_minutes} "
             f"({result.idle_gpu_minutes / max(1, result.jobs_done):.1f} a job), booting {result.booting_gpu_minutes}",
             f"  last job ended at minute {result.last_job_end}; zero tasks at minute {result.zero_at} "
             f"(tail {result.tail_minutes} min)"]
    if trace:
        lines.append("  minute backlog wanted desired running busy")
        previous = None
        for t in range(len(result.desired)):
            row = (result.backlog[t], result.wanted[t], result.desired[t], result.running[t], result.busy[t])
            if row != previous:
                lines.append(f"  {t:6d} {row[0]:7d} {row[1]:6d} {row[2]:7d} {row[3]:7d} {row[4]:4d}")
                previous = row
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tasks", type=int, action="append",
                        help="MaxWorkerTasks (repeatable); default: the template's, then 128")
    parser.add_argument("--trace", action="store_true", help="print every change of the task counts")
    parser.add_argument("--before", action="store_true",
                        help="the target tracking on running tasks the template had before, for comparison")
    args = parser.parse_args(argv)
    for maximum in args.max_tasks or [None, 128]:
        params = {} if maximum is None else {"MaxWorkerTasks": str(maximum)}
        alarms, cap = read_template(**params)
        result = simulate(alarms, cap, before=args.before)
        label = f"MaxWorkerTasks={cap}" + (" (the policy before #29, by hand)" if args.before else "")
        print(report(result, label, args.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
