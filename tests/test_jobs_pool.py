"""`batchery job worker --jobs N`: the parent that runs N jobs workers, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import stop_process, wait_for
from tests.jobs_helpers import start_jobs_worker

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads children from /proc")]


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (zombies, dead but not yet reaped, left out)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not a process, or gone meanwhile
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def test_a_stop_while_a_dead_child_waits_to_restart_stops_the_pool(
        redis_url: str, queue_name: str, tmp_path: Path) -> None:
    """A jobs worker that dies is started again after a pause; SIGTERM during that pause
    stops the pool: the dead one is not started again behind the stop (the parent would
    then wait for it forever)."""
    log = tmp_path / "pool.log"
    pool = start_jobs_worker(redis_url, f"jobs-{queue_name}", "--jobs", "2", log=log)
    try:
        wait_for(lambda: len(children(pool.pid)) == 2, 60, message="two jobs workers")
        os.kill(min(children(pool.pid)), signal.SIGKILL)
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
