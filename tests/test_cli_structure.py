"""The command line's shape: no import cycle, every option from the environment under one
name per setting, --log-level after any command, --json on every command that prints."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from batchery import config
from batchery.cli import cli
from batchery.cli_shared import env_names, walk
from tests.conftest import ROOT, run_cli

COMMAND_MODULES = ("batchery.cli_shared", "batchery.queue_cli", "batchery.producer.cli",
                   "batchery.producer.jobs.cli", "batchery.workers.cli", "batchery.dashboard.cli")
# Commands that print no result: they run until stopped and write logs.
NO_JSON = {("worker",): "runs until stopped; logs only",
           ("job", "worker"): "runs until stopped; logs only",
           ("dashboard",): "serves a web page until stopped",
           ("serve",): "serves the OpenAI API until stopped"}
# Environment variables batchery reads that are no option: none may be an option's name.
NOT_OPTIONS = {config.ENV_HOME, config.ENV_NO_EMBEDDED, config.ENV_REDIS_URL_FALLBACK,
               config.ENV_API_KEYS}


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_each_command_module_imports_alone_without_the_root(module: str) -> None:
    """A fresh interpreter imports it without batchery.cli: nothing imports the root back."""
    code = f"import sys, {module}; print('batchery.cli' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_every_printing_command_takes_json() -> None:
    leaves = [(path, c) for path, c in walk(cli) if path and not isinstance(c, click.Group)]
    assert len(leaves) > 20
    missing = [" ".join(path) for path, c in leaves
               if path not in NO_JSON and not any(p.name == "as_json" for p in c.params)]
    assert not missing, f"commands that print without --json: {missing}"


def test_one_environment_name_means_one_option() -> None:
    """BATCHERY_<OPTION> is shared by every command with that option: it must mean the same
    there (same flags), and never be a variable batchery reads for something else."""
    meaning: dict[str, set[tuple[str, ...]]] = {}
    for _, command in walk(cli):
        for param in command.params:
            for name in env_names(param):
                meaning.setdefault(name, set()).add(tuple(sorted(param.opts)))
    assert "BATCHERY_MAX_BATCH_SIZE" in meaning and "BATCHERY_JOBS_QUEUE" in meaning
    clashes = {name: opts for name, opts in meaning.items() if len(opts) > 1}
    assert not clashes, clashes
    assert not NOT_OPTIONS & set(meaning) - {config.ENV_REDIS_URL_FALLBACK}
    assert not [name for name in meaning if name.startswith("BATCHERY_TEST_")]  # tests' hooks


def test_an_option_comes_from_the_environment(redis_url: str) -> None:
    done = run_cli("worker", "--runner", "tests.runners:echo", redis_url=redis_url,
                   BATCHERY_MAX_BATCH_SIZE="0")
    assert done.returncode == 2 and "--max-batch-size must be 1..4096, got 0" in done.stderr
    given = run_cli("worker", "--runner", "tests.runners:echo", "--max-batch-size", "5000",
                    redis_url=redis_url, BATCHERY_MAX_BATCH_SIZE="0")
    assert "got 5000" in given.stderr  # the command line wins over the environment


def test_json_id_and_all_never_come_from_the_environment(redis_url: str, queue_name: str) -> None:
    """--json, --id and --all change what a command prints, which request it makes or how
    much it destroys: a variable the caller never saw must not set them."""
    never = {"as_json": "--json", "request_id": "--id", "everything": "--all"}
    seen = {name: 0 for name in never}
    for path, command in walk(cli):
        for param in command.params:
            if param.name in never:
                seen[param.name] += 1
                assert env_names(param) == [], (" ".join(path), never[param.name])
    assert seen["as_json"] >= 10 and seen["request_id"] >= 1 and seen["everything"] >= 2
    # and for real: each variable set, the command does what it does without the flag
    env = {f"{config.ENV_PREFIX}_{name.upper()}": value for name, value in
           (("as_json", "1"), ("request_id", "fixed-id"), ("everything", "1"))}
    first = run_cli("enqueue", "-q", queue_name, "--text", "a", redis_url=redis_url, **env)
    second = run_cli("enqueue", "-q", queue_name, "--text", "b", redis_url=redis_url, **env)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert not first.stdout.startswith("{") and "fixed-id" not in first.stdout
    assert first.stdout != second.stdout  # two requests, each its own id
    stats = run_cli("queue", "stats", "-q", queue_name, redis_url=redis_url, **env)
    assert stats.stdout.startswith("queue ") and queue_name in stats.stdout  # the table
    purge = run_cli("queue", "dead", "purge", "-q", queue_name, redis_url=redis_url, **env)
    assert purge.returncode == 2 and "name the request ids, or pass --all" in purge.stderr


def test_log_level_works_after_the_command(redis_url: str, queue_name: str) -> None:
    argv = ["worker", "--runner", "tests.runners:echo", "--queue", queue_name, "--burst"]
    chatty = run_cli(*argv, redis_url=redis_url)
    quiet = run_cli(*argv, "--log-level", "WARNING", redis_url=redis_url)
    assert chatty.returncode == quiet.returncode == 0, (chatty.stderr, quiet.stderr)
    assert " INFO " in chatty.stderr and " INFO " not in quiet.stderr


def test_json_outputs_parse(redis_url: str, queue_name: str) -> None:
    import json
    enqueued = json.loads(run_cli("enqueue", "-q", queue_name, "--text", "a", "--text", "b",
                                  "--json", redis_url=redis_url).stdout)
    assert len(enqueued["ids"]) == 2
    cancelled = run_cli("request", "cancel", *enqueued["ids"], "nope", "-q", queue_name,
                        "--json", redis_url=redis_url)
    assert cancelled.returncode == 7
    assert json.loads(cancelled.stdout) == {enqueued["ids"][0]: "cancelled_queued",
                                            enqueued["ids"][1]: "cancelled_queued",
                                            "nope": "not_cancelled"}
    paused = json.loads(run_cli("queue", "pause", queue_name, "--json", redis_url=redis_url).stdout)
    assert paused == {"queue": queue_name, "paused": True}
    purged = json.loads(run_cli("queue", "dead", "purge", "--all", "-q", queue_name, "--json",
                                redis_url=redis_url).stdout)
    assert purged == {"queue": queue_name, "purged": 0}
    stats = run_cli("queue", "stats", "--json", "-q", queue_name, redis_url=redis_url)
    assert json.loads(stats.stdout)["queues"][queue_name]["paused"] is True
    for former in ("stats", "dead", "status", "results", "cancel", "jobs-worker"):
        dropped = run_cli(former, "--help")  # the first wave's names: gone before a release
        assert dropped.returncode == 2 and "No such command" in dropped.stderr, former
