"""The jobs worker runs batchery's job function only, and a job deleted from RQ while
running (rq-dashboard's Delete) ends as a clean cancel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tests.conftest import run_cli, stop_process, wait_for
from tests.jobs_helpers import requests, start_jobs_worker, status, submit, write_lines


@pytest.fixture
def jobs_queue(queue_name: str) -> str:
    return f"jobs-{queue_name}"


def test_the_jobs_worker_refuses_any_other_function(redis_url: str, jobs_queue: str,
                                                     tmp_path: Path) -> None:
    """Anyone who can write to Redis can queue an RQ job; the jobs worker must not run it."""
    target = tmp_path / "should-not-exist"
    conn = redis.Redis.from_url(redis_url)
    job = Queue(jobs_queue, connection=conn, serializer=JSONSerializer).enqueue(
        "os.makedirs", str(target), retry=Retry(max=2))
    done = run_cli("job", "worker", "--jobs-queue", jobs_queue, "--burst", redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    assert not target.exists()
    job = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FAILED  # failed once, not retried
    assert "runs only batchery.producer" in (job.latest_result().exc_string or "")
    assert "refused" in done.stderr and "'os.makedirs'" in done.stderr
    assert "Traceback" not in done.stderr
    conn.close()


def test_a_job_deleted_while_running_ends_as_a_cancel(redis_url: str, queue_name: str,
                                                      jobs_queue: str, tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", requests(300))
    output = tmp_path / "out.jsonl"
    log = tmp_path / "jobs.log"
    jobs_worker = start_jobs_worker(redis_url, jobs_queue, log=log)  # no model worker: all wait
    conn = redis.Redis.from_url(redis_url)
    try:
        job_id = submit(redis_url, jobs_queue, queue_name, source, output)
        wait_for(lambda: status(redis_url, job_id)["pending"] == 300, 60,
                 message="the job's 300 requests queued")
        Job.fetch(job_id, connection=conn, serializer=JSONSerializer).delete()  # what the dashboard does
        wait_for(lambda: "was deleted while running" in log.read_text(), 30,
                 message="the jobs worker to finish the deleted job")
        gone = run_cli("job", "status", job_id, redis_url=redis_url)
        assert gone.returncode == 4 and "it was deleted" in gone.stderr, gone.stderr
        assert not conn.exists(Job.key_for(job_id))  # no leftover of RQ's heartbeat
        queue = Queue(jobs_queue, connection=conn, serializer=JSONSerializer)
        assert queue.count == 0 and queue.failed_job_registry.count == 0  # no retry, no failure
        stats = json.loads(run_cli("queue", "stats", "-q", queue_name, "--json", redis_url=redis_url).stdout)
        assert stats["queues"][queue_name]["pending"] == 0  # its requests were withdrawn
    finally:
        stop_process(jobs_worker)
        conn.close()
    assert output.read_text() == ""
    text = log.read_text()
    assert "Traceback" not in text and "InvalidJobOperation" not in text and "retry" not in text
