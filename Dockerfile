# voice-worker image: one worker process per container, one GPU per container.
#
#   docker build --build-arg REVISION="$(git rev-parse HEAD)" -t voice-worker .
#   docker run --init --gpus '"device=0"' --env-file /etc/voice-worker/worker.env voice-worker
#
# Run it with an init (docker --init, ECS initProcessEnabled): the trainer's own children are
# reparented to PID 1 when a stage exits, and only an init reaps them.
#
# The slim image: the worker with config/pipeline.toml, the CPU reference trainer, which trains no real
# voice. It runs the reconcile task and the operator commands; the production image that trains is
# Dockerfile.trainer (the real trainers, config/pipeline.real.toml).

# Pinned by tag: a rebuild picks up Debian security fixes for this Python release, nothing newer.
FROM python:3.11.14-slim-bookworm

# What the image is, for registries and scanners (OCI annotations). Pass them at build time:
#   docker build --build-arg VERSION=0.1.0 --build-arg REVISION="$(git rev-parse HEAD)" -t voice-worker .
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="voice-worker" \
      org.opencontainers.image.description="Trains voice-cloning models from jobs on an SQS queue" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    LOG_FORMAT=json \
    LIVENESS_FILE=/tmp/voice-worker.alive \
    WORK_ROOT=/var/lib/voice-worker/work

# PIPELINE_CONFIG defaults to the relative config/pipeline.toml, so the code's directory is the cwd.
WORKDIR /app

# Everything the install and the daemon need, and nothing else (.dockerignore keeps caches and .venv
# out; samples/, the demo's clips, stay out of the production image).
COPY pyproject.toml constraints.txt README.md ./
COPY requirements/ requirements/
COPY scripts/ scripts/
COPY worker/ worker/
COPY pipeline/ pipeline/
COPY config/ config/

# The install step the Makefile runs for the tests, in its prod form: the same versions, from
# requirements/image.lock with every file's SHA-256 (pip and setuptools too), so the image runs
# exactly the dependency set the tests ran and a file that changed on the index fails the build. No
# apt packages: soundfile's wheel bundles libsndfile. The user has a fixed UID so EFS access points
# and host volumes can match it.
RUN scripts/install.sh python prod \
    && groupadd --system --gid 10001 voice-worker \
    && useradd --system --no-log-init --uid 10001 --gid voice-worker \
        --home-dir /var/lib/voice-worker --shell /usr/sbin/nologin voice-worker \
    && install -d -o voice-worker -g voice-worker -m 0750 \
        /var/lib/voice-worker /var/lib/voice-worker/work

USER 10001:10001

# The worker finishes its job within SHUTDOWN_GRACE_SECONDS on SIGTERM, then releases the message.
# The orchestrator's stop timeout (docker stop -t, ECS stopTimeout) must exceed that grace.
STOPSIGNAL SIGTERM

# Healthy while the loop and the heartbeat keep touching LIVENESS_FILE (first touched once the
# worker is ready, with its age limit written in it). The start period covers the store's connect
# retries: by default up to 7 pings of 5 s each with 21 s of delays between them. The check imports
# nothing of the worker (worker/core/healthcheck.py): `python -m worker health` would load the whole
# command line every 30 s.
HEALTHCHECK --interval=30s --timeout=10s --start-period=90s --retries=3 \
    CMD ["python", "-m", "worker.core.healthcheck"]

ENTRYPOINT ["python", "-m", "worker"]
CMD ["run"]
