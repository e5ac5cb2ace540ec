"""``batchery job worker --jobs N``: N jobs workers under one parent, so that N offline
jobs feed the request queue side by side (one RQ worker runs one job at a time).

Each child is ``batchery job worker --jobs 1`` with the same options; the Redis URL goes
to it in the environment, never on a command line (where ``ps`` would show a password).
SIGTERM and SIGINT are passed on to every child (each hands its running job back); a
child that dies is started again after a pause, unless a stop came meanwhile; the parent
exits when all have exited.
On Linux a child is killed with its parent (SIGKILL included): its job is then abandoned
and re-run by RQ, as a lone jobs worker's would be.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from batchery.config import ENV_REDIS_URL

log = logging.getLogger(__name__)
RESTART_PAUSE_S = 2.0  # a child that keeps dying (Redis refusing it, say) is not a busy loop


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux prctl
    PR_SET_PDEATHSIG); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent)


def run_pool(options: list[list[str]], redis_url: str) -> int:
    """Run one child per entry of ``options`` (its job worker options, less --jobs);
    their worst exit code once all have exited."""
    argvs = [[sys.executable, "-m", "batchery", "job", "worker", "--jobs", "1", *o] for o in options]
    env = dict(os.environ, **{ENV_REDIS_URL: redis_url})
    n = len(argvs)
    children = [_start(argv, env) for argv in argvs]
    stopping: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes: dict[int, int] = {}
    while len(codes) < n:
        for i, child in enumerate(children):
            code = child.poll()
            if code is None or i in codes:
                continue
            if code != 0 and not stopping:
                log.warning("jobs worker %d exited with %d; starting it again in %.0fs",
                            i, code, RESTART_PAUSE_S)
                time.sleep(RESTART_PAUSE_S)
                if not stopping:  # a stop during the pause: nothing to start again
                    children[i] = _start(argvs[i], env)
                    if stopping:  # it came while the child started: the child missed it
                        children[i].send_signal(stopping[-1])
                    continue
            codes[i] = code
        time.sleep(0.2)
    return max(codes.values())
