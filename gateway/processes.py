"""`batchery serve --processes N` on Linux: N processes, each listening on the port with a
socket of its own (SO_REUSEPORT), so that the kernel deals new connections out evenly.

uvicorn's own ``workers=N`` shares one listening socket: whichever process wakes first
accepts every connection waiting, so 64 clients connecting at once landed 30, 21, 11 and 2
on four processes here, and the busiest process set the pace of all of them. With a socket
per process the kernel picks the process by a hash of each connection's addresses. This
process binds and listens on all N before starting any (a socket bound later would miss the
connections made before it), and keeps them: one whose process dies keeps its waiting
connections for the process started in its place. SIGTERM or Ctrl-C stops them all
gracefully. Elsewhere (no load-balancing SO_REUSEPORT) the command uses uvicorn's workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import sys
import threading
import time
from typing import Any

from batchery.errors import ConfigError

log = logging.getLogger(__name__)
BALANCED = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
STOP_GRACE_S = 30  # a stopping process finishes its requests in flight this long, no more
BACKLOG = 2048     # connections waiting to be accepted, per process (uvicorn's default)
POLL_S = 0.5       # how often the parent looks for a dead process to start again


def serve(processes: int, **uvicorn_config: Any) -> None:
    """Run ``processes`` uvicorn servers on ``uvicorn_config``'s host and port until SIGTERM
    or SIGINT; ``uvicorn_config`` names the app as an import string (each process imports it).
    A process that dies after it served is started again; raises ConfigError if the port
    cannot be bound, or, after stopping the others, if a process died before it could serve
    (it logged why)."""
    host, port = uvicorn_config["host"], uvicorn_config["port"]
    sockets: list[socket.socket] = []
    try:
        for _ in range(processes):
            sockets.append(_listen(host, port, uvicorn_config.get("backlog", BACKLOG)))
    except ConfigError:
        for sock in sockets:
            sock.close()
        raise
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no state forked
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}

    def start(sock: socket.socket) -> tuple[Any, Any]:
        serving = spawn.Event()
        child = spawn.Process(target=_serve_one, args=(uvicorn_config, sock, serving),
                              name="batchery-serve")
        child.start()
        return child, serving

    children = [start(sock) for sock in sockets]
    try:
        while not stop.wait(POLL_S):
            for i, (child, serving) in enumerate(children):
                if child.is_alive():
                    continue
                if not serving.is_set():
                    raise ConfigError(f"a serving process could not start on port {port} "
                                      f"(exit code {child.exitcode}; its error is above)")
                log.warning("serving process %d exited (code %s): starting another",
                            child.pid, child.exitcode)
                children[i] = start(sockets[i])
    finally:
        for child, _ in children:
            child.terminate()  # SIGTERM: uvicorn finishes what is in flight
        for child, _ in children:
            child.join(STOP_GRACE_S)
            if child.is_alive():
                child.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sock in sockets:
            sock.close()


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


def _serve_one(uvicorn_config: dict[str, Any], sock: socket.socket, serving: Any) -> None:
    """One process: uvicorn on its socket of the port; ``serving`` is set once it serves."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(**uvicorn_config))
    threading.Thread(target=_tell_when_serving, args=(server, serving), daemon=True).start()
    server.run(sockets=[sock])


def _tell_when_serving(server: Any, serving: Any) -> None:
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    serving.set()
