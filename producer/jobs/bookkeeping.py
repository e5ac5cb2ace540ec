"""Offline jobs on RQ: a JSONL file of requests in, a JSONL file of results out.

A job is a plain RQ job (JSON serializer, no pickle) in the RQ queue ``batchery``, so
``rq info`` and rq-dashboard show it and RQ's retries and failure registry apply. Its
function (:func:`batchery.producer.jobs.run.run_job`) streams the file into a request
queue. This module is the bookkeeping around it: submit, look up, list, cancel, and
the lifecycle and progress read from the RQ job and its meta.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from batchery.batching.request import check_priority, check_tenant, unknown_class
from batchery.batching.sharded import open_queue
from batchery.batching.keys import check_queue_name
from batchery.config import DEFAULT_QUEUE
from batchery.config import JOBS_QUEUE
from batchery.connection import text_client
from batchery.errors import ConfigError, InvalidRequest, JobNotFound
from batchery.producer.jobs.files import errors_path
from batchery.producer.jobs.run import run_job
from batchery.producer.jobs.spec import (CANCELLED, DEFAULT_MAX_IN_FLIGHT, DEFAULT_PRIORITY,
                                         DEFAULT_RETRIES, FAILED, FINALIZING, FINISHED,
                                         QUEUED, RUNNING, JobSpec, Progress)

RESULT_TTL_S = 7 * 86_400    # a finished job stays listed a week (RQ's default is 500 s)
JOBS_SHOWN = 20              # jobs listed at once, newest first: `job status`, the dashboard
WITHDRAW_SCAN = 1000         # ids per SCAN and per cancel call when a job is withdrawn
STALE_S = 30.0               # a running job silent this long may have lost its worker
# The RQ job's function, by import path: what a jobs worker agrees to run.
JOB_FUNC = f"{run_job.__module__}.{run_job.__qualname__}"


def rq_queue(conn: redis.Redis, name: str = JOBS_QUEUE) -> Queue:
    return Queue(name, connection=conn, serializer=JSONSerializer)


# -- submit -------------------------------------------------------------------------------
def submit(conn: redis.Redis, input: str, output: str, errors: str | None = None,
           queue: str = DEFAULT_QUEUE, priority: str | int = DEFAULT_PRIORITY,
           max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, retries: int = DEFAULT_RETRIES,
           overwrite: bool = False, jobs_queue: str = JOBS_QUEUE, output_format: str = "batchery",
           expires_at: float | None = None, meta: dict[str, Any] | None = None,
           tenant: str | None = None) -> Job:
    """Check the files, create the outputs, and enqueue the RQ job. Raises ConfigError.
    ``output_format`` "openai" writes OpenAI's batch output and error lines; ``expires_at``
    (epoch seconds) is every request's deadline; ``meta`` joins the RQ job's meta;
    ``tenant``: whose fair share the job's lines are served from (None: the job id's)."""
    check_queue_name(queue)
    if max_in_flight < 1:
        raise ConfigError(f"--max-in-flight must be at least 1, got {max_in_flight}")
    if retries < 0:
        raise ConfigError(f"--retries must be 0 or more, got {retries}")
    priority = check_priority(priority)
    tenant = None if tenant is None else check_tenant(tenant)
    with text_client(conn) as text:
        classes = open_queue(text, queue).settings().class_delays
    why = unknown_class(priority, classes)
    if why:
        raise InvalidRequest(f"queue {queue!r}: {why}")
    source = _readable(Path(input))
    out = Path(output).expanduser().absolute()
    err = Path(errors).expanduser().absolute() if errors else errors_path(out)
    if source in (out, err) or out == err:
        raise ConfigError("the input, output and errors files must be three different files")
    created = [_create(out, overwrite)]
    try:
        created.append(_create(err, overwrite))
    except ConfigError:
        out.unlink()
        raise
    stat = source.stat()
    spec = JobSpec(input=str(source), output=str(out), errors=str(err), queue=queue,
                   priority=int(priority) if priority.isdigit() else priority,
                   max_in_flight=max_in_flight, input_size=stat.st_size,
                   input_mtime_ns=stat.st_mtime_ns, output_format=output_format,
                   expires_at=expires_at, tenant=tenant)
    try:
        return rq_queue(conn, jobs_queue).enqueue_call(
            JOB_FUNC, kwargs=asdict(spec), job_id=secrets.token_hex(6), timeout=-1,
            result_ttl=RESULT_TTL_S, description=f"batchery: {source.name} -> {out.name} "
            f"(queue {queue})", meta={**(meta or {}), **Progress().meta(QUEUED)},
            retry=Retry(max=retries) if retries else None)
    except BaseException:
        for path in created:
            path.unlink(missing_ok=True)
        raise


def _readable(path: Path) -> Path:
    path = path.expanduser().absolute()
    try:
        with open(path, "rb") as f:
            f.read(1)
    except IsADirectoryError:
        raise ConfigError(f"cannot read {path}: it is a directory; give a JSONL file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the input {path}: {exc.strerror or exc}; check the path "
                          "and its permissions") from None
    return path


def _create(path: Path, overwrite: bool) -> Path:
    """Create (or with overwrite, empty) one output file, proving it can be written."""
    if path.is_dir():
        raise ConfigError(f"cannot write {path}: it is a directory; give a file name with -o")
    try:
        with open(path, "wb" if overwrite else "xb"):
            pass
    except FileExistsError:
        raise ConfigError(f"{path} exists already; choose another -o, or pass --overwrite to "
                          "replace it") from None
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}; choose a writable "
                          "path with -o") from None
    return path


# -- look up ------------------------------------------------------------------------------
def fetch(conn: redis.Redis, job_id: str) -> Job:
    """The RQ job of a batchery offline job; raises JobNotFound."""
    try:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    except (NoSuchJobError, ValueError, TypeError):
        raise JobNotFound(f"no offline job {job_id!r}: it was deleted (e.g. from rq-dashboard, "
                          f"which cancels it) or finished over {RESULT_TTL_S // 86_400} days "
                          "ago; `batchery job list` lists recent jobs") from None
    if not is_offline_job(job):
        raise JobNotFound(f"RQ job {job_id!r} is not a batchery offline job")
    return job


def is_offline_job(job: Job) -> bool:
    return job.func_name == JOB_FUNC


def spec_of(job: Job) -> JobSpec:
    return JobSpec.from_kwargs(job.kwargs)


def lifecycle(status: JobStatus | str | None, phase: str | None) -> str:
    """queued, running, finalizing, finished, failed or cancelled."""
    if status == JobStatus.CANCELED or phase == CANCELLED:
        return CANCELLED
    if status == JobStatus.FINISHED:
        return FINISHED
    if status in (JobStatus.FAILED, JobStatus.STOPPED):
        return FAILED
    if status == JobStatus.STARTED:
        return FINALIZING if phase == FINALIZING else RUNNING
    return QUEUED


def describe(job: Job) -> dict[str, Any]:
    """What `batchery job status JOB --json` prints."""
    meta, spec = job.get_meta(), spec_of(job)
    state = lifecycle(job.get_status(), meta.get("phase"))
    pending = meta.get("pending")
    rate = meta.get("rate") or 0.0
    view: dict[str, Any] = {
        "id": job.id, "state": state, "total": meta.get("total"), "ok": meta.get("ok", 0),
        "error": meta.get("error", 0), "invalid": meta.get("invalid", 0), "pending": pending,
        "rate": rate if state == RUNNING else None,
        "eta_s": round(pending / rate, 1) if state == RUNNING and pending and rate else None,
        "queue": spec.queue, "input": spec.input, "output": spec.output, "errors": spec.errors,
        "enqueued_at": _iso(job.enqueued_at), "started_at": _iso(job.started_at),
        "ended_at": _iso(job.ended_at), "retries_left": job.retries_left}
    silent = time.time() - float(meta.get("updated_at") or time.time())
    view["stale_s"] = round(silent) if state in (RUNNING, FINALIZING) and silent > STALE_S else None
    if state == FAILED:
        view["failure"] = _last_line(job.exc_info)
    return view


def _iso(moment: Any) -> str | None:
    return moment.isoformat(timespec="seconds") if moment else None


def _last_line(text: str | None) -> str | None:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


def recent(conn: redis.Redis, jobs_queue: str = JOBS_QUEUE, limit: int = JOBS_SHOWN) -> list[Job]:
    """The queue's jobs in every RQ registry, newest first."""
    q = rq_queue(conn, jobs_queue)
    registries = (q.started_job_registry, q.finished_job_registry, q.failed_job_registry,
                  q.canceled_job_registry, q.scheduled_job_registry, q.deferred_job_registry)
    ids = list(dict.fromkeys([*q.get_job_ids(),
                              *(i for r in registries for i in r.get_job_ids(cleanup=False))]))
    jobs = [j for j in Job.fetch_many(ids, connection=conn, serializer=JSONSerializer)
            if j is not None and is_offline_job(j)]
    jobs.sort(key=lambda j: j.created_at.timestamp() if j.created_at else 0.0, reverse=True)
    return jobs[:limit]


# -- cancel -------------------------------------------------------------------------------
def cancel(conn: redis.Redis, job_id: str, wait_s: float = 5.0) -> tuple[str, int]:
    """Cancel a job: (its state before, queued requests removed).

    RQ marks it cancelled, so it never runs again; a running job sees that within a
    second, withdraws its queued requests and stops. Requests a dead run left queued
    are withdrawn here.
    """
    job = fetch(conn, job_id)
    before = lifecycle(job.get_status(), job.get_meta().get("phase"))
    if before in (FINISHED, CANCELLED):
        return before, 0
    job.cancel()
    with text_client(conn) as text:
        removed = withdraw(text, spec_of(job).queue, job.id)
    deadline = time.monotonic() + wait_s
    while before in (RUNNING, FINALIZING) and time.monotonic() < deadline:
        meta = job.get_meta()
        if meta.get("phase") in (CANCELLED, FINISHED):
            return before, removed + int(meta.get("withdrawn", 0))
        time.sleep(0.1)
    return before, removed


def withdraw(conn: redis.Redis, queue: str, job_id: str) -> int:
    """Cancel the job's requests still queued in ``queue``; returns how many."""
    requests = open_queue(conn, queue)
    ids = requests.active_ids(f"{job_id}[:#]*", count=WITHDRAW_SCAN)
    removed = 0
    for start in range(0, len(ids), WITHDRAW_SCAN):
        removed += sum(1 for flag in requests.cancel(ids[start:start + WITHDRAW_SCAN]) if flag)
    return removed

