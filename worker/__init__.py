"""voice-worker: trains voice-cloning models from jobs on an SQS queue."""

# The release, kept equal to pyproject.toml's version by tests/test_docs.py. A constant rather than
# importlib.metadata: every log line carries it, and reading the installed metadata costs each start.
__version__ = "0.1.0"
