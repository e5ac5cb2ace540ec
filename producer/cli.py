"""Producers' commands: ``batchery enqueue``, and ``batchery request get|cancel``."""

from __future__ import annotations

import json
from typing import Any

import click

from batchery.batching.calls import Cancelled
from batchery.batching.request import Request, check_id, parse_priority
from batchery.batching.sharded import open_queue
from batchery.cli_shared import (FINITE, SECONDS, connect, default_of, json_option,
                                 print_json, queue_option, redis_options)
from batchery.errors import InvalidRequest, NotOk, RequestNotFound
from batchery.producer.client import Client

# enqueue --wait/--stream: a minute for each result or piece of text covers a worker's
# cold start (loading its model), and a request nobody serves still ends the command
WAIT_TIMEOUT_S = 60.0


@click.command("enqueue")
@click.option("--text", "texts", multiple=True, help="A text input (repeatable).")
@click.option("--input", "inputs", multiple=True, metavar="JSON",
              help="A JSON input, e.g. '{\"text\": \"hi\"}' (repeatable).")
@click.option("--priority", "-p", default=default_of(Request, "priority"), show_default=True,
              help="realtime, normal, batch, or a delay in seconds.")
@click.option("--deadline", type=FINITE, help="Seconds from now after which it is not run.")
@click.option("--tenant", default=default_of(Request, "tenant"), show_default=True,
              help="Whose fair share of its class the requests are served from.")
@click.option("--id", "request_id", allow_from_autoenv=False,
              help="Request id (one input only); enqueue is idempotent by id.")
@click.option("--wait", is_flag=True, help="Wait for the results and print them as JSON lines "
              "(exit 7 if one is not ok).")
@click.option("--stream", is_flag=True, help="Generation (one input): print its text as it "
              "is generated, then its result as JSON on stderr.")
@click.option("--timeout", type=SECONDS, default=WAIT_TIMEOUT_S, show_default=True,
              help="With --wait: for each result; with --stream: for each piece of text.")
@json_option
@queue_option
@redis_options
def enqueue(texts: tuple[str, ...], inputs: tuple[str, ...], priority: str,
            deadline: float | None, tenant: str, request_id: str | None, wait: bool, stream: bool,
            timeout: float, as_json: bool, queue: str, redis_url: str, cluster: bool) -> None:
    """Queue requests; print their ids, or with --wait their results (JSON lines)."""
    values: list[Any] = list(texts)
    for i, raw in enumerate(inputs, 1):
        try:
            values.append(json.loads(raw))
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"--input number {i} is not JSON ({exc.msg} at character "
                                 f"{exc.pos}); quote it, e.g. --input '{{\"text\": \"hi\"}}'") from None
        except RecursionError:
            raise InvalidRequest(f"--input number {i} is JSON nested too deeply to read; "
                                 "flatten it") from None
    if not values:
        raise click.UsageError("give at least one --text or --input")
    if request_id is not None and len(values) > 1:
        raise click.UsageError("--id names one request: give one input with it")
    if stream and as_json:
        raise click.UsageError("--stream prints text as it comes, and its result as JSON on "
                               "stderr: drop --json (or use --wait for JSON results)")
    if stream:
        values = [_streamed(values)]
    with Client(redis_url, queue, cluster=cluster, tenant=tenant) as client:
        handles = client.enqueue_many([{"input": v, "priority": parse_priority(priority),
                                        "deadline": deadline, "id": request_id} for v in values],
                                      reply=wait or stream)
        if stream:
            raise SystemExit(_print_stream(handles[0], timeout))
        if as_json and not wait:
            print_json({"ids": [handle.id for handle in handles]})
        for handle in handles:
            if not wait and not as_json:
                click.echo(handle.id)
        if wait:
            results = [handle.result(timeout=timeout) for handle in handles]
            for result in results:
                click.echo(result.to_json())
            failed = [r for r in results if not r.ok]
            if failed:
                raise NotOk(f"{len(failed)} of {len(results)} request(s) did not succeed "
                            f"(first: {failed[0].id} {failed[0].status})")


def _streamed(values: list[Any]) -> dict[str, Any]:
    """The one input of --stream, asking the worker to stream it."""
    if len(values) != 1:
        raise click.UsageError("--stream follows one generation: give one --text or --input")
    value = values[0]
    if isinstance(value, str):
        return {"prompt": value, "stream": True}
    if not isinstance(value, dict):
        raise InvalidRequest("--stream needs a prompt: --text 'Once upon a time' or --input "
                             "'{\"prompt\": \"...\", \"max_new_tokens\": 64}'")
    return {**value, "stream": True}


def _print_stream(handle: Any, timeout: float) -> int:
    """Text to stdout as it comes; a rerun's restart and the result to stderr. Exit 0 if ok."""
    for event in handle.stream(timeout=timeout):
        if event.kind == "text":
            click.echo(event.text, nl=False)
        elif event.kind == "restarted":
            click.echo(f"\n[restarted: run {event.attempt} starts over]", err=True)
        else:
            click.echo("")
            click.echo(event.result.to_json(), err=True)
            return 0 if event.result.ok else NotOk.exit_code
    return 1



# -- one request ----------------------------------------------------------------------------
@click.group("request")
def request_group() -> None:
    """One request by id: its result, or cancel it."""


@request_group.command("get")
@click.argument("request_id")
@json_option
@queue_option
@redis_options
def request_get(request_id: str, as_json: bool, queue: str, redis_url: str | None,
                cluster: bool) -> None:
    """Print the request's result as JSON (status "pending" while queued or running);
    --json changes nothing here, for scripts that pass it everywhere."""
    found = open_queue(connect(redis_url, cluster), queue).lookup([check_id(request_id)])[0]
    if found is False:
        raise RequestNotFound(f"queue {queue!r} holds no request {request_id!r}: never "
                              "enqueued, or its result expired or was delivered and deleted")
    click.echo(found.to_json() if found is not True
               else json.dumps({"id": request_id, "status": "pending"}))


CANCEL_OUTCOMES = {Cancelled.QUEUED: "cancelled while queued",
                   Cancelled.RUNNING: "cancelled while running (its output is discarded)",
                   Cancelled.ALREADY: "cancelled already",
                   Cancelled.NOT: "not cancelled: it had finished, or is unknown"}


@request_group.command("cancel")
@click.argument("request_ids", nargs=-1, required=True)
@json_option
@queue_option
@redis_options
def request_cancel(request_ids: tuple[str, ...], as_json: bool, queue: str,
                   redis_url: str | None, cluster: bool) -> None:
    """Cancel requests; exits 7 when one could not be (finished already, or unknown)."""
    outcomes = open_queue(connect(redis_url, cluster), queue).cancel([check_id(i) for i in request_ids])
    if as_json:
        print_json({request_id: done.label for request_id, done in zip(request_ids, outcomes)})
    else:
        for request_id, done in zip(request_ids, outcomes):
            click.echo(f"{request_id}: {CANCEL_OUTCOMES[done]}")
    if Cancelled.NOT in outcomes:
        raise NotOk(f"{outcomes.count(Cancelled.NOT)} of {len(outcomes)} request(s) could not "
                    "be cancelled")
