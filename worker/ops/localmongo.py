"""A local MongoDB wire-protocol server as a child process: for `dev-stack --store mongo`, the demo and the tests.

The server is SecantusDB (a MongoDB-compatible server on WiredTiger, from PyPI). It is GPL-2.0, so it
is a development dependency only (the ``dev`` extra, never in the image) and is only ever run as a
separate process: nothing here imports it. It presents itself as a one-node replica set, so majority
writes, primary reads and sessions behave as on a production replica set.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER_MODULE = "secantus"
# The server answers a ping within seconds when the machine is idle; a loaded CI box needs more.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
# A free port is chosen, released, then bound by the child: another process may take it in between.
_START_ATTEMPTS = 3
_LOG_TAIL_CHARS = 4000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_installed() -> bool:
    return importlib.util.find_spec(SERVER_MODULE) is not None


class LocalMongo:
    """A SecantusDB server on loopback, stopped on exit; ``uri`` is its connection string.

    ``storage_path`` is ``":memory:"`` (gone when the server stops) or a directory that keeps the data
    across restarts. The server's output goes to ``log_path`` (or nowhere); if it does not start, the
    error carries the end of that log.
    """

    def __init__(self, port: int | None = None, *, storage_path: str | Path = ":memory:",
                 log_path: Path | None = None, cache_size: str = "128M",
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self._fixed_port = port
        self.port = port or _free_port()
        self._storage_path = str(storage_path)
        self._log_path = Path(log_path) if log_path is not None else None
        self._cache_size = cache_size
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def argv(self) -> list[str]:
        return [sys.executable, "-m", SERVER_MODULE, "--host", "127.0.0.1", "--port", str(self.port),
                "--storage-path", self._storage_path, "--cache-size", self._cache_size,
                "--log-level", "WARNING"]

    def __enter__(self) -> LocalMongo:
        if not server_installed():
            raise RuntimeError("the local MongoDB server (secantusdb) is not installed: it is a development "
                               "dependency, installed by `make .venv/.installed` (pip install -e '.[dev]')")
        for attempt in range(1, _START_ATTEMPTS + 1):
            self._check_port_free()
            if self._start():
                return self
            # Only a port we chose may be lost to a race; a fixed one failing is the final answer.
            if self._fixed_port is not None or attempt == _START_ATTEMPTS:
                break
            self.port = _free_port()
        raise RuntimeError(f"the local MongoDB server (secantusdb) did not start on 127.0.0.1:{self.port}"
                           f"{self._log_tail()}")

    def _check_port_free(self) -> None:
        refuse_used_port(self.port, "is a local MongoDB server already running there?")

    def _start(self) -> bool:
        """Start the process and wait for its ping; False (the process gone) if it never answered."""
        import pymongo

        if self._log_path is not None:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._log_path, "ab") as log:
                self._proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL)
        else:
            self._proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          stdin=subprocess.DEVNULL)
        client: pymongo.MongoClient = pymongo.MongoClient(
            self.uri, serverSelectionTimeoutMS=500, connectTimeoutMS=500, directConnection=True)
        deadline = time.monotonic() + self._start_timeout_s
        try:
            while True:
                try:
                    client.admin.command("ping")
                    return True
                except pymongo.errors.PyMongoError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        # __exit__ never runs when __enter__ raises: do not leave a stuck server behind.
                        self._stop()
                        return False
                    time.sleep(0.1)
        finally:
            client.close()

    def _log_tail(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        text = self._log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        if not text.strip():
            return f" (its log {self._log_path} is empty)"
        return f"; the end of its log ({self._log_path}):\n{text}"

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __exit__(self, *_exc) -> None:
        self._stop()


def refuse_used_port(port: int, hint: str) -> None:
    """RuntimeError naming ``hint`` when something listens on 127.0.0.1:``port``: a local server's
    readiness probe cannot tell its own server from another one already there."""
    with socket.socket() as probe:
        # As the servers bind: a port whose last connections linger in TIME_WAIT (a restart) is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise RuntimeError(f"port {port} on 127.0.0.1 is in use: {hint}") from None
