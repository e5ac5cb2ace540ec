"""The RQ worker class for offline jobs (``batchery job worker``).

RQ's ``SimpleWorker`` (the job runs in the worker process, so killing the worker kills
the job) with what long offline jobs need:

- a heartbeat thread while a job runs, so a killed worker's job is known abandoned
  after ``3 x job_monitoring_interval`` (not RQ's 60 s + the job's whole timeout), and
  maintenance (which retries abandoned jobs) as often, also while idle;
- a job cancelled while running (``batchery job cancel``) stays cancelled in RQ when its
  function returns, instead of being marked finished;
- a warm shutdown (SIGTERM) hands the running job back to the queue within a second,
  instead of waiting for a job that may run for hours;
- it runs batchery's job function only: any Redis writer can queue an RQ job naming any
  importable function, and a worker that ran it would run arbitrary code;
- a job deleted while running (rq-dashboard's Delete, RQ's ``job.delete()``) ends as a
  cancel: its queued requests are withdrawn, and RQ neither fails nor retries it.

``rq worker --worker-class batchery.producer.jobs.worker.JobsWorker`` runs it too
(:func:`worker_command` writes the whole line).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from rq.exceptions import InvalidJobOperation
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.worker import SimpleWorker, WorkerStatus

from batchery import tracing
from batchery.producer.jobs import run
from batchery.config import JOBS_QUEUE
from batchery.producer.jobs.bookkeeping import JOB_FUNC

log = logging.getLogger(__name__)
ABANDONED_AFTER_BEATS = 3  # missed heartbeats before a job counts as abandoned
HEARTBEAT_S = 10  # a running job's heartbeat: a dead worker's job is re-run within 30 s


class JobsWorker(SimpleWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("job_monitoring_interval", HEARTBEAT_S)
        super().__init__(*args, **kwargs)
        tracing.configure("batchery-jobs-worker")  # started by `rq worker` too, not only our CLI
        if "maintenance_interval" not in kwargs:
            self.maintenance_interval = self.abandoned_after

    @property
    def abandoned_after(self) -> int:
        return int(self.job_monitoring_interval * ABANDONED_AFTER_BEATS)

    @property
    def dequeue_timeout(self) -> int:
        """Wake from waiting for jobs in time for the next maintenance."""
        return max(1, min(int(self.maintenance_interval), self.worker_ttl - 15))

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.abandoned_after

    def execute_job(self, job: Job, queue: Queue) -> None:
        if job.func_name != JOB_FUNC:
            self.refuse(job, queue)
            return
        execution = self.prepare_execution(job)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.job_monitoring_interval):
                try:
                    self.maintain_heartbeats(job, execution)
                except Exception as exc:  # Redis away for a moment: the next beat retries
                    log.warning("job heartbeat failed (%s)", exc)

        heart = threading.Thread(target=beat, name="batchery-job-heartbeat", daemon=True)
        heart.start()
        try:
            self.perform_job(job, queue, execution)
        finally:
            stop.set()
            heart.join()
        self.set_state(WorkerStatus.IDLE)

    def refuse(self, job: Job, queue: Queue) -> None:
        """Fail a job that is not a batchery offline job, without importing or running it."""
        reason = (f"refused: batchery job worker runs only {JOB_FUNC}, and this job calls "
                  f"{job.func_name!r}; run other RQ jobs on a plain `rq worker` of their own queue")
        log.error("job %s: %s", job.id, reason)
        job.retries_left = 0
        self.handle_job_failure(job, queue, exc_string=reason)

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry: Any,
                           execution: Any) -> None:
        try:
            status = job.get_status(refresh=True)
        except InvalidJobOperation:  # deleted while running: what is left is RQ's heartbeat
            with self.connection.pipeline() as pipeline:
                self.cleanup_execution(job, pipeline=pipeline, execution=execution)
                pipeline.delete(job.key)  # RQ's delete removed the rest
                pipeline.execute()
            log.info("job %s was deleted while running: treated as a cancel (its queued "
                     "requests were withdrawn)", job.id)
            return
        if status == JobStatus.CANCELED:  # cancelled while running
            with self.connection.pipeline() as pipeline:
                self.cleanup_execution(job, pipeline=pipeline, execution=execution)
                pipeline.execute()
            job._status = JobStatus.CANCELED
            return
        super().handle_job_success(job, queue, started_job_registry, execution)

    def handle_warm_shutdown_request(self) -> None:
        super().handle_warm_shutdown_request()
        run.SHUTDOWN.set()


def worker_command(url: str, jobs_queue: str = JOBS_QUEUE) -> str:
    """The plain `rq worker` line that runs these jobs as `batchery job worker` does."""
    return (f"rq worker --url {url} --serializer json "
            f"--worker-class {JobsWorker.__module__}.{JobsWorker.__qualname__} {jobs_queue}")

