"""The local MongoDB server process (dev-stack --store mongo, the demo, the store's tests): started, failing loudly, stopped."""

from __future__ import annotations

import socket

import pymongo
import pytest

from worker.ops import localmongo
from worker.ops.localmongo import LocalMongo


def test_the_server_answers_on_its_uri_and_is_gone_after_the_block(tmp_path):
    """Inside the block the server answers a ping as a one-node replica set primary; after it, the process has ended."""
    with LocalMongo(log_path=tmp_path / "mongo.log") as server:
        client: pymongo.MongoClient = pymongo.MongoClient(server.uri, serverSelectionTimeoutMS=5000)
        try:
            hello = client.admin.command("hello")
            assert hello["isWritablePrimary"] is True and hello.get("setName")
        finally:
            client.close()
        proc = server._proc
    assert proc is not None and proc.poll() is not None


def test_a_server_that_cannot_start_fails_with_the_end_of_its_log(tmp_path):
    """A server that exits at start raises RuntimeError carrying its log's last lines, and leaves no process."""
    server = LocalMongo(log_path=tmp_path / "mongo.log", cache_size="not-a-size")
    with pytest.raises(RuntimeError) as caught:
        server.__enter__()
    assert "did not start" in str(caught.value) and str(tmp_path / "mongo.log") in str(caught.value)
    assert (tmp_path / "mongo.log").read_text().strip()[-200:] in str(caught.value)
    assert server._proc is None


def test_a_port_in_use_is_refused_before_anything_starts():
    """A fixed port another process holds is named in the error: the readiness ping could not tell the servers apart."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is in use"):
            LocalMongo(port=port).__enter__()


def test_a_port_whose_last_connection_lingers_in_time_wait_is_free_for_a_restart():
    """A port its previous server closed (its accepted connection in TIME_WAIT) is not refused as in use."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server's side closes first: its end of the connection waits in TIME_WAIT
        client.close()
    LocalMongo(port=port)._check_port_free()


def test_without_the_dev_dependency_it_says_how_to_install_it(monkeypatch):
    """Where secantusdb is not installed (the production image) the error names the dev install."""
    monkeypatch.setattr(localmongo, "server_installed", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[dev\]'"):
        LocalMongo().__enter__()


def test_the_server_is_run_from_this_python_with_its_documented_arguments():
    """The argv: this interpreter's secantus module on loopback, the given storage, a 128M cache, warnings only."""
    server = LocalMongo(port=4567, storage_path="/tmp/x")
    assert server.argv()[1:] == ["-m", "secantus", "--host", "127.0.0.1", "--port", "4567", "--storage-path",
                                 "/tmp/x", "--cache-size", "128M", "--log-level", "WARNING"]
    assert server.uri == "mongodb://127.0.0.1:4567/"


def test_the_gpl_server_is_a_dev_dependency_only_and_never_imported():
    """secantusdb (GPL-2.0) is pinned and in the dev extra, not a runtime dependency, and no shipped module imports it."""
    import re
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    named = re.compile(r"^secantusdb\b", re.IGNORECASE)
    assert not any(named.match(dep) for dep in project["dependencies"])
    assert any(named.match(dep) for dep in project["optional-dependencies"]["dev"])
    assert re.search(r"^secantusdb==\S+$", (repo / "constraints.txt").read_text(), re.IGNORECASE | re.MULTILINE)
    importing = [str(path.relative_to(repo)) for package in ("worker", "pipeline") for path in (repo / package).rglob("*.py")
                 if re.search(r"^\s*(import|from)\s+secantus\b", path.read_text(), re.MULTILINE)]
    assert importing == []
