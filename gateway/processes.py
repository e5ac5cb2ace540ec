"""`batchery serve --processes N` on Linux: N processes, each listening on the port with a
socket of its own (SO_REUSEPORT), so that the kernel spreads new connections over them.

uvicorn's own ``workers=N`` shares one listening socket: whichever process wakes first
accepts every connection waiting, so 64 clients connecting at once landed 30, 21, 11 and 2
on four processes here, and the busiest process set the pace of all of them. With a socket
per process the kernel picks the process by a hash of each connection's addresses (even
on average, blind to load). This process binds and listens on all N before starting any
(a socket bound later would miss the connections made before it) and keeps them: the
connections waiting on a dead process's socket wait for the one started in its place.

As uvicorn's supervisor: a process that exits or stops answering (its heartbeat thread
silent for HUNG_S, or never heard START_S after the spawn: stopped, or stuck holding the
interpreter) is started again; one that fails with an error before it ever served stops the command; SIGTERM, SIGINT or SIGHUP stops them all,
each finishing what is in flight, and a second signal stops them at once. A process whose
parent is gone stops too. Elsewhere (no load-balancing SO_REUSEPORT) the command uses
uvicorn's workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from batchery.errors import ConfigError

log = logging.getLogger(__name__)
BALANCED = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
LISTEN_BACKLOG = 2048  # connections waiting to be accepted, per process (uvicorn's default)
SUPERVISE_S = 0.5  # how often the parent looks at its processes
BEAT_S = 1.0  # how often a process says it is alive (once serving; every 50 ms before)
HUNG_S = 10.0  # a process silent this long since its last beat is killed and started again
START_S = 60.0  # and one that has not beaten this long after it was spawned (interpreter
                # start and imports come first: seconds on a loaded 2-core machine)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass
class Child:
    process: Any
    beat: Any     # shared double: when it last said it was alive (0: not yet)
    serving: Any  # shared flag: it has served
    started: float = field(default_factory=time.monotonic)

    def served(self) -> bool:
        return bool(self.serving.value)

    def silent_s(self) -> float:
        """Seconds since its last beat, or since it was spawned if none yet."""
        return time.monotonic() - (self.beat.value or self.started)

    def hung(self) -> bool:
        """Silent for HUNG_S since its last beat, or no beat START_S after it was spawned."""
        return self.silent_s() > (HUNG_S if self.beat.value else START_S)


def serve(processes: int, **uvicorn_config: Any) -> None:
    """Run ``processes`` uvicorn servers on ``uvicorn_config``'s host and port until a stop
    signal; ``uvicorn_config`` names the app as an import string (each process imports it).
    Raises ConfigError if the port cannot be bound, or, after stopping the others, if a
    process failed before it ever served (it logged why)."""
    host, port = uvicorn_config["host"], uvicorn_config["port"]
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no state forked
    signals: list[int] = []  # the handler only appends: the loop below looks
    previous = {s: signal.signal(s, lambda sig, _: signals.append(sig)) for s in STOP_SIGNALS}

    def start(sock: socket.socket) -> Child:
        beat, serving = spawn.Value("d", 0.0, lock=False), spawn.Value("b", 0, lock=False)
        process = spawn.Process(target=_serve_one, args=(uvicorn_config, sock, beat, serving),
                                name="batchery-serve")
        process.start()
        return Child(process, beat, serving)

    sockets: list[socket.socket] = []
    children: list[Child] = []
    try:
        sockets += [_listen(host, port, uvicorn_config.get("backlog", LISTEN_BACKLOG))
                    for _ in range(processes)]
        children += [start(sock) for sock in sockets]
        while not signals:
            time.sleep(SUPERVISE_S)
            for i, child in enumerate(children):
                if signals:
                    break
                if child.hung():
                    log.warning("serving process %d silent for %.0f s: killing it",
                                child.process.pid, child.silent_s())
                    child.process.kill()
                    child.process.join()
                elif child.process.is_alive():
                    continue
                if not child.served() and child.process.exitcode > 0:
                    raise ConfigError(f"a serving process could not start on port {port} "
                                      f"(exit code {child.process.exitcode}; its error is above)")
                log.warning("serving process %d exited (code %s): starting another",
                            child.process.pid, child.process.exitcode)
                children[i] = start(sockets[i])
    finally:
        _stop(children, signals)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sock in sockets:
            sock.close()


def _stop(children: list[Child], signals: list[int]) -> None:
    """SIGTERM each process (uvicorn finishes what is in flight) and wait for them all; a
    signal to this process meanwhile kills those still running."""
    asked = len(signals)
    for child in children:
        child.process.terminate()
    for child in children:
        while child.process.is_alive():
            child.process.join(SUPERVISE_S)
            if len(signals) > asked:
                for other in children:
                    other.process.kill()


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on the shared port, one of a SO_REUSEPORT group."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _serve_one(uvicorn_config: dict[str, Any], sock: socket.socket, beat: Any,
               serving: Any) -> None:
    """One process: uvicorn on its socket of the port, and a thread that beats."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(**uvicorn_config))
    threading.Thread(target=_beat, args=(server, beat, serving), daemon=True).start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C reached this process too: uvicorn stopped it gracefully
        pass


def _beat(server: Any, beat: Any, serving: Any) -> None:
    """Say this process is alive every BEAT_S, and once ``server`` serves, that it does;
    stop it if the parent is gone."""
    parent = multiprocessing.parent_process()
    while not server.should_exit:
        beat.value = time.monotonic()
        if server.started:
            serving.value = 1
        wait_s = BEAT_S if server.started else 0.05
        if parent is not None and multiprocessing.connection.wait([parent.sentinel], wait_s):
            log.warning("the `batchery serve` process is gone: stopping")
            server.should_exit = True
            return
