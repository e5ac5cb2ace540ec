"""What every ``batchery`` command shares; imports no command, so every command imports it.

The group that maps batchery's errors and Redis outages to one line and an exit code;
the options several commands take (--redis-url, --cluster, --queue, --jobs-queue,
--json, --log-level); option defaults read from the settings dataclasses; and the walk
over the command tree that lets every option come from the environment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from typing import Any, Callable, Iterator, TypeVar

import click
import redis

from batchery.config import (DEFAULT_QUEUE, ENV_LOG_LEVEL, ENV_PREFIX, ENV_QUEUE, ENV_REDIS_URL,
                             ENV_REDIS_URL_FALLBACK, JOBS_QUEUE)
from batchery.connection import RedisSettings
from batchery.errors import BatcheryError, InvalidRequest

EXIT_REDIS = 1  # Redis unreachable or refusing: like any failure, unlike bad input's 2
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
F = TypeVar("F", bound=Callable[..., Any])


class FiniteFloat(click.ParamType):
    """A float option that refuses nan and inf (Python's float() accepts both), and
    numbers below ``least`` when one is given: checked before the command writes anything."""

    name = "number"

    def __init__(self, least: float | None = None) -> None:
        self.least = least

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number; give seconds such as 30 or 0.5",
                      param, ctx)
        if self.least is not None and number < self.least:
            self.fail(f"{value!r} is below {self.least:g}; give seconds such as 30 or 0.5",
                      param, ctx)
        return number


FINITE = FiniteFloat()
SECONDS = FiniteFloat(least=0)  # a wait or a period: never negative


class BatcheryGroup(click.Group):
    """Maps batchery's errors and Redis outages to a message and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BatcheryError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except UnicodeError as exc:  # a name from argv or a file that is not UTF-8
            click.echo(f"error: {exc.object[exc.start:exc.end]!r} in {exc.object[:60]!r} is "
                       "not valid UTF-8 text; give names and values as UTF-8"
                       if isinstance(exc, (UnicodeEncodeError, UnicodeDecodeError))
                       else f"error: text that is not valid UTF-8 ({exc})", err=True)
            sys.exit(InvalidRequest.exit_code)
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
                       "user the rights the docs' 'Least privilege' page lists for this role",
                       err=True)
            sys.exit(EXIT_REDIS)
        except redis.OutOfMemoryError as exc:
            click.echo(f"error: Redis is out of memory ({exc}); free some or raise its "
                       "maxmemory", err=True)
            sys.exit(EXIT_REDIS)


# -- options several commands take ----------------------------------------------------------
def redis_options(fn: F) -> F:
    """--redis-url and --cluster (both also from the environment)."""
    fn = click.option("--cluster", is_flag=True, help="The URL is a Redis Cluster node.")(fn)
    fn = click.option("--redis-url", envvar=[ENV_REDIS_URL, ENV_REDIS_URL_FALLBACK], metavar="URL",
                      help="redis://, rediss://, unix://, or 'embedded' (a private server: "
                      "the default, except in a container).")(fn)
    return fn


def queue_option(fn: F) -> F:
    return click.option("--queue", "-q", envvar=ENV_QUEUE, default=DEFAULT_QUEUE,
                        show_default=True, help="Queue name.")(fn)


def jobs_queue_option(fn: F) -> F:
    return click.option("--jobs-queue", default=JOBS_QUEUE, show_default=True,
                        help="The RQ queue offline jobs wait in.")(fn)


def json_option(fn: F) -> F:
    """--json: machine-readable output. Never from the environment: a script reading a
    table would get JSON because of a variable it never saw."""
    return click.option("--json", "as_json", is_flag=True, allow_from_autoenv=False,
                        help="Print JSON instead of text.")(fn)


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


def _set_log_level(_ctx: click.Context, _param: click.Parameter, level: str | None) -> None:
    if level:  # the root already configured logging; a later --log-level overrides it
        logging.getLogger().setLevel(level.upper())


def log_level_option(fn: F) -> F:
    """--log-level after a subcommand (`batchery worker ... --log-level DEBUG`)."""
    return click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
                        expose_value=False, is_eager=True, callback=_set_log_level,
                        allow_from_autoenv=False, help="Overrides the one given before the "
                        f"command (or {ENV_LOG_LEVEL}).")(fn)


def connect(redis_url: str | None, cluster: bool) -> Any:
    return RedisSettings.from_url(redis_url, cluster=cluster).client()


# -- defaults from the settings dataclasses --------------------------------------------------
def default_of(settings: type, name: str) -> Any:
    """The default of one field of a settings dataclass: the option's default, so that
    changing the dataclass changes the command line too."""
    for f in dataclasses.fields(settings):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise AttributeError(f"{settings.__name__} has no field {name!r} with a default")


# -- the command tree ----------------------------------------------------------------------
def walk(command: click.Command,
         path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every command under ``command`` (itself first), with its path of names."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from walk(sub, (*path, name))


def env_names(param: click.Parameter) -> list[str]:
    """The environment variables an option reads (once finish_tree ran): its own names,
    then BATCHERY_<OPTION>."""
    own = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
    if isinstance(param, click.Option) and param.allow_from_autoenv and param.name:
        own.append(f"{ENV_PREFIX}_{param.name.upper()}")
    return own


def finish_tree(root: click.Group) -> None:
    """Every option of every command reads BATCHERY_<OPTION> (not click's default
    BATCHERY_<COMMAND>_<OPTION>: one name per setting, whichever command reads it) unless
    it names its own variables (config.py: --redis-url, --threads, the dashboard's), and
    every command takes --log-level after its name too."""
    for path, command in walk(root):
        command.context_settings.setdefault("auto_envvar_prefix", ENV_PREFIX)
        for param in command.params:
            if isinstance(param, click.Option) and param.envvar:  # a name of its own instead
                param.allow_from_autoenv = False
        if path and not any(p.name == "log_level" for p in command.params):
            log_level_option(command)
