"""`batchery job worker --jobs N`: the parent that runs N jobs workers, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import child_pids, stop_process, wait_for
from tests.jobs_helpers import start_jobs_worker

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds a process' children in "
                                 "/proc, which this system does not have (Linux has)")]


def test_a_stop_while_a_dead_child_waits_to_restart_stops_the_pool(
        redis_url: str, queue_name: str, tmp_path: Path) -> None:
    """A jobs worker that dies is started again after a pause; SIGTERM during that pause
    stops the pool: the dead one is not started again behind the stop (the parent would
    then wait for it forever)."""
    log = tmp_path / "pool.log"
    pool = start_jobs_worker(redis_url, f"jobs-{queue_name}", "--jobs", "2", log=log)
    try:
        wait_for(lambda: len(child_pids(pool.pid)) == 2, 60, message="two jobs workers")
        os.kill(min(child_pids(pool.pid)), signal.SIGKILL)
        wait_for(lambda: "starting it again" in log.read_text(), 30,
                 message="the parent to see its child die")
        pool.send_signal(signal.SIGTERM)  # in the pause before the restart
        try:
            code = pool.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        assert code is not None, f"the pool did not stop:\n{log.read_text()[-3000:]}"
        assert "Traceback" not in log.read_text()
    finally:
        stop_process(pool)


def test_sigusr1_prints_where_each_process_is_and_they_carry_on(
        redis_url: str, queue_name: str, tmp_path: Path) -> None:
    """`kill -USR1` on a stuck-looking `batchery` process (here the pool and each of its
    jobs workers) prints each thread's stack on its stderr; none of them stops for it."""
    log = tmp_path / "pool.log"
    pool = start_jobs_worker(redis_url, f"jobs-{queue_name}", "--jobs", "2", log=log)
    try:
        wait_for(lambda: log.read_text().count("Listening on") >= 2, 60,
                 message="both jobs workers listening")
        processes = [pool.pid, *child_pids(pool.pid)]
        assert len(processes) == 3
        for n, pid in enumerate(processes, 1):  # one at a time: their dumps share the log
            os.kill(pid, signal.SIGUSR1)
            wait_for(lambda: log.read_text().count("Current thread") == n, 30,
                     message=f"a stack dump from process {n} of 3")
        dumps = log.read_text()  # the parent in its loop, each jobs worker in RQ's
        assert "run_pool" in dumps and dumps.count("rq/worker/base.py") >= 2
        assert pool.poll() is None and child_pids(pool.pid) == set(processes[1:])
    finally:
        assert stop_process(pool) == 0
    assert "Traceback" not in log.read_text()
