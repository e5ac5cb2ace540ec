"""RQ's own tools show batchery's offline jobs, run exactly as docs/guides/offline-jobs.md
shows them: rq-dashboard (`rq-dashboard -u URL -j`) in headless Chromium, and `rq info --url URL
--serializer json QUEUE`, for a job while it runs and once it has finished."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from selenium import webdriver

from tests.conftest import ROOT, cli_env, free_port, start_worker, stop_process, wait_for
from tests.dashboard_helpers import browser, http  # noqa: F401 (browser: a fixture)
from tests.jobs_helpers import read_jsonl, requests, start_jobs_worker, submit, write_lines

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent  # the venv's console scripts: rq, rq-dashboard


@contextmanager
def rq_dashboard(redis_url: str, log: Path) -> Iterator[str]:
    """The docs' `rq-dashboard -u URL -j`, on a free loopback port; yields its address."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "rq-dashboard"), "-u", redis_url, "-j",
                                 "--bind", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                                env=cli_env(), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(proc, url, log), 30, 0.1, message=f"rq-dashboard on {url}")
        yield url
    finally:
        stop_process(proc)


def _answers(proc: subprocess.Popen, url: str, log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"rq-dashboard exited {proc.returncode}: {log.read_text()}")
    try:
        return http(f"{url}/0/data/queues.json").status == 200
    except OSError:
        return False


def rq_info(redis_url: str, queue: str) -> str:
    """The docs' `rq info --url URL --serializer json QUEUE`."""
    done = subprocess.run([str(BIN / "rq"), "info", "--url", redis_url, "--serializer", "json",
                           queue], capture_output=True, text=True, timeout=60, env=cli_env())
    assert done.returncode == 0, done.stderr
    return done.stdout


def queue_row(driver: webdriver.Chrome, queue: str) -> list[str] | None:
    """The cells of the queue's row on the Queues page, as shown."""
    return driver.execute_script(
        "const row = [...document.querySelectorAll('#queues tr[data-role=queue]')]"
        ".find(r => r.cells[0].textContent.trim() === arguments[0]);"
        "return row ? [...row.cells].map(c => c.textContent.trim()) : null;", queue)


def job_rows(driver: webdriver.Chrome) -> list[str]:
    """The job ids a Jobs page lists."""
    return driver.execute_script("return [...document.querySelectorAll('#jobs tr[data-role=job]')]"
                                 ".map(r => r.dataset.jobId)")


def job_fields(driver: webdriver.Chrome) -> dict[str, str]:
    """A job's page: 'Status' -> its text, 'Result' -> ..., as labelled there (a block value,
    the result's <pre>, ends the label's paragraph and follows it)."""
    return driver.execute_script(
        "const out = {}; document.querySelectorAll('#job-data p').forEach(p => {"
        "  const label = p.querySelector('strong'); if (!label) return;"
        "  let value = p.textContent.slice(p.textContent.indexOf(':') + 1).trim();"
        "  const next = p.nextElementSibling;"
        "  if (!value && next && !next.querySelector('strong')) value = next.textContent.trim();"
        "  out[label.textContent.trim()] = value; }); return out;")


def worker_rows(driver: webdriver.Chrome) -> list[str]:
    """The Workers page's rows as text (worker name, current job, queues)."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#workers tr[data-role=worker]')]"
        ".map(r => r.textContent.replace(/\\s+/g, ' ').trim())")


def shows(driver: webdriver.Chrome, url: str, read: Callable[[webdriver.Chrome], Any],
          want: Callable[[Any], Any], wait_s: float = 60) -> bool:
    """Load ``url`` and wait up to ``wait_s`` for its script to fill the page with what
    ``want`` accepts (from what ``read`` reads): the state it shows holds still, so only a
    page that never shows it fails (a busy machine renders slowly, it does not time out)."""
    driver.get(url)
    try:
        wait_for(lambda: want(read(driver)), wait_s, 0.1, message=url)
        return True
    except AssertionError:
        return False


# Queues page columns: Queue, Queued, Deferred, Scheduled, Started, Finished, Failed, Canceled
STARTED, FINISHED, FAILED = 4, 5, 6


def test_rq_dashboard_and_rq_info_show_a_running_then_a_finished_job(
        browser: webdriver.Chrome, redis_url: str, queue_name: str, tmp_path: Path) -> None:
    jobs_queue = f"jobs-{queue_name}"
    gate, running = tmp_path / "gate", tmp_path / "running"
    gate.touch()  # the model worker holds its first batch while this file exists
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:gated",
                          BATCHERY_TEST_GATE=str(gate), BATCHERY_TEST_MARK=str(running))
    jobs_worker = start_jobs_worker(redis_url, jobs_queue)
    output = tmp_path / "results.jsonl"
    try:
        job = submit(redis_url, jobs_queue, queue_name,
                     write_lines(tmp_path / "requests.jsonl", requests(20)), output)
        wait_for(running.exists, 60, message="the job's first batch running")
        with rq_dashboard(redis_url, tmp_path / "rq-dashboard.log") as board:
            # running: one started job on the Queues page, listed under "started", its page
            # says started with batchery's progress as metadata
            assert shows(browser, f"{board}/0/view/queues", lambda d: queue_row(d, jobs_queue),
                         lambda row: row and row[STARTED] == "1" and row[FINISHED] == "0")
            assert shows(browser, f"{board}/0/view/jobs/{jobs_queue}/started/8/asc/1", job_rows,
                         lambda ids: ids == [job])
            assert shows(browser, f"{board}/0/view/job/{job}", job_fields,
                         lambda f: f.get("Status") == "started")
            running_view = job_fields(browser)
            assert json.loads(running_view["Metadata"])["phase"] == "running"
            assert running_view["Result"] == "null"
            assert f"{jobs_queue} " in (info := rq_info(redis_url, jobs_queue))
            assert "1 executing, 0 finished" in info and f"busy {jobs_queue}" in info

            gate.unlink()  # let the batches through: the job finishes
            done = ("0", "1", "0")  # started, finished, failed
            assert wait_for(lambda: shows(
                browser, f"{board}/0/view/queues", lambda d: queue_row(d, jobs_queue),
                lambda row: row and (row[STARTED], row[FINISHED], row[FAILED]) == done,
                wait_s=10), 120,  # loaded again until it shows the job's change
                message="the job finished on the Queues page")
            assert shows(browser, f"{board}/0/view/jobs/{jobs_queue}/finished/8/asc/1", job_rows,
                         lambda ids: ids == [job])
            assert shows(browser, f"{board}/0/view/job/{job}", job_fields,
                         lambda f: f.get("Status") == "finished")
            result = json.loads(job_fields(browser)["Result"])
            assert result["phase"] == "finished" and result["ok"] == 20 and result["error"] == 0
            # rq-dashboard 0.9 lists workers only while none runs a job: it reads a busy
            # worker's job with pickle, whatever -j says (the docs say so)
            assert shows(browser, f"{board}/0/view/workers", worker_rows,
                         lambda rows: any(r.endswith(f"idle {jobs_queue}") for r in rows))
            info = rq_info(redis_url, jobs_queue)
            assert "0 executing, 1 finished, 0 failed" in info and f"idle {jobs_queue}" in info
    finally:
        gate.unlink(missing_ok=True)
        stop_process(jobs_worker)
        stop_process(worker)
    assert len(read_jsonl(output)) == 20
