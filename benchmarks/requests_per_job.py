"""SQS requests for one real job: the demo's job (three clips, reference trainer) through the real worker.

    python benchmarks/requests_per_job.py [--heartbeat-ms 200]

The worker is assembled by ``build_app`` exactly as the daemon is; a botocore hook on its session
counts each HTTP request by operation. Expected: one ReceiveMessage that returns the job, one
ChangeMessageVisibility per heartbeat tick while it runs, one DeleteMessage; empty long polls come on
top while a worker idles (one per SQS_WAIT_TIME_SECONDS).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from sqs_bench import LocalAws, session

from worker.app import build_app
from worker.core.logs import configure_logging
from worker.ops.demo import demo_settings, provision, sample_job
from worker.voice.submit import submit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heartbeat-ms", type=int, default=200)
    args = parser.parse_args()
    with LocalAws() as aws, tempfile.TemporaryDirectory() as tmp:
        aws_session = session()
        queue_url = provision(aws_session, aws.url)
        settings = demo_settings(aws.url, queue_url, Path(tmp)).model_copy(
            update={"sqs_visibility_heartbeat_interval_ms": args.heartbeat_ms})
        configure_logging("ERROR", "console")
        counted: Counter = Counter()
        # Registered before build_app creates its clients, so they inherit the hook.
        aws_session.events.register("before-send.sqs", lambda event_name, **_: counted.update(
            [event_name.rsplit(".", 1)[-1]]))
        app = build_app(settings, session=aws_session)
        try:
            job_id, _ = submit(app.store, aws_session.client("sqs", endpoint_url=aws.url), queue_url, sample_job())
            counted.clear()  # the submit's own SendMessage is not the worker's
            started_s = time.monotonic()
            while (app.store.get_job(job_id) or {}).get("status") != "completed":
                app.worker.run_once()
                if time.monotonic() - started_s > 120:
                    raise SystemExit("the job did not complete in 120 s")
            duration_s = time.monotonic() - started_s
        finally:
            app.close()
    total = sum(counted.values())
    intervals = int(duration_s * 1000 // args.heartbeat_ms)
    print(f"one job, {duration_s:.2f} s = {intervals} heartbeat intervals of {args.heartbeat_ms} ms: "
          f"{total} SQS requests ({', '.join(f'{op} {n}' for op, n in sorted(counted.items()))}); "
          f"2 + N = {2 + intervals}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
