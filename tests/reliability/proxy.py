"""A loopback TCP proxy between one worker and the moto server, switched by the test.

Modes: ``passthrough``; ``drop`` (every open connection closed, new ones closed at accept);
``stall`` (bytes held in both directions until released, as a network partition does: a request
held mid-body lands late, after the partition heals); ``delay`` (latency added to every chunk).
``stall_after(n)`` arms a stall that starts the moment ``n`` more bytes have gone upstream, so a
partition lands in the middle of an upload rather than between two requests.

Bounded: it listens on 127.0.0.1 only, a stall releases itself after ``max_stall_s``, every socket
wait has a short timeout so ``stop`` ends every thread, and all threads are daemons.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

_CHUNK_BYTES = 64 * 1024
_POLL_S = 0.2
PASS, DROP, STALL, DELAY = "pass", "drop", "stall", "delay"


def loopback_target(url: str) -> tuple[str, int]:
    """(host, port) of an http://127.0.0.1:<port> URL; anything off the loopback is refused."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
        raise ValueError(f"the proxy only forwards to a loopback port: {url!r}")
    return "127.0.0.1", parts.port


class FaultProxy:
    def __init__(self, target_url: str, *, max_stall_s: float = 30.0):
        self._target = loopback_target(target_url)
        self._max_stall_s = max_stall_s
        self._cond = threading.Condition()
        self._mode = PASS
        self._delay_s = 0.0
        self._stall_until = 0.0
        self._armed_bytes: int | None = None
        self._conns: set[socket.socket] = set()
        self._stopped = threading.Event()
        self.stalls = 0  # how many stalls began (a test can see that an armed one fired)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"proxy-{self.port}", daemon=True)

    # --- control
    def start(self) -> FaultProxy:
        self._acceptor.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.passthrough()
        self._close_all()
        self._acceptor.join(5)
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()

    @property
    def mode(self) -> str:
        with self._cond:
            self._expire_stall()
            return self._mode

    def passthrough(self) -> None:
        self._set(PASS)

    def drop(self) -> None:
        self._set(DROP)
        self._close_all()

    def stall(self) -> None:
        self._set(STALL)

    def delay(self, delay_s: float) -> None:
        self._set(DELAY, delay_s=delay_s)

    def stall_after(self, upstream_bytes: int) -> None:
        """Pass traffic until ``upstream_bytes`` more have gone to the server, then stall."""
        with self._cond:
            self._armed_bytes = upstream_bytes

    def disarm(self) -> None:
        with self._cond:
            self._armed_bytes = None

    def _set(self, mode: str, delay_s: float = 0.0) -> None:
        with self._cond:
            if mode == STALL and self._mode != STALL:
                self.stalls += 1
                self._stall_until = time.monotonic() + self._max_stall_s
            self._mode, self._delay_s, self._armed_bytes = mode, delay_s, None
            self._cond.notify_all()

    def _expire_stall(self) -> None:
        # Caller holds the lock. A test that forgets to release does not hold the worker forever.
        if self._mode == STALL and time.monotonic() >= self._stall_until:
            self._mode = PASS
            self._cond.notify_all()

    # --- plumbing
    def _close_all(self) -> None:
        with self._cond:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            _close(conn)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.mode == DROP:
                _close(client)  # refused: the worker sees a reset
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._cond:
                self._conns.update((client, upstream))
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        src.settimeout(_POLL_S)
        try:
            while not self._stopped.is_set():
                try:
                    data = src.recv(_CHUNK_BYTES)
                except TimeoutError:
                    continue
                if not data:
                    return
                if upstream:
                    self._count_upstream(len(data))
                delay_s = self._hold()
                if delay_s is None:
                    return
                if delay_s:
                    time.sleep(delay_s)
                dst.sendall(data)
        except OSError:
            return
        finally:
            _close(src)
            _close(dst)

    def _count_upstream(self, n_bytes: int) -> None:
        with self._cond:  # a reentrant lock: stall() takes it again
            if self._armed_bytes is None:
                return
            self._armed_bytes -= n_bytes
            if self._armed_bytes <= 0:
                self.stall()  # before this chunk is forwarded: the rest of the request is held

    def _hold(self) -> float | None:
        """Wait out a stall; the delay to add to this chunk, or None when the connection is dropped."""
        with self._cond:
            while True:
                self._expire_stall()
                if self._stopped.is_set() or self._mode == DROP:
                    return None
                if self._mode != STALL:
                    return self._delay_s if self._mode == DELAY else 0.0
                self._cond.wait(min(_POLL_S, max(0.0, self._stall_until - time.monotonic())))


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
