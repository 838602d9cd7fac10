"""The generic core of a queue worker: the SQS adapter, the heartbeat lease, the loop, stop
signals, the error tree, process supervision, logs and metrics. Nothing here knows about voices,
records or pipelines (tests/test_layers.py keeps it so)."""
