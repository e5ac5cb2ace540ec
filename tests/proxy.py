"""A TCP proxy between clients and Redis that misbehaves on purpose, for chaos tests.

Each connection gets its own upstream connection and one thread that pumps both ways.
Faults, drawn at random per chunk read:

- ``drop_reply``: a reply chunk from Redis is thrown away and the connection closed:
  the command ran, the caller never hears of it (its client retries);
- ``cut_command``: half of a command chunk is forwarded, then the connection closed:
  Redis discards the partial command;
- ``delay_s``: every reply is held up to this long.

And one targeted fault: :meth:`drop_reply_to` throws away the reply to the next command
that contains a marker (a script's SHA, say), as a lost reply on a busy network would.
"""

from __future__ import annotations

import random
import selectors
import socket
import threading
import time
from collections import Counter


class FaultyProxy:
    def __init__(self, upstream_port: int, drop_reply: float = 0.0, cut_command: float = 0.0,
                 delay_s: float = 0.0, seed: int = 0, cut_large_every: int = 0,
                 large_bytes: int = 8192) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.drop_reply, self.cut_command, self.delay_s = drop_reply, cut_command, delay_s
        # every cut_large_every-th reply whose first chunk holds large_bytes or more is cut
        # in half and its connection closed (0: never): a claim's reply lost on a flaky
        # network (one draw per reply, not per chunk: a long reply is not always lost)
        self.cut_large_every, self.large_bytes, self._large = cut_large_every, large_bytes, 0
        self.random = random.Random(seed)
        self.faults: Counter[str] = Counter()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.faulty = threading.Event()  # cleared: a plain proxy
        self.faulty.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._marker: bytes | None = None  # see drop_reply_to
        self._doomed_left = 0
        self._thread = threading.Thread(target=self._accept, name="proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_reply_to(self, marker: bytes, times: int = 1) -> None:
        """Drop the replies to the next ``times`` commands holding ``marker``: each runs,
        its connection closes before the caller hears back, so the caller retries it
        (``times`` past the client's retries: the call fails, and the caller's own
        recovery is what is tested)."""
        with self._lock:
            self._marker, self._doomed_left = marker, times

    def _doom(self, data: bytes) -> bool:
        with self._lock:
            if self._marker is not None and self._marker in data:
                self._doomed_left -= 1
                if self._doomed_left <= 0:
                    self._marker = None
                return True
            return False

    def close(self) -> None:
        self._stop.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it
        except OSError:
            pass
        self.listener.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _draw(self, p: float) -> bool:
        if not p or not self.faulty.is_set():
            return False
        with self._lock:
            return self.random.random() < p

    def _cut_large(self, data: bytes) -> bool:
        if not self.cut_large_every or len(data) < self.large_bytes or not self.faulty.is_set():
            return False
        with self._lock:
            self._large += 1
            return self._large % self.cut_large_every == 0

    def _count(self, fault: str) -> None:
        with self._lock:
            self.faults[fault] += 1

    def _pump(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=2)
        except OSError:  # Redis is down: the client sees a closed connection
            self._count("refused")
            client.close()
            return
        server.settimeout(None)
        peers = {client: server, server: client}
        doomed = False  # the reply on its way answers a command whose reply is to be lost
        fresh = False  # the next chunk from Redis starts a reply (a command went out since)
        with selectors.DefaultSelector() as sel:
            sel.register(client, selectors.EVENT_READ)
            sel.register(server, selectors.EVENT_READ)
            try:
                while not self._stop.is_set():
                    for key, _ in sel.select(timeout=0.5):
                        source: socket.socket = key.fileobj  # type: ignore[assignment]
                        data = source.recv(65536)
                        if source is server and doomed:
                            self._count("replies dropped on purpose")
                            return
                        doomed = doomed or (source is client and self._doom(data))
                        starts_reply, fresh = (source is server and fresh), (
                            source is client or (fresh and source is not server))
                        if not data or not self._forward(data, source is client, peers[source],
                                                         starts_reply):
                            return
            except OSError:
                return
            finally:
                client.close()
                server.close()

    def _forward(self, data: bytes, to_redis: bool, target: socket.socket,
                 starts_reply: bool = False) -> bool:
        """Send ``data`` on, or inject a fault; False: close the connection."""
        if to_redis:
            if len(data) > 1 and self._draw(self.cut_command):
                target.sendall(data[:len(data) // 2])
                self._count("commands cut")
                return False
        else:
            if self.delay_s and self.faulty.is_set():
                time.sleep(self.random.uniform(0, self.delay_s))
            if self._draw(self.drop_reply):
                self._count("replies dropped")
                return False
            if starts_reply and self._cut_large(data):
                target.sendall(data[:len(data) // 2])
                self._count("large replies cut")
                return False
        target.sendall(data)
        return True
