"""``batchery job``: submit, status, list, results, cancel, and the jobs worker."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click
import redis

from batchery.batching.request import parse_priority
from batchery.cli_shared import (jobs_queue_option, json_option, print_json, queue_option,
                                 redis_options)
from batchery.config import JOBS_QUEUE
from batchery.connection import Backoff, RedisSettings, redact
from batchery.errors import ConfigError, NotOk
from batchery.producer.jobs import bookkeeping as jobs
from batchery.producer.jobs.files import OPENAI
from batchery.producer.jobs.pool import run_pool
from batchery.producer.jobs.worker import HEARTBEAT_S, JobsWorker, worker_command

log = logging.getLogger(__name__)
WATCH_S = 0.5  # `job status --watch` redraws this often: live, at two reads a second
# Jobs one `batchery job worker` runs side by side: two jobs submitted together both feed
# the queue (and share it by tenant, docs/fair-share.md); each is a light process.
DEFAULT_JOBS = 4
MAX_JOBS = 64  # a pool of light processes; past this, run more `job worker`s instead
TERMINAL = (jobs.FINISHED, jobs.FAILED, jobs.CANCELLED)


def _rq_conn(redis_url: str, cluster: bool) -> redis.Redis:
    return RedisSettings.from_url(redis_url, cluster=cluster).binary_client()


@click.group("job")
def job_group() -> None:
    """Offline jobs: a JSONL file of requests in, a JSONL file of results out (on RQ)."""


@job_group.command("submit")
@click.argument("input_path", metavar="INPUT")
@click.option("--output", "-o", required=True, help="Where result lines go (JSONL).")
@click.option("--errors", help="Where invalid lines go [default: OUTPUT with .errors.jsonl].")
@click.option("--priority", "-p", default=jobs.DEFAULT_PRIORITY, show_default=True,
              help="For lines that name none: realtime, normal, batch, or a delay in seconds.")
@click.option("--tenant", help="Whose fair share of the queue's class the lines that name "
              "no tenant are served from [default: the job's own id].")
@click.option("--max-in-flight", type=int, default=jobs.DEFAULT_MAX_IN_FLIGHT, show_default=True,
              help="Lines queued at once.")
@click.option("--retries", type=int, default=jobs.DEFAULT_RETRIES, show_default=True,
              help="RQ re-runs a failed or abandoned job this often; each run resumes.")
@click.option("--overwrite", is_flag=True, allow_from_autoenv=False,
              help="Replace existing output and errors files.")
@click.option("--output-format", type=click.Choice(["batchery", OPENAI]), default="batchery",
              show_default=True, help="openai: OpenAI's batch output lines (failed requests "
              "and invalid lines in the errors file, in OpenAI's shape).")
@jobs_queue_option
@json_option
@queue_option
@redis_options
def submit(input_path: str, output: str, errors: str | None, priority: str,
           tenant: str | None, max_in_flight: int, retries: int, overwrite: bool,
           output_format: str, jobs_queue: str, as_json: bool, queue: str, redis_url: str,
           cluster: bool) -> None:
    """Run a JSONL file of requests as an offline job; prints the job id.

    Each line is an object: custom_id (or id), input, and optionally priority,
    deadline, tokens, meta, tenant; or an OpenAI batch line (custom_id, method, url,
    body), as the OpenAI Batch API and `vllm run-batch` take it. Results go to OUTPUT as
    lines complete; invalid lines go
    to the errors file with their line number and reason.
    """
    settings = RedisSettings.from_url(redis_url, cluster=cluster)
    conn = settings.binary_client()
    job = jobs.submit(conn, input_path, output, errors, queue=queue, priority=parse_priority(priority),
                      max_in_flight=max_in_flight, retries=retries, overwrite=overwrite,
                      jobs_queue=jobs_queue, output_format=output_format, tenant=tenant)
    spec = jobs.spec_of(job)
    if as_json:
        print_json({"id": job.id, "queue": spec.queue, "input": spec.input,
                    "output": spec.output, "errors": spec.errors})
    else:
        click.echo(job.id)
    click.echo(f"job {job.id} queued: {spec.input} -> {spec.output} (invalid lines: "
               f"{spec.errors})", err=True)
    if not _workers_on(conn, jobs_queue):
        click.echo("no jobs worker is running: start one with `batchery job worker"
                   f"{'' if jobs_queue == JOBS_QUEUE else ' --jobs-queue ' + jobs_queue}` "
                   f"(or `{worker_command(_rq_url(settings), jobs_queue)}`)", err=True)
    click.echo(f"follow it with `batchery job status {job.id} --watch`", err=True)


def _workers_on(conn: redis.Redis, jobs_queue: str) -> int:
    from rq import Worker
    return len(Worker.all(queue=jobs.rq_queue(conn, jobs_queue)))


def _rq_url(settings: RedisSettings) -> str:
    return redact(settings.resolved_url())


@job_group.command("status")
@click.argument("job_id", metavar="[JOB]", required=False)
@json_option
@click.option("--watch", is_flag=True, allow_from_autoenv=False, help="A live progress bar "
              "until the job ends; exits 7 if it failed or was cancelled.")
@click.option("--limit", default=jobs.JOBS_SHOWN, show_default=True, help="Jobs listed without JOB.")
@jobs_queue_option
@redis_options
@click.pass_context
def status(ctx: click.Context, job_id: str | None, as_json: bool, watch: bool, limit: int,
           jobs_queue: str, redis_url: str, cluster: bool) -> None:
    """A job's state and counts (total, ok, error, pending); without JOB, as `job list`."""
    conn = _rq_conn(redis_url, cluster)
    if job_id is None:
        if watch:
            raise click.UsageError("--watch follows one job: give its id")
        _list(conn, jobs_queue, limit, as_json)
        return
    view = _watch(conn, job_id) if watch else jobs.describe(jobs.fetch(conn, job_id))
    click.echo(json.dumps(view, indent=2) if as_json else _human(view))
    if watch and view["state"] != jobs.FINISHED:
        ctx.exit(NotOk.exit_code)


@job_group.command("list")
@click.option("--limit", default=jobs.JOBS_SHOWN, show_default=True, help="At most this many jobs.")
@json_option
@jobs_queue_option
@redis_options
def job_list(limit: int, as_json: bool, jobs_queue: str, redis_url: str, cluster: bool) -> None:
    """The jobs the jobs queue knows, newest first, with their state and counts."""
    _list(_rq_conn(redis_url, cluster), jobs_queue, limit, as_json)


def _list(conn: redis.Redis, jobs_queue: str, limit: int, as_json: bool) -> None:
    views = [jobs.describe(job) for job in jobs.recent(conn, jobs_queue, limit)]
    if as_json:
        print_json({"jobs": views})
        return
    if not views:
        click.echo(f"no offline jobs in RQ queue {jobs_queue!r}; submit one with `batchery job submit`",
                   err=True)
        return
    click.echo(f"{'job':<14}{'state':<12}{'total':>9}{'ok':>9}{'error':>8}{'pending':>9}  "
               f"{'enqueued':<20} input")
    for v in views:
        click.echo(f"{v['id']:<14}{v['state']:<12}{_n(v['total']):>9}{v['ok']:>9}{v['error']:>8}"
                   f"{_n(v['pending']):>9}  {_when(v['enqueued_at']):<20} {Path(v['input']).name}")


def _when(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "-"


def _n(value: int | None) -> str:
    return "?" if value is None else str(value)


def _human(v: dict[str, Any]) -> str:
    lines = [f"job {v['id']}: {v['state']}",
             f"  total {_n(v['total'])}  ok {v['ok']}  error {v['error']}  pending "
             f"{_n(v['pending'])}" + (f"  (invalid lines: {v['invalid']})" if v["invalid"] else "")]
    if v.get("rate") is not None:
        eta = f"  eta {v['eta_s']:.0f} s" if v.get("eta_s") is not None else ""
        lines.append(f"  rate {v['rate']:.1f} lines/s{eta}")
    if v.get("stale_s"):
        lines.append(f"  no progress saved for {v['stale_s']:.0f} s: is its jobs worker alive? "
                     "(RQ re-runs an abandoned job once a jobs worker notices)")
    if v.get("failure"):
        lines.append(f"  failure: {v['failure']}")
    lines += [f"  queue {v['queue']}; input {v['input']}",
              f"  output {v['output']}", f"  errors {v['errors']}"]
    return "\n".join(lines)


def _watch(conn: redis.Redis, job_id: str) -> dict[str, Any]:
    """Follow a job with a progress bar (stderr) until it ends; its final view."""
    from tqdm import tqdm
    job = jobs.fetch(conn, job_id)
    view = jobs.describe(job)
    with tqdm(total=view["total"], initial=view["ok"] + view["error"], unit="line",
              desc=f"job {job_id}", file=sys.stderr, dynamic_ncols=True) as bar:
        while True:
            if view["total"] is not None and bar.total != view["total"]:
                bar.total = view["total"]
            delta = view["ok"] + view["error"] - bar.n
            stale = f" (no progress for {view['stale_s']} s)" if view.get("stale_s") else ""
            bar.set_postfix_str(f"{view['state']} ok={view['ok']} error={view['error']}{stale}",
                                refresh=not delta)
            if delta:
                bar.update(delta)
            if view["state"] in TERMINAL:
                return view
            time.sleep(WATCH_S)
            view = jobs.describe(job)


@job_group.command("results")
@click.argument("job_id", metavar="JOB")
@click.option("--path", "path_only", is_flag=True, allow_from_autoenv=False,
              help="Print the file's path, not its lines.")
@click.option("--errors", "errors_file", is_flag=True, allow_from_autoenv=False,
              help="The errors file instead.")
@json_option
@redis_options
def results(job_id: str, path_only: bool, errors_file: bool, as_json: bool, redis_url: str,
            cluster: bool) -> None:
    """A job's result lines (or, with --errors, its invalid lines) as written so far:
    JSON lines already; with --path --json, {"path", "state"}."""
    view = jobs.describe(jobs.fetch(_rq_conn(redis_url, cluster), job_id))
    path = Path(view["errors"] if errors_file else view["output"])
    if path_only:
        if as_json:
            print_json({"path": str(path), "state": view["state"]})
        else:
            click.echo(str(path))
        return
    if view["state"] != jobs.FINISHED:
        click.echo(f"job {job_id} is {view['state']}: these are the lines written so far",
                   err=True)
    try:
        with open(path, "rb") as f:
            shutil.copyfileobj(f, sys.stdout.buffer)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}; the jobs worker wrote it "
                          "on its own machine if it runs elsewhere") from None
    sys.stdout.flush()


@job_group.command("cancel")
@click.argument("job_id", metavar="JOB")
@json_option
@redis_options
def cancel(job_id: str, as_json: bool, redis_url: str, cluster: bool) -> None:
    """Cancel a job: it stops, and its queued requests are removed."""
    before, removed = jobs.cancel(_rq_conn(redis_url, cluster), job_id)
    if as_json:
        print_json({"id": job_id, "was": before, "removed": removed,
                    "cancelled": before not in (jobs.FINISHED, jobs.CANCELLED)})
    elif before in (jobs.FINISHED, jobs.CANCELLED):
        click.echo(f"job {job_id} is {before} already; nothing to cancel")
    else:
        click.echo(f"job {job_id} cancelled (was {before}); {removed} queued request(s) removed")


@job_group.command("worker")
@click.option("--heartbeat", type=int, default=HEARTBEAT_S, show_default=True, metavar="SECONDS",
              help="A running job's heartbeat; a job silent for 3 beats (its worker died) "
                   "is re-run by RQ, resuming.")
@click.option("--burst", is_flag=True, help="Run the queued jobs, then exit.")
@click.option("--name", help="Worker name (default: random; with --jobs N, NAME-1..NAME-N).")
@click.option("--jobs", "n_jobs", type=int, default=DEFAULT_JOBS, show_default=True,
              help="Offline jobs run side by side, each by its own RQ worker process (one "
              "RQ worker runs one job at a time): jobs submitted together all feed the queue.")
@jobs_queue_option
@redis_options
def jobs_worker(heartbeat: int, burst: bool, name: str | None, n_jobs: int, jobs_queue: str,
                redis_url: str, cluster: bool) -> None:
    """Run offline jobs (RQ workers on the jobs queue, JSON serializer)."""
    from rq.serializers import JSONSerializer
    if heartbeat < 1:
        raise ConfigError(f"--heartbeat must be at least 1 second, got {heartbeat}")
    if not 1 <= n_jobs <= MAX_JOBS:
        raise ConfigError(f"--jobs must be 1..{MAX_JOBS}, got {n_jobs}")
    settings = RedisSettings.from_url(redis_url, cluster=cluster)
    if n_jobs > 1:
        common = ["--heartbeat", str(heartbeat), "--jobs-queue", jobs_queue,
                  *(["--burst"] if burst else []), *(["--cluster"] if cluster else [])]
        raise SystemExit(run_pool([common + (["--name", f"{name}-{i}"] if name else [])
                                   for i in range(1, n_jobs + 1)], settings.resolved_url()))
    click.echo(f"jobs worker on RQ queue {jobs_queue!r}, redis {settings.describe()}", err=True)
    backoff = Backoff()
    while True:  # like `batchery worker`: Redis away is a pause, not an exit
        try:
            worker = JobsWorker([jobs_queue], connection=settings.binary_client(), name=name,
                                serializer=JSONSerializer, job_monitoring_interval=heartbeat)
            worker.work(burst=burst,
                        logging_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()))
            return
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if isinstance(exc, redis.AuthenticationError):
                raise
            wait_s = backoff.next()
            log.warning("Redis unavailable (%s); the jobs worker retries in %.1fs", exc, wait_s)
            time.sleep(wait_s)

