"""No-op message throughput, side by side on one local moto server: this worker's loop against the floor.

    python benchmarks/throughput.py [--messages 200] [--depth 2] [--rounds 3]

Contenders, each consuming the same number of no-op messages from its own queue while a feeder keeps
the queue at most ``--depth`` messages deep (a shallow queue: receives find one message or none):
  worker   this project's Worker loop (receive, heartbeat lease per message, settle) with a no-op handler
  raw      a bare boto3 receive(1, long poll 1 s)/delete loop: the floor
  aws-sqs-consumer   its Consumer with batch_size=1, 1 s long polls
  celery   Celery's SQS transport, solo pool, prefetch 1, acks_late, 1 s long polls (a subprocess)
All log at INFO into /dev/null, as they would in production. Reported: messages per second (median of
the rounds), the ratio to the raw loop, and SQS requests per message for the in-process contenders.
Rounds rotate the order so no contender always runs first. A script, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from sqs_bench import ROOT, Feeder, Handled, LocalAws, RequestCounter, new_queue, session

from worker.core.aws import make_client
from worker.core.logs import configure_logging
from worker.core.loop import Worker
from worker.core.queue import Queue
from worker.settings import load_settings

START_TIMEOUT_S = 60


class Contender:
    """Start consuming from ``queue_url`` into ``handled``; ``stop()`` ends it."""

    name = ""
    counter: RequestCounter | None = None

    def start(self, endpoint: str, queue_url: str, handled: Handled) -> None: ...

    def stop(self) -> None: ...

    def send(self, sqs, queue_url: str) -> Callable[[int], None]:
        return lambda n: sqs.send_message(QueueUrl=queue_url, MessageBody=f'{{"n": {n}}}')


class WorkerLoop(Contender):
    name = "worker"

    def start(self, endpoint, queue_url, handled):
        settings = load_settings({"SQS_QUEUE_URL": queue_url, "AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1",
                                  "SQS_WAIT_TIME_SECONDS": "1", "SQS_VISIBILITY_TIMEOUT_SECONDS": "30",
                                  "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "10000"})
        sqs = make_client("sqs", settings.aws_config(), session())
        self.counter = RequestCounter(sqs)
        self.worker = Worker(settings.loop_config(), Queue(sqs, queue_url), lambda message, lease: handled.add())
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def stop(self):
        self.worker.stop()
        self.thread.join()


class RawLoop(Contender):
    name = "raw"

    def start(self, endpoint, queue_url, handled):
        sqs = session().client("sqs", endpoint_url=endpoint)
        self.counter = RequestCounter(sqs)
        self.stopping = threading.Event()

        def loop():
            while not self.stopping.is_set():
                reply = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=1, WaitTimeSeconds=1)
                for message in reply.get("Messages", []):
                    handled.add()
                    sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def stop(self):
        self.stopping.set()
        self.thread.join()


class AwsSqsConsumer(Contender):
    name = "aws-sqs-consumer"

    def start(self, endpoint, queue_url, handled):
        from aws_sqs_consumer import Consumer

        class NoOp(Consumer):
            def handle_message(self, message):
                handled.add()

        sqs = session().client("sqs", endpoint_url=endpoint)
        self.counter = RequestCounter(sqs)
        self.consumer = NoOp(queue_url=queue_url, region="us-east-1", sqs_client=sqs, batch_size=1,
                             wait_time_seconds=1, polling_wait_time_ms=0)
        self.thread = threading.Thread(target=self.consumer.start, daemon=True)
        self.thread.start()

    def stop(self):
        self.consumer.stop()
        self.thread.join()


class CeleryWorker(Contender):
    """Celery runs in its own process; its task reports each run with a UDP datagram."""

    name = "celery"

    def __init__(self, endpoint: str, queue_url: str):
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.listener.bind(("127.0.0.1", 0))
        self.env = {**os.environ, "BENCH_SQS_HOSTPORT": endpoint.removeprefix("http://"),
                    "BENCH_QUEUE_URL": queue_url, "BENCH_NOTIFY_PORT": str(self.listener.getsockname()[1]),
                    "PYTHONPATH": str(ROOT)}
        os.environ.update({k: self.env[k] for k in ("BENCH_SQS_HOSTPORT", "BENCH_QUEUE_URL", "BENCH_NOTIFY_PORT")})
        from benchmarks.celery_noop import app

        self.app = app
        self.queue_url = queue_url

    def start(self, endpoint, queue_url, handled):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "benchmarks.celery_noop", "worker", "--pool=solo",
             "--loglevel=INFO", "--without-heartbeat", "--without-mingle", "--without-gossip"],
            cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.listener.settimeout(0.2)

        def listen():
            while self.proc.poll() is None:
                try:
                    self.listener.recv(16)
                except TimeoutError:
                    continue
                handled.add()

        self.thread = threading.Thread(target=listen, daemon=True)
        self.thread.start()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.thread.join()

    def send(self, sqs, queue_url):
        return lambda n: self.app.send_task("bench.noop")


def run_one(contender: Contender, endpoint: str, sqs, queue_url: str, messages: int, depth: int) -> tuple[float, float | None]:
    """(messages per second, SQS requests per message) for one contender on one queue."""
    handled = Handled(messages + 1)
    send = contender.send(sqs, queue_url)
    contender.start(endpoint, queue_url, handled)
    try:
        send(-1)  # warm-up: the consumer is connected and polling before the clock starts
        if not handled.wait_for(1, START_TIMEOUT_S):
            raise SystemExit(f"{contender.name} handled nothing within {START_TIMEOUT_S} s")
        feeder = Feeder(send, handled, messages, depth, base=1)
        feeder.start()
        if not handled.wait_for(messages + 1, 300) or feeder.error:
            raise SystemExit(f"{contender.name} did not finish: {handled.count - 1}/{messages} ({feeder.error})")
        rate = messages / (handled.done_at - feeder.started_at)
    finally:
        contender.stop()
    per_message = contender.counter.total() / (messages + 1) if contender.counter else None
    return rate, per_message


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--depth", type=int, default=2, help="most messages the feeder keeps ahead (default 2)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    configure_logging("INFO", "json", stream=open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the run

    rates: dict[str, list[float]] = {}
    requests: dict[str, list[float]] = {}
    with LocalAws() as aws:
        sqs = session().client("sqs", endpoint_url=aws.url)
        contenders: list[Contender] = [WorkerLoop(), RawLoop(), AwsSqsConsumer(),
                                       CeleryWorker(aws.url, new_queue(sqs, "bench"))]
        for round_no in range(args.rounds):
            order = contenders[round_no % len(contenders):] + contenders[:round_no % len(contenders)]
            for contender in order:
                queue_url = contender.queue_url if isinstance(contender, CeleryWorker) else \
                    new_queue(sqs, f"bench-{contender.name}-{round_no}")
                rate, per_message = run_one(contender, aws.url, sqs, queue_url, args.messages, args.depth)
                rates.setdefault(contender.name, []).append(rate)
                if per_message is not None:
                    requests.setdefault(contender.name, []).append(per_message)
                print(f"  round {round_no + 1} {contender.name:<17} {rate:8.1f} msg/s", flush=True)
                time.sleep(0.5)

    floor = statistics.median(rates["raw"])
    print(f"\n{args.messages} no-op messages per run, queue depth <= {args.depth}, {args.rounds} rounds, "
          f"one local moto server")
    print(f"{'consumer':<18} {'msg/s (median)':>15} {'ratio to raw':>13} {'SQS requests/msg':>17}")
    for name, values in rates.items():
        per = f"{statistics.median(requests[name]):17.2f}" if name in requests else f"{'n/a':>17}"
        print(f"{name:<18} {statistics.median(values):15.1f} {statistics.median(values) / floor:13.2f} {per}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
