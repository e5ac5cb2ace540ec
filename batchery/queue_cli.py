"""``batchery queue``: per-queue settings, stats, pause and resume, and dead letters."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from batchery import keda
from batchery.batching.inspection import DEAD_SHOWN
from batchery.batching.keys import check_queue_name
from batchery.batching.request import check_tenant
from batchery.batching.settings import MAX_SHARDS
from batchery.batching.sharded import ShardedQueue, open_queue
from batchery.cli_shared import (FINITE, connect, default_of, json_option, print_json,
                                 queue_option, redis_options)
from batchery.errors import ConfigError, InvalidRequest


@click.group("queue")
def queue_group() -> None:
    """Queues: settings (stored in Redis so producers and workers agree), stats,
    pause and resume, dead letters."""


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


def _tenant_values(kind: type, example: str) -> Any:
    """A callback reading repeated TENANT=VALUE options into a dict (the value after the
    last '=': a tenant name may hold '=')."""
    def read(_ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for value in values:
            name, sep, number = value.rpartition("=")
            try:
                found[check_tenant(name.strip())] = kind(number)
            except (ValueError, InvalidRequest) as exc:
                sep = ""
                why = f" ({exc})" if isinstance(exc, InvalidRequest) else ""
            if not sep:
                raise click.BadParameter(f"{value!r}: expected TENANT=VALUE, e.g. {example}{why}",
                                         param=param)
        return found
    return read


def _change(*decls: str, **kwargs: Any) -> Any:
    """A setting to change. Never from the environment: the settings live in Redis, and a
    variable would rewrite them on every `queue config` that only meant to read them."""
    return click.option(*decls, allow_from_autoenv=False, **kwargs)


@queue_group.command("config")
@click.argument("queue")
@_change("--max-pending", type=int, help="Refuse enqueues beyond this many queued (on a "
         "sharded queue: ceil(N / shards) per shard).")
@_change("--class-delay", multiple=True, callback=_class_delays, metavar="CLASS=SECONDS",
         help="Seconds added to a class's enqueue time (repeatable).")
@_change("--fair-share/--no-fair-share", default=None, help="Share each class's served "
         "tokens between its backlogged tenants by weight (the default), or serve it by age "
         "alone.")
@_change("--tenant-weight", multiple=True, callback=_tenant_values(float, "team-a=2"),
         metavar="TENANT=W", help="A tenant's weight in the fair share of its class "
         "(repeatable; default 1): backlogged tenants are served tokens in proportion.")
@_change("--tenant-max-pending", multiple=True, callback=_tenant_values(int, "team-a=1000"),
         metavar="TENANT=N", help="Most requests a tenant may hold queued (repeatable; 0: no "
         "limit); over it only that tenant's enqueues are refused.")
@_change("--tenant-token-rate", multiple=True, callback=_tenant_values(float, "team-a=5000"),
         metavar="TENANT=TOKENS_PER_S", help="Most tokens per second a tenant is served "
         "(repeatable; 0: no limit); over it only that tenant's requests wait.")
@_change("--max-attempts", type=int, help="Runs before a request is dead-lettered.")
@_change("--lease-seconds", type=FINITE, help="Claims not renewed this long are taken back.")
@_change("--result-ttl", type=int, help="Seconds results stay readable.")
@_change("--dead-ttl", type=int, help="Seconds dead letters are kept (then forgotten, and "
         "their ids may be enqueued again).")
@_change("--max-request-bytes", type=int, help="Larger requests are refused at enqueue.")
@_change("--fill-from-slower/--no-fill-from-slower", default=None, help="Fill a batch led "
         "by a faster class with slower-class requests (throughput; the default), or run it "
         "with its own class only (its latency).")
@_change("--memory-high-water", type=FINITE, metavar="FRACTION", help="Refuse enqueues "
         "once Redis uses this fraction of its maxmemory (0: off).")
@_change("--delete-delivered/--keep-delivered", default=None, help="Delete a result once "
         "it reached the client waiting for it or a job's output file (the default), or "
         "keep it for result_ttl.")
@_change("--tokenizer", metavar="NAME_OR_DIR", help="Tokenizer producers count tokens "
         "with (a hub id in their cache or a directory), set before any worker announces "
         "its own; workers do not overwrite it.")
@_change("--max-input-tokens", type=int, help="Length the workers' model truncates inputs "
         "to; producers cap their counts at it.")
@_change("--shards", type=int, help=f"Spread the queue over N hash slots (1-{MAX_SHARDS}): on "
         "a Redis Cluster, N a multiple of the masters puts N / masters shards on each, so one "
         "node's core no longer caps the queue. Only while the queue is empty (nothing pending, delayed, in "
         "flight or dead); max_pending then holds per shard as ceil(max_pending / N).")
@json_option
@redis_options
def queue_config(queue: str, class_delay: dict[str, float], tenant_weight: dict[str, float],
                 tenant_max_pending: dict[str, int], tenant_token_rate: dict[str, float],
                 as_json: bool, redis_url: str,
                 cluster: bool, **changes: Any) -> None:
    """Show QUEUE's settings, changing those given first."""
    requests = open_queue(connect(redis_url, cluster), queue)
    changes = {k: v for k, v in changes.items() if v is not None}
    settings = requests.settings()
    if changes or class_delay or tenant_weight or tenant_max_pending or tenant_token_rate:
        settings = requests.update_settings(
            class_delays={**settings.class_delays, **class_delay},
            tenant_weights={**settings.tenant_weights, **tenant_weight},
            tenant_max_pending={**settings.tenant_max_pending, **tenant_max_pending},
            tenant_token_rates={**settings.tenant_token_rates, **tenant_token_rate}, **changes)
        requests.register()
    data = settings.__dict__
    if as_json:
        print_json(data)
        return
    for key, value in data.items():
        click.echo(f"{key}: {value}")


def _set_paused(queue: str, paused: bool, as_json: bool, redis_url: str | None,
                cluster: bool) -> None:
    open_queue(connect(redis_url, cluster), queue).update_settings(paused=paused)
    if as_json:
        print_json({"queue": queue, "paused": paused})
    elif paused:
        click.echo(f"queue {queue!r} paused: workers claim nothing until "
                   f"`batchery queue resume {queue}`")
    else:
        click.echo(f"queue {queue!r} resumed")


@queue_group.command("pause")
@click.argument("queue")
@json_option
@redis_options
def queue_pause(queue: str, as_json: bool, redis_url: str | None, cluster: bool) -> None:
    """Workers stop claiming from QUEUE (running batches finish); enqueues go on."""
    _set_paused(queue, True, as_json, redis_url, cluster)


@queue_group.command("resume")
@click.argument("queue")
@json_option
@redis_options
def queue_resume(queue: str, as_json: bool, redis_url: str | None, cluster: bool) -> None:
    """Workers claim from QUEUE again."""
    _set_paused(queue, False, as_json, redis_url, cluster)


def _deploy(*decls: str, **kwargs: Any) -> Any:
    """An option of the printed manifest, default from keda.Autoscale; never from the
    environment (a BATCHERY_THRESHOLD would mean nothing elsewhere)."""
    name = decls[0].split("/")[0].lstrip("-").replace("-", "_")
    return click.option(*decls, default=default_of(keda.Autoscale, name), show_default=True,
                        allow_from_autoenv=False, **kwargs)


@queue_group.command("keda")
@click.argument("queue")
@click.option("--shards", type=click.IntRange(1, MAX_SHARDS), allow_from_autoenv=False,
              help="Render for this many shards without asking Redis (default: the queue's "
              "own setting, read from Redis).")
@_deploy("--threshold", type=click.IntRange(1), help="Queued requests per worker.")
@_deploy("--deployment", help="The worker Deployment KEDA scales.")
@_deploy("--namespace", help="Its namespace.")
@_deploy("--min-replicas", type=click.IntRange(0), help="0: scale to zero.")
@_deploy("--max-replicas", type=click.IntRange(1))
@_deploy("--tls/--no-tls", help="The Redis speaks TLS (rediss://).")
@json_option
@redis_options
def queue_keda(queue: str, shards: int | None, as_json: bool, redis_url: str | None,
               cluster: bool, **options: Any) -> None:
    """Print KEDA objects that scale the workers on QUEUE's queued requests, every shard
    counted (`kubectl apply -f -` takes them). With --cluster: the redis-cluster trigger.
    A YAML stream; --json: one Kubernetes List."""
    if shards is None:
        shards = open_queue(connect(redis_url, cluster), queue).settings().shards
    spec = keda.Autoscale(check_queue_name(queue), shards=shards, cluster=cluster, **options)
    if as_json:
        print_json({"apiVersion": "v1", "kind": "List", "items": keda.objects(spec)})
    else:  # JSON is YAML: each object a document
        click.echo("\n---\n".join(json.dumps(o, indent=2) for o in keda.objects(spec)))


# -- stats --------------------------------------------------------------------------------
@queue_group.command("stats")
@click.option("--queue", "-q", "only", allow_from_autoenv=False,
              help="Only this queue (not from BATCHERY_QUEUE: without it, every queue).")
@json_option
@click.option("--watch", type=FINITE, is_flag=False, flag_value=2.0, default=None,
              metavar="[SECONDS]", help="Print again every SECONDS (default 2) until Ctrl-C.")
@redis_options
def stats(only: str | None, as_json: bool, watch: float | None, redis_url: str | None,
          cluster: bool) -> None:
    """Pending by priority, in flight, dead letters and live workers, per queue."""
    if watch is not None and watch <= 0:
        raise ConfigError(f"--watch takes a positive number of seconds, got {watch}")
    client = connect(redis_url, cluster)
    try:
        while True:
            _print_stats(client, only, as_json)
            if watch is None:
                return
            time.sleep(watch)
            if not as_json:
                click.echo()
    except KeyboardInterrupt:  # how --watch ends
        return


def _print_stats(client: Any, only: str | None, as_json: bool) -> None:
    names = [only] if only else ShardedQueue.known_queues(client)
    queues = {name: open_queue(client, name).stats() for name in names}
    if as_json:
        print_json({"queues": queues})
        return
    if not queues:
        click.echo("no queues yet")
        return
    click.echo(f"{'queue':<20} {'pending':>9} {'inflight':>9} {'dead':>6} {'workers':>8} "
               f"{'shards':>6}  by priority")
    for name, s in queues.items():
        by = " ".join(f"{c}={n}" for c, n in s["pending_by_priority"].items()) or "-"
        click.echo(f"{name:<20} {s['pending']:>9} {s['inflight']:>9} {s['dead']:>6} "
                   f"{s['workers']:>8} {s['shards']:>6}  {by}{'  (paused)' if s['paused'] else ''}")
    for name, s in queues.items():
        _print_tenants(name, s["tenants"], s["tenants_other"])


def _print_tenants(queue: str, tenants: dict[str, dict[str, int]], other: dict[str, int]) -> None:
    """The tenants of a queue, most loaded first, then the rest as one line."""
    if not tenants:
        return
    click.echo(f"\n{'tenant of ' + queue:<40} {'pending':>9} {'inflight':>9} {'served tokens':>14}")
    for tenant, load in tenants.items():
        click.echo(f"{tenant[:40]:<40} {load['pending']:>9} {load['inflight']:>9} "
                   f"{load['served_tokens']:>14}")
    if other["tenants"]:
        click.echo(f"{'(' + str(other['tenants']) + ' other tenants)':<40} {other['pending']:>9} "
                   f"{other['inflight']:>9} {other['served_tokens']:>14}")


# -- dead letters -------------------------------------------------------------------------
@queue_group.group("dead")
def dead_group() -> None:
    """Requests that failed max_attempts times."""


@dead_group.command("list")
@queue_option
@click.option("--limit", default=DEAD_SHOWN, show_default=True, help="At most this many.")
@json_option
@redis_options
def dead_list(queue: str, limit: int, as_json: bool, redis_url: str, cluster: bool) -> None:
    """Dead-lettered requests, newest first, with their last error (--json: one per line)."""
    results = open_queue(connect(redis_url, cluster), queue).dead(limit)
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


def _all_option(fn: Any) -> Any:
    """--all: never from the environment (a variable must not make a command destructive)."""
    return click.option("--all", "everything", is_flag=True, allow_from_autoenv=False,
                        help="Every dead request of the queue.")(fn)


@dead_group.command("retry")
@click.argument("ids", nargs=-1)
@_all_option
@queue_option
@json_option
@redis_options
def dead_retry(ids: tuple[str, ...], everything: bool, queue: str, as_json: bool, redis_url: str,
               cluster: bool) -> None:
    """Send dead requests back to the queue with fresh attempts."""
    n = open_queue(connect(redis_url, cluster), queue).revive(**_dead_targets(ids, everything))
    if as_json:
        print_json({"queue": queue, "retried": n})
    else:
        click.echo(f"{n} request(s) back in queue {queue!r}")


@dead_group.command("purge")
@click.argument("ids", nargs=-1)
@_all_option
@queue_option
@json_option
@redis_options
def dead_purge(ids: tuple[str, ...], everything: bool, queue: str, as_json: bool, redis_url: str,
               cluster: bool) -> None:
    """Forget dead requests for good."""
    n = open_queue(connect(redis_url, cluster), queue).purge(**_dead_targets(ids, everything))
    if as_json:
        print_json({"queue": queue, "purged": n})
    else:
        click.echo(f"{n} dead request(s) purged from queue {queue!r}")
