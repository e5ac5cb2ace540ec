"""``--concurrency N``: N worker processes under one parent.

Each child is the same command with ``--concurrency 1``; the parent serves all their
metrics on the one --metrics-port (prometheus_client's multiprocess mode: each child
writes its values to files in a private directory, the parent adds them up), so one
scrape and one probe cover the pod. On a machine with several GPUs child i sees only GPU i mod count (CUDA_VISIBLE_DEVICES),
so the children spread over the GPUs instead of sharing cuda:0; a child that dies is
restarted with backoff, unless a stop came meanwhile; SIGTERM/SIGINT are passed on to all.
"""

from __future__ import annotations

from typing import Any

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)
# A worker process that keeps dying (a bad model, no memory) is restarted after 1 s, then
# 2, 4... up to this: the machine is not kept busy by a crash loop, a fix is seen soon.
RESTART_BACKOFF_CAP_S = 30.0


def child_argv(argv: list[str]) -> list[str]:
    """argv with --concurrency 1 and no metrics port (the parent serves metrics)."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in ("--concurrency", "--metrics-port"):
            skip = True
            continue
        if arg.startswith(("--concurrency=", "--metrics-port=")):
            continue
        out.append(arg)
    return out + ["--concurrency", "1"]


def child_env(index: int, device: str, visible: list[str], metrics_dir: str) -> dict[str, str]:
    """The environment of child ``index``: its metrics in ``metrics_dir``, and pinned to
    one of the ``visible`` GPUs when the device is auto or plain cuda (a device that
    names a GPU, cuda:1, is the user's pin)."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir)
    env.pop("BATCHERY_METRICS_PORT", None)  # the parent serves them
    if device in ("auto", "cuda") and len(visible) > 1:
        env["CUDA_VISIBLE_DEVICES"] = visible[index % len(visible)]
    return env


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        import torch
        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def supervise(n: int, metrics_port: int | None, device: str = "auto") -> int:
    """Run n children until they all exit; restart those that crash (non-zero exit)."""
    base = [sys.executable, "-m", "batchery", *sys.argv[1:]]
    gpus = visible_gpus() if device in ("auto", "cuda") else []
    if len(gpus) > 1:
        log.info("%d worker processes over %d GPUs (%s)", n, len(gpus), ",".join(gpus))

    metrics_dir = tempfile.mkdtemp(prefix="batchery-metrics-")
    if metrics_port:
        serve_children_metrics(metrics_port, metrics_dir)

    def start(i: int) -> subprocess.Popen:
        return subprocess.Popen(child_argv(base), env=child_env(i, device, gpus, metrics_dir))

    def gone(pid: int) -> None:  # its live gauges stop counting
        from prometheus_client.multiprocess import mark_process_dead
        mark_process_dead(pid, metrics_dir)

    try:
        return _supervise(n, start, gone)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def serve_children_metrics(port: int, metrics_dir: str) -> None:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics_dir)
    start_http_server(port, registry=registry)


def _supervise(n: int, start: Any, gone: Any) -> int:
    children = {i: start(i) for i in range(n)}
    backoff = dict.fromkeys(children, 1.0)
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while any(c.poll() is None for c in children.values()) or not stopping:
        for i, child in list(children.items()):
            code = child.poll()
            if code not in (None, 0) and not stopping:
                log.warning("worker process %d exited with %s; restarting in %.0fs", i, code, backoff[i])
                gone(child.pid)
                time.sleep(backoff[i])
                backoff[i] = min(backoff[i] * 2, RESTART_BACKOFF_CAP_S)
                if stopping:  # a stop during the pause: nothing to start again, and the
                    del children[i]  # stop, not the crash before it, is how it ended
                    continue
                children[i] = start(i)
                if stopping:  # it came while the child started: the child missed it
                    children[i].send_signal(signal.SIGTERM)
        if all(c.poll() == 0 for c in children.values()):
            break  # every child finished its work (burst) or was stopped
        time.sleep(0.2)
    # a child stopped by the forwarded signal before it could install its handler is clean
    stopped = (0, -signal.SIGTERM, -signal.SIGINT)
    return max((abs(c.returncode) for c in children.values() if c.returncode not in stopped),
               default=0)
