"""The ``batchery`` command: a click group; producers' and workers' commands plug in.

Errors a user can act on print one line on stderr and exit with their code (the table
is in batchery/errors.py and the README); never a traceback.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Callable, TypeVar

import click
import redis

from batchery import embedded, tracing
from batchery.batching.keys import QUEUES
from batchery.batching.queue import RequestQueue
from batchery.config import DEFAULT_QUEUE, ENV_QUEUE, ENV_REDIS_URL, ENV_REDIS_URL_FALLBACK
from batchery.connection import RedisSettings
from batchery.errors import BatcheryError, ConfigError, NotOk, RequestNotFound
from batchery.params import FINITE

EXIT_REDIS = 1


class BatcheryGroup(click.Group):
    """Maps batchery's errors and Redis outages to a message and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BatcheryError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except redis.AuthenticationError as exc:
            click.echo(f"error: Redis refused the credentials ({exc}); check the user and "
                       "password in the URL", err=True)
            sys.exit(EXIT_REDIS)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            click.echo(f"error: cannot reach Redis ({exc}); is it running, and is "
                       f"--redis-url / {ENV_REDIS_URL} right?", err=True)
            sys.exit(EXIT_REDIS)
        except redis.exceptions.NoPermissionError as exc:
            click.echo(f"error: Redis refused a command to this user ({exc}); give the ACL "
                       "user the rights README's 'Least privilege' lists for this role",
                       err=True)
            sys.exit(EXIT_REDIS)
        except redis.OutOfMemoryError as exc:
            click.echo(f"error: Redis is out of memory ({exc}); free some or raise its "
                       "maxmemory", err=True)
            sys.exit(EXIT_REDIS)


F = TypeVar("F", bound=Callable[..., Any])


def redis_options(fn: F) -> F:
    """--redis-url and --cluster (both also from the environment)."""
    fn = click.option("--cluster", is_flag=True, envvar="BATCHERY_CLUSTER",
                      help="The URL is a Redis Cluster node.")(fn)
    fn = click.option("--redis-url", envvar=[ENV_REDIS_URL, ENV_REDIS_URL_FALLBACK], metavar="URL",
                      help="redis://, rediss://, unix://, or 'embedded' (a private server: "
                      "the default, except in a container).")(fn)
    return fn


def queue_option(fn: F) -> F:
    return click.option("--queue", "-q", envvar=ENV_QUEUE, default=DEFAULT_QUEUE,
                        show_default=True, help="Queue name.")(fn)


def connect(redis_url: str | None, cluster: bool) -> Any:
    return RedisSettings.from_url(redis_url, cluster=cluster).client()


@click.group(cls=BatcheryGroup)
@click.option("--log-level", envvar="BATCHERY_LOG_LEVEL", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.version_option(package_name="batchery")
def cli(log_level: str) -> None:
    """Run PyTorch models over prioritized requests in batches, backed by Redis."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracing.configure(f"batchery-{click.get_current_context().invoked_subcommand}")


# -- redis --------------------------------------------------------------------------------
@cli.group("redis")
def redis_group() -> None:
    """The embedded Redis server (the default when no URL is given)."""


@redis_group.command("status")
def redis_status() -> None:
    """Whether the embedded server runs, where, and how big it is."""
    for key, value in embedded.status().items():
        click.echo(f"{key}: {value}")


@redis_group.command("stop")
def redis_stop() -> None:
    """Stop the embedded server (its AOF keeps the data for the next start)."""
    click.echo("stopped" if embedded.stop() else "not running")


# -- queue --------------------------------------------------------------------------------
@cli.group("queue")
def queue_group() -> None:
    """Per-queue settings, stored in Redis so producers and workers agree."""


def _class_delays(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, float]:
    delays = {}
    for value in values:
        name, sep, seconds = value.partition("=")
        try:
            delays[name.strip()] = FINITE.convert(seconds, None, None)
        except click.BadParameter:
            sep = ""
        if not sep:
            raise click.BadParameter(f"{value!r}: expected CLASS=SECONDS, e.g. batch=120")
    return delays


@queue_group.command("config")
@click.argument("queue")
@click.option("--max-pending", type=int, help="Refuse enqueues beyond this many queued.")
@click.option("--class-delay", multiple=True, callback=_class_delays, metavar="CLASS=SECONDS",
              help="Seconds added to a class's enqueue time (repeatable).")
@click.option("--max-attempts", type=int, help="Runs before a request is dead-lettered.")
@click.option("--lease-seconds", type=FINITE, help="Claims not renewed this long are taken back.")
@click.option("--result-ttl", type=int, help="Seconds results stay readable.")
@click.option("--dead-ttl", type=int, help="Seconds dead letters are kept (then forgotten, and "
              "their ids may be enqueued again).")
@click.option("--max-request-bytes", type=int, help="Larger requests are refused at enqueue.")
@click.option("--fill-from-slower/--no-fill-from-slower", default=None, help="Fill a batch led "
              "by a faster class with slower-class requests (throughput; the default), or run it "
              "with its own class only (its latency).")
@click.option("--memory-high-water", type=FINITE, metavar="FRACTION", help="Refuse enqueues "
              "once Redis uses this fraction of its maxmemory (0: off).")
@click.option("--delete-delivered/--keep-delivered", default=None, help="Delete a result once "
              "it reached the client waiting for it or a job's output file (the default), or "
              "keep it for result_ttl.")
@click.option("--tokenizer", metavar="NAME_OR_DIR", help="Tokenizer producers count tokens "
              "with (a hub id in their cache or a directory), set before any worker announces "
              "its own; workers do not overwrite it.")
@click.option("--max-input-tokens", type=int, help="Length the workers' model truncates inputs "
              "to; producers cap their counts at it.")
@click.option("--json", "as_json", is_flag=True, help="Print the settings as JSON.")
@redis_options
def queue_config(queue: str, class_delay: dict[str, float], as_json: bool, redis_url: str,
                 cluster: bool, **changes: Any) -> None:
    """Show QUEUE's settings, changing those given first."""
    rq = RequestQueue(connect(redis_url, cluster), queue)
    changes = {k: v for k, v in changes.items() if v is not None}
    settings = rq.settings()
    if changes or class_delay:
        settings = rq.update_settings(class_delays={**settings.class_delays, **class_delay},
                                      **changes)
        rq.register()
    data = settings.__dict__
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for key, value in data.items():
        click.echo(f"{key}: {value}")


@queue_group.command("pause")
@click.argument("queue")
@redis_options
def queue_pause(queue: str, redis_url: str | None, cluster: bool) -> None:
    """Workers stop claiming from QUEUE (running batches finish); enqueues go on."""
    RequestQueue(connect(redis_url, cluster), queue).update_settings(paused=True)
    click.echo(f"queue {queue!r} paused: workers claim nothing until `batchery queue resume {queue}`")


@queue_group.command("resume")
@click.argument("queue")
@redis_options
def queue_resume(queue: str, redis_url: str | None, cluster: bool) -> None:
    """Workers claim from QUEUE again."""
    RequestQueue(connect(redis_url, cluster), queue).update_settings(paused=False)
    click.echo(f"queue {queue!r} resumed")


# -- stats --------------------------------------------------------------------------------
@cli.command("stats")
@click.option("--queue", "-q", "only", help="Only this queue.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", "interval", type=FINITE, is_flag=False, flag_value=2.0, default=None,
              metavar="[SECONDS]", help="Print again every SECONDS (default 2) until Ctrl-C.")
@redis_options
def stats(only: str | None, as_json: bool, interval: float | None, redis_url: str | None,
          cluster: bool) -> None:
    """Pending by priority, in flight, dead letters and live workers, per queue."""
    if interval is not None and interval <= 0:
        raise ConfigError(f"--watch takes a positive number of seconds, got {interval}")
    client = connect(redis_url, cluster)
    try:
        while True:
            _print_stats(client, only, as_json)
            if interval is None:
                return
            time.sleep(interval)
            if not as_json:
                click.echo()
    except KeyboardInterrupt:  # how --watch ends
        return


def _print_stats(client: Any, only: str | None, as_json: bool) -> None:
    names = [only] if only else sorted(client.smembers(QUEUES))
    queues = {name: RequestQueue(client, name).stats() for name in names}
    if as_json:
        click.echo(json.dumps({"queues": queues}, indent=2))
        return
    if not queues:
        click.echo("no queues yet")
        return
    click.echo(f"{'queue':<20} {'pending':>9} {'inflight':>9} {'dead':>6} {'workers':>8}  by priority")
    for name, s in queues.items():
        by = " ".join(f"{c}={n}" for c, n in s["pending_by_priority"].items()) or "-"
        click.echo(f"{name:<20} {s['pending']:>9} {s['inflight']:>9} {s['dead']:>6} "
                   f"{s['workers']:>8}  {by}{'  (paused)' if s['paused'] else ''}")


# -- one request ----------------------------------------------------------------------------
@cli.group("request")
def request_group() -> None:
    """One request by id: its result, or cancel it."""


@request_group.command("get")
@click.argument("request_id")
@queue_option
@redis_options
def request_get(request_id: str, queue: str, redis_url: str | None, cluster: bool) -> None:
    """Print the request's result as JSON (status "pending" while queued or running)."""
    found = RequestQueue(connect(redis_url, cluster), queue).lookup([request_id])[0]
    if found is False:
        raise RequestNotFound(f"queue {queue!r} holds no request {request_id!r}: never "
                              "enqueued, or its result expired or was delivered and deleted")
    click.echo(found.to_json() if found is not True
               else json.dumps({"id": request_id, "status": "pending"}))


CANCEL_OUTCOMES = {1: "cancelled while queued", 2: "cancelled while running (its output is "
                   "discarded)", 3: "cancelled already",
                   0: "not cancelled: it had finished, or is unknown"}


@request_group.command("cancel")
@click.argument("request_ids", nargs=-1, required=True)
@queue_option
@redis_options
def request_cancel(request_ids: tuple[str, ...], queue: str, redis_url: str | None,
                   cluster: bool) -> None:
    """Cancel requests; exits 7 when one could not be (finished already, or unknown)."""
    flags = RequestQueue(connect(redis_url, cluster), queue).cancel(list(request_ids))
    for request_id, flag in zip(request_ids, flags):
        click.echo(f"{request_id}: {CANCEL_OUTCOMES[flag]}")
    if not all(flags):
        raise NotOk(f"{flags.count(0)} of {len(flags)} request(s) could not be cancelled")


# -- dead letters -------------------------------------------------------------------------
@cli.group("dead")
def dead_group() -> None:
    """Requests that failed max_attempts times."""


@dead_group.command("list")
@queue_option
@click.option("--limit", default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@redis_options
def dead_list(queue: str, limit: int, as_json: bool, redis_url: str, cluster: bool) -> None:
    """Dead-lettered requests, newest first, with their last error."""
    results = RequestQueue(connect(redis_url, cluster), queue).dead(limit)
    for r in results:
        if as_json:
            click.echo(r.to_json())
        else:
            error = r.error or {}
            click.echo(f"{r.id}\tattempts={r.attempts}\t{error.get('type', '?')}: "
                       f"{error.get('message', '')}")
    if not results and not as_json:
        click.echo(f"no dead letters in queue {queue!r}", err=True)


def _dead_targets(ids: tuple[str, ...], everything: bool) -> dict[str, Any]:
    """The ids named (``*`` is an id like any other), or every one with --all."""
    if bool(ids) == everything:
        raise ConfigError("name the request ids, or pass --all (not both)")
    return {"ids": list(ids), "everything": everything}


@dead_group.command("retry")
@click.argument("ids", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Every dead request of the queue.")
@queue_option
@redis_options
def dead_retry(ids: tuple[str, ...], everything: bool, queue: str, redis_url: str, cluster: bool) -> None:
    """Send dead requests back to the queue with fresh attempts."""
    n = RequestQueue(connect(redis_url, cluster), queue).revive(**_dead_targets(ids, everything))
    click.echo(f"{n} request(s) back in queue {queue!r}")


@dead_group.command("purge")
@click.argument("ids", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Every dead request of the queue.")
@queue_option
@redis_options
def dead_purge(ids: tuple[str, ...], everything: bool, queue: str, redis_url: str, cluster: bool) -> None:
    """Forget dead requests for good."""
    n = RequestQueue(connect(redis_url, cluster), queue).purge(**_dead_targets(ids, everything))
    click.echo(f"{n} dead request(s) purged from queue {queue!r}")


def _register_plugins() -> None:
    from batchery.dashboard.cli import register as register_dashboard
    from batchery.producer.cli import register as register_producer
    from batchery.workers.cli import register as register_workers
    register_producer(cli)
    register_workers(cli)
    register_dashboard(cli)


_register_plugins()


def main() -> None:
    cli(prog_name="batchery")
