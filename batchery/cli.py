"""The ``batchery`` command: the root group, the embedded Redis' commands, and where
every other command plugs in.

Commands live with what they drive: queues (batchery/queue_cli.py), requests and
enqueue (producer/cli.py), offline jobs (producer/jobs/cli.py), the worker
(workers/cli.py), the dashboard (dashboard/cli.py), the OpenAI gateway (gateway/cli.py).
What they share is in batchery/cli_shared.py, which imports none of them. Errors a user can act on print one
line on stderr and exit with their code (the table is in batchery/errors.py and the
docs/reference/errors.md); never a traceback.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import sys

import click

from batchery import embedded, tracing
from batchery.cli_shared import LOG_LEVELS, BatcheryGroup, finish_tree, json_option, print_json
from batchery.config import ENV_LOG_LEVEL
from batchery.dashboard.cli import dashboard
from batchery.gateway.cli import serve
from batchery.producer.cli import enqueue, request_group
from batchery.producer.jobs.cli import job_group
from batchery.queue_cli import queue_group
from batchery.workers.cli import worker


@click.group(cls=BatcheryGroup)
@click.option("--log-level", envvar=ENV_LOG_LEVEL, default="INFO", show_default=True,
              type=click.Choice(LOG_LEVELS, case_sensitive=False))
@click.version_option(package_name="batchery")
def cli(log_level: str) -> None:
    """Run PyTorch models over prioritized requests in batches, backed by Redis.

    Every option also comes from the environment as BATCHERY_<OPTION>, e.g.
    BATCHERY_MAX_BATCH_SIZE=32 for --max-batch-size 32.
    """
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracing.configure(f"batchery-{click.get_current_context().invoked_subcommand}")


# -- redis --------------------------------------------------------------------------------
@cli.group("redis")
def redis_group() -> None:
    """The embedded Redis server (the default when no URL is given)."""


@redis_group.command("status")
@json_option
def redis_status(as_json: bool) -> None:
    """Whether the embedded server runs, where, and how big it is."""
    status = embedded.status()
    if as_json:
        print_json(status)
        return
    for key, value in status.items():
        click.echo(f"{key}: {value}")


@redis_group.command("stop")
@json_option
def redis_stop(as_json: bool) -> None:
    """Stop the embedded server (its AOF keeps the data for the next start)."""
    stopped = embedded.stop()
    if as_json:
        print_json({"stopped": stopped})
    else:
        click.echo("stopped" if stopped else "not running")


for command in (queue_group, request_group, job_group, enqueue, worker, dashboard, serve):
    cli.add_command(command)
# The short form of `batchery job submit`, shown in the docs. (The first wave's other
# top-level names, stats, dead, status, results, cancel and jobs-worker, were dropped
# before the first release: `batchery queue ...` and `batchery job ...` are the names.)
cli.add_command(job_group.commands["submit"], "submit")
finish_tree(cli)


def main() -> None:
    if hasattr(signal, "SIGUSR1"):
        # `kill -USR1 PID`: where each thread is, on stderr (a process that seems stuck);
        # here, not in `cli`, which a test runs in its own process with a stderr of no file
        with contextlib.suppress(ValueError, OSError, AttributeError):  # stderr is no file
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    cli(prog_name="batchery")
