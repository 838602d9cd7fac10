"""The generic core of a queue worker: the queue protocol the loop takes and its SQS adapter, the
heartbeat lease, the loop, stop signals, the error tree's branches, process supervision, logs and
metrics. Nothing here knows about voices, records or pipelines (tests/test_layers.py keeps it so)."""
