"""The fault soak: several `python -m worker run` processes on one queue and one SQLite file, each
reaching the moto server through its own ``FaultProxy``, while a seeded schedule kills, pauses,
stops, partitions and slows them and sends duplicate messages. ``check`` (soak_check.py) then judges
the final state.

Used by tests/reliability/test_soak.py (bounded, in `make test`) and scripts/soak.py (minutes).
The schedule is a pure function of the seed; when each fault lands relative to the work still
depends on the machine, so a seed names the faults, not their exact effect.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.reliability.procs import WorkerProcess, cmdline, is_alive, wait_until
from tests.reliability.proxy import STALL, FaultProxy
from tests.reliability.soak_check import SoakState, Violation, check, key_of
from tests.reliability.stack import _ARTIFACTS_TOML, ARTIFACTS, Stack, make_stack, sha256_bytes

TRAINER = Path(__file__).with_name("soak_trainer.py")
KILL9, SIGSTOP, SIGTERM = "kill9", "sigstop", "sigterm"
PARTITION_UPLOAD, PARTITION, DROP, DELAY, DUPLICATE = "partition_upload", "partition", "drop", "delay", "duplicate"
FAULT_KINDS = (KILL9, SIGSTOP, SIGTERM, PARTITION_UPLOAD, PARTITION, DROP, DELAY, DUPLICATE)
# One round of the schedule: every kind, and twice the two that reach a stale attempt's uploads.
_ROUND = (*FAULT_KINDS, PARTITION_UPLOAD, SIGSTOP)
# A partition armed for an upload stalls once this many more bytes have gone out: mid-body of the
# next object above that size (SQS calls and heads are a few hundred bytes each).
_MID_UPLOAD_BYTES = 256 * 1024
# How long a partition that caught an upload may wait for the job's commit elsewhere, in leases: the
# lease lapses, the redelivery is told the job is busy until the record lease ends, then another
# worker trains (or reuses the verified outputs), uploads and commits.
_UPLOAD_PARTITION_CAP_LEASES = 5
_TICK_S = 0.1
FINAL = ("completed", "failed", "cancelled")


@dataclass(frozen=True)
class SoakConfig:
    seed: int
    workers: int = 3
    jobs: int = 15
    faults: int = 12
    window_s: float = 40.0          # jobs and faults are spread over this much of the run
    train_s: float = 1.5            # one training's duration
    # Above the uploader's 8 MiB multipart threshold for fullModel: a partition can land between parts.
    sizes: dict[str, int] = field(default_factory=lambda: {
        "fullModel": 8 * 1024 * 1024 + 256 * 1024, "fullConfig": 4 * 1024, "speakerEmbeddings": 512 * 1024,
        "lightModel": 1024 * 1024, "lightConfig": 4 * 1024})
    visibility_s: int = 5
    heartbeat_ms: int = 1000
    # The soak puts far more faults on one message than production sees: a job may be received many
    # times for reasons the worker handles (a JobBusy retry per takeover), so SQS's own dead-lettering
    # comes later than the deployment default of 5.
    max_receive_count: int = 12
    settle_timeout_s: float = 90.0  # after the window: how long the last jobs may take
    # More worker settings for the run (scripts/soak.py --env), e.g. CHECKPOINT_S3_SYNC_SECONDS=1.
    worker_env: dict[str, str] = field(default_factory=dict)
    # Each slot a host of its own (its own WORK_ROOT): a retry elsewhere finds nothing on its disk, so
    # with the S3 mirror on it resumes from what the job record vouches for, or starts over.
    hosts: bool = False


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    slot: int
    length_s: float


def fault_schedule(config: SoakConfig) -> list[Fault]:
    """The seeded list of faults: kinds in rounds of ``_ROUND`` (shuffled), spread over the window."""
    rng = random.Random(config.seed)
    kinds: list[str] = []
    while len(kinds) < config.faults:
        round_ = list(_ROUND)
        rng.shuffle(round_)
        kinds += round_
    gap_s = config.window_s / (config.faults + 1)
    lease_s = config.visibility_s
    lengths = {SIGSTOP: (lease_s + 1.0, lease_s + 3.0), PARTITION: (1.0, lease_s + 2.0),
               DROP: (0.5, 2.5), DELAY: (2.0, 5.0), }
    faults = []
    for n, kind in enumerate(kinds[:config.faults]):
        low, high = lengths.get(kind, (0.0, 0.0))
        faults.append(Fault(round(gap_s * (n + 1) + rng.uniform(-gap_s / 3, gap_s / 3), 2), kind,
                            rng.randrange(config.workers), round(rng.uniform(low, high), 2)))
    return faults


def soak_pipeline(log_path: Path, train_s: float, sizes: dict[str, int]) -> str:
    """One stage that trains for ``train_s`` and writes the five artifacts as random bytes."""
    rels = ", ".join(f'"{ARTIFACTS[name]}"' for name in ARTIFACTS)
    size_arg = ",".join(f"{ARTIFACTS[name]}={n}" for name, n in sizes.items())
    return _ARTIFACTS_TOML + f"""
[[stages]]
name = "train"
argv = ["{{python}}", "{TRAINER}", "--out", "{{output_dir}}", "--job", "{{job_id}}", "--log", "{log_path}",
        "--train-s", "{train_s}", "--sizes", "{size_arg}", "--checkpoints", "{{checkpoint_dir}}"]
outputs = [{rels}]
resumable = true
"""


@dataclass
class Slot:
    """One worker position: its proxy outlives the worker processes that take turns in it."""

    number: int
    proxy: FaultProxy
    worker: WorkerProcess | None = None
    busy_until_s: float = 0.0     # no second fault on this slot before then


@dataclass
class SoakResult:
    state: SoakState
    violations: list[Violation]
    faults: Counter
    notes: list[str]
    elapsed_s: float
    uploads_caught: int

    def summary(self) -> str:
        by_kind = Counter(v.kind for v in self.violations)
        done = sum((self.state.records.get(j) or {}).get("status") == "completed" for j in self.state.jobs)
        lines = [f"jobs {len(self.state.jobs)}, completed {done}, in {self.elapsed_s:.0f} s",
                 f"faults {dict(sorted(self.faults.items()))} (partitions that caught an upload: {self.uploads_caught})",
                 f"violations {len(self.violations)} {dict(sorted(by_kind.items()))}"]
        lines += [f"  {v}" for v in self.violations[:40]]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class Soak:
    def __init__(self, endpoint: str, root: Path, config: SoakConfig):
        self.config, self.root = config, root
        self.trainer_log = root / "trainings.jsonl"
        self.stack: Stack = make_stack(endpoint, root, soak_pipeline(self.trainer_log, config.train_s, config.sizes))
        self._raise_receive_count()
        self.slots = [Slot(n, FaultProxy(endpoint, max_stall_s=config.visibility_s * 6).start())
                      for n in range(config.workers)]
        self.instances: list[WorkerProcess] = []
        self.jobs: dict[str, str] = {}
        self.bodies: list[str] = []
        self.snapshots: dict[str, dict[str, list[str]]] = {}
        self.faults: Counter = Counter()
        self.notes: list[str] = []
        self._pending: list[tuple[float, object]] = []   # (due time, action returning True when done)
        self._rng = random.Random(config.seed + 1)
        self.uploads_caught = 0   # armed partitions that fired mid-upload

    # --- workers
    def _start(self, slot: Slot) -> None:
        n = len(self.instances)
        env = self.stack.env(
            WORKER_ID=f"soak-{slot.number}-{n}", AWS_ENDPOINT_URL=slot.proxy.url,
            SQS_VISIBILITY_TIMEOUT_SECONDS=str(self.config.visibility_s),
            SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=str(self.config.heartbeat_ms),
            KEEP_WORK_FILES="false", LIVENESS_FILE=str(self.root / f"alive-{n}"),
            **({"WORK_ROOT": str(self.root / f"host-{slot.number}" / "work")} if self.config.hosts else {}),
            **self.config.worker_env)
        slot.worker = WorkerProcess(env, self.root / f"worker-{n}.log").start()
        self.instances.append(slot.worker)

    def _raise_receive_count(self) -> None:
        queues = self.stack.queues
        arn = queues.sqs.get_queue_attributes(QueueUrl=queues.dlq_url, AttributeNames=["QueueArn"])
        policy = {"deadLetterTargetArn": arn["Attributes"]["QueueArn"],
                  "maxReceiveCount": str(self.config.max_receive_count)}
        queues.sqs.set_queue_attributes(QueueUrl=queues.url, Attributes={"RedrivePolicy": json.dumps(policy)})

    # --- the run
    def run(self) -> SoakResult:
        started = time.monotonic()
        schedule = fault_schedule(self.config)
        submit_gap_s = self.config.window_s * 0.9 / max(1, self.config.jobs)
        submitted = 0
        try:
            for slot in self.slots:
                self._start(slot)
            wait_until(lambda: all(Path(w.env["LIVENESS_FILE"]).exists() for w in self.instances), 60, "workers up")
            t0 = time.monotonic()
            self.notes.append(f"workers up in {t0 - started:.0f} s")
            deadline = t0 + self.config.window_s + self.config.settle_timeout_s
            while time.monotonic() < deadline:
                now_s = time.monotonic() - t0
                while submitted < self.config.jobs and now_s >= submitted * submit_gap_s:
                    job_id, profile_id, body = self.stack.submit(directory="soak")
                    self.jobs[job_id], submitted = profile_id, submitted + 1
                    self.bodies.append(body)
                schedule = self._inject_due(schedule, now_s)
                self._pending = [(due, action) for due, action in self._pending if not action()]
                self._snapshot_commits()
                if submitted == self.config.jobs and not schedule and not self._pending and self._settled():
                    self.notes.append(f"settled {time.monotonic() - t0:.0f} s after the first job "
                                      f"(window {self.config.window_s:.0f} s)")
                    break
                time.sleep(_TICK_S)
            else:
                self.notes.append(f"not settled within {self.config.settle_timeout_s} s after the window")
            self._snapshot_commits()
        finally:
            wind_down_started = time.monotonic()
            self._wind_down()
        collect_started = time.monotonic()
        state = self.collect()
        self.notes.append(self._mirror_note())
        self.notes.append(f"wind-down {collect_started - wind_down_started:.0f} s, "
                          f"collecting the state {time.monotonic() - collect_started:.0f} s")
        return SoakResult(state, check(state), self.faults, self.notes, time.monotonic() - started,
                          self.uploads_caught)

    def _settled(self) -> bool:
        if not self._all_final():
            return False
        # moto can count a message turning visible in neither column for an instant: look twice.
        for _ in range(2):
            if self.stack.queue_counts()[0] != (0, 0):
                return False
            time.sleep(0.3)
        return True

    def _inject_due(self, schedule: list[Fault], now_s: float) -> list[Fault]:
        later = []
        for fault in schedule:
            slot = self.slots[fault.slot]
            if fault.kind == PARTITION_UPLOAD and fault.at_s <= now_s:
                slot = self._slot_mid_job(fault.slot, now_s)
                if slot is None:
                    if len(self.jobs) == self.config.jobs and self._all_final():
                        self.notes.append("a partition for an upload found no job left to catch")
                    else:
                        later.append(fault)  # wait for a worker that holds a job
                    continue
            if fault.at_s > now_s or (fault.kind != DUPLICATE and slot.busy_until_s > now_s):
                later.append(fault)  # a slot takes one fault at a time
                continue
            self._inject(fault, slot, now_s)
            self.faults[fault.kind] += 1
        return later

    def _slot_mid_job(self, first: int, now_s: float) -> Slot | None:
        """A free slot (trying ``first`` first) whose worker holds a job not yet committed."""
        for n in range(len(self.slots)):
            slot = self.slots[(first + n) % len(self.slots)]
            if slot.busy_until_s <= now_s and slot.worker.running():
                job_id = _holding(slot.worker)
                if job_id is not None and job_id not in self.snapshots:
                    return slot
        return None

    def _all_final(self) -> bool:
        with self.stack.reader() as store:
            return all((store.get_job(j) or {}).get("status") in FINAL for j in self.jobs)

    def _inject(self, fault: Fault, slot: Slot, now_s: float) -> None:
        worker, proxy, now = slot.worker, slot.proxy, time.monotonic()
        slot.busy_until_s = now_s + fault.length_s + 1.0
        if fault.kind in (KILL9, SIGSTOP, SIGTERM) and worker.proc.poll() is not None:
            # Its SIGTERM exit outlasted the slot's busy time and the restart is still pending.
            self.notes.append(f"slot {slot.number}: {fault.kind} skipped, its worker had already exited")
            return
        if fault.kind == DUPLICATE:
            self.stack.queues.send(self._rng.choice(self.bodies))
        elif fault.kind == KILL9:
            # The worker alone, as the kernel's OOM killer does: nothing here ends its trainer.
            os.kill(worker.pid, signal.SIGKILL)
            worker.proc.wait(10)
            self._start(slot)
        elif fault.kind == SIGSTOP:
            os.kill(worker.pid, signal.SIGSTOP)
            self._later(now + fault.length_s, lambda: _signal(worker, signal.SIGCONT) or True)
        elif fault.kind == SIGTERM:
            worker.proc.send_signal(signal.SIGTERM)
            self._later(now, self._restart_when_exited(slot, worker, now + 30))
        elif fault.kind == PARTITION_UPLOAD:
            proxy.stall_after(_MID_UPLOAD_BYTES)
            catch_s = self.config.train_s + 2 * self.config.visibility_s  # to reach an upload
            slot.busy_until_s = now_s + catch_s + _UPLOAD_PARTITION_CAP_LEASES * self.config.visibility_s
            give_up = now + catch_s
            self._later(now, self._release_upload_partition(slot, worker, proxy.stalls, give_up))
        elif fault.kind == PARTITION:
            proxy.stall()
            self._later(now + fault.length_s, lambda: proxy.passthrough() or True)
        elif fault.kind == DROP:
            proxy.drop()
            self._later(now + fault.length_s, lambda: proxy.passthrough() or True)
        elif fault.kind == DELAY:
            proxy.delay(self._rng.uniform(0.05, 0.3))
            self._later(now + fault.length_s, lambda: proxy.passthrough() or True)

    def _later(self, due: float, action) -> None:
        self._pending.append((due, lambda: time.monotonic() >= due and action()))

    def _restart_when_exited(self, slot: Slot, worker: WorkerProcess, give_up: float):
        def action() -> bool:
            if worker.running() and time.monotonic() < give_up:
                return False
            if worker.running():
                self.notes.append(f"{worker.env['WORKER_ID']} ignored SIGTERM for 30 s: killed")
                worker.kill_tree()
            self._start(slot)
            return True
        return action

    def _release_upload_partition(self, slot: Slot, worker: WorkerProcess, stalls_before: int, give_up: float):
        """Hold the partition until the job the worker was uploading is committed by someone (or a cap)."""
        proxy, held = slot.proxy, {}

        def action() -> bool:
            if proxy.stalls == stalls_before:        # not fired yet: no upload through this proxy
                if time.monotonic() < give_up:
                    return False
                proxy.disarm()
                self.notes.append(f"a partition armed on slot {slot.number} found no upload to catch")
                return True
            if "job" not in held:
                self.uploads_caught += 1
                held["job"] = _last_claimed(worker)
                held["cap"] = time.monotonic() + _UPLOAD_PARTITION_CAP_LEASES * self.config.visibility_s
            committed = held["job"] in self.snapshots
            if committed or time.monotonic() >= held["cap"] or proxy.mode != STALL:
                proxy.passthrough()
                self.notes.append(f"slot {slot.number}: partition caught {held['job']} mid-upload; released "
                                  f"{'after its commit elsewhere' if committed else 'at the cap, uncommitted'}")
                return True
            return False
        return action

    def _snapshot_commits(self) -> None:
        """For each newly completed job: the version ids of its objects, right after the commit."""
        with self.stack.reader() as store:
            for job_id, profile_id in self.jobs.items():
                if job_id in self.snapshots or (store.get_job(job_id) or {}).get("status") != "completed":
                    continue
                paths = (store.get_profile(profile_id) or {}).get("s3Paths") or {}
                # The latest version id only (HEAD): moto's ListObjectVersions deep-copies every
                # object in the bucket per call, whatever the prefix. The final listing counts versions.
                self.snapshots[job_id] = {key_of(uri): [self._latest_version(key_of(uri))]
                                          for uri in paths.values()}

    def _all_versions(self) -> dict[str, list[dict]]:
        """Every key's versions, newest first, in one listing of the bucket."""
        by_key: dict[str, list[dict]] = {}
        for page in self.stack.s3.get_paginator("list_object_versions").paginate(Bucket=self.stack.bucket):
            for version in page.get("Versions", []):
                by_key.setdefault(version["Key"], []).append(version)
        for listed in by_key.values():
            listed.sort(key=lambda v: (v["IsLatest"], v["LastModified"]), reverse=True)
        return by_key

    def _latest_version(self, key: str) -> str:
        return self.stack.s3.head_object(Bucket=self.stack.bucket, Key=key)["VersionId"]

    def _wind_down(self) -> None:
        for slot in self.slots:
            slot.proxy.passthrough()
        for worker in self.instances:
            _signal(worker, signal.SIGCONT)
        for worker in self.instances:
            if worker.running():
                try:
                    worker.stop(30)
                except AssertionError as exc:
                    self.notes.append(str(exc))
        for slot in self.slots:
            slot.proxy.stop()
        # Trainers a killed worker left behind finish on their own (a training is short); any still
        # running after that is killed, so nothing the soak started outlives it.
        pids = {line["pid"] for line in _read_lines(self.trainer_log)}

        def survivors() -> list[int]:
            return [pid for pid in pids if is_alive(pid) and str(TRAINER) in cmdline(pid)]

        try:
            wait_until(lambda: not survivors(), self.config.train_s * 4 + 10, "left-behind trainers to end")
        except AssertionError as exc:
            self.notes.append(f"{exc}: killed {survivors()}")
            for pid in survivors():
                os.kill(pid, signal.SIGKILL)

    # --- the final state
    def _mirror_note(self) -> str:
        """What the S3 checkpoint mirror did in the run, from the workers' logs."""
        seen = Counter(e.get("event") for w in self.instances for e in w.events()
                       if str(e.get("event", "")).startswith("remote_work."))
        resumed = sum(1 for line in _read_lines(self.trainer_log)
                      if line.get("event") == "start" and line.get("resumed_ticks"))
        return (f"mirror: {seen['remote_work.checkpoints_pushed']} checkpoint pushes, "
                f"{seen['remote_work.checkpoints_restored']} restores, {seen['remote_work.restore_failed']} "
                f"refused or failed restores, {seen['remote_work.push_failed']} failed pushes; "
                f"trainings resumed from a checkpoint: {resumed}")

    def collect(self) -> SoakState:
        with self.stack.reader() as store:
            records = {j: store.get_job(j) or {} for j in self.jobs}
            profiles = {p: store.get_profile(p) or {} for p in self.jobs.values()}
        commits = Counter(e.get("job_id") for w in self.instances for e in w.events()
                          if e.get("event") == "job.completed")
        listed = self._all_versions()
        versions = {}
        for profile in profiles.values():
            for uri in (profile.get("s3Paths") or {}).values():
                key = key_of(uri)
                # Only the newest version's bytes are read: the others only need to be counted.
                versions[key] = [self._describe(key, v["VersionId"]) if n == 0 else
                                 {"version_id": v["VersionId"], "sha256": None, "body_sha256": None}
                                 for n, v in enumerate(listed.get(key, []))]
        visible, in_flight = self.stack.queue_counts()[0]
        return SoakState(jobs=dict(self.jobs), records=records, profiles=profiles, commits_logged=commits,
                         snapshots=self.snapshots, versions=versions, trainer_log=_read_lines(self.trainer_log),
                         queue_left=visible + in_flight, dead_letters=self._dead_letters())

    def _describe(self, key: str, version_id: str) -> dict:
        got = self.stack.s3.get_object(Bucket=self.stack.bucket, Key=key, VersionId=version_id)
        return {"version_id": version_id, "sha256": (got.get("Metadata") or {}).get("sha256"),
                "body_sha256": sha256_bytes(got["Body"].read())}

    def _dead_letters(self) -> list[dict]:
        found, queues = [], self.stack.queues
        while batch := queues.receive_now(queues.dlq_url):
            for message in batch:
                try:
                    body = json.loads(message["Body"])
                except ValueError:
                    body = {}
                found.append({"message_id": message["MessageId"], "body": body if isinstance(body, dict) else {}})
            if len(found) > 1000:
                break
        return found


def run_soak(endpoint: str, root: Path, config: SoakConfig) -> SoakResult:
    return Soak(endpoint, root, config).run()


def _signal(worker: WorkerProcess, signum: int) -> None:
    if worker.running():
        try:
            os.kill(worker.pid, signum)
        except ProcessLookupError:
            pass


def _last_claimed(worker: WorkerProcess) -> str | None:
    claimed = [e.get("job_id") for e in worker.events() if e.get("event") == "job.claimed"]
    return claimed[-1] if claimed else None


def _holding(worker: WorkerProcess) -> str | None:
    """The job the worker claimed and has not yet finished handling, from its log."""
    held = None
    for event in worker.events():
        if event.get("event") == "job.claimed":
            held = event.get("job_id")
        elif event.get("event") == "message.handled":
            held = None
    return held


def _read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:
            continue  # a line cut by a SIGKILL mid-write
    return lines

