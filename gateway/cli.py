"""``batchery serve``: the OpenAI-compatible gateway (the ``serve`` extra)."""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
from redis import exceptions as redis_errors

from batchery.cli_shared import jobs_queue_option, redis_options
from batchery.config import ENV_API_KEYS, state_dir, usable_cpus
from batchery.connection import RedisSettings
from batchery.listening import check_port_free, is_loopback
from batchery.errors import ConfigError
from batchery.gateway.processes import BALANCED, serve as serve_processes

LOOPBACK = "127.0.0.1"   # no keys: only this machine may call
ANY_HOST = "0.0.0.0"     # keys configured: a replica behind a load balancer
SERVE_PORT = 8000         # where OpenAI-compatible servers (vLLM, TGI's router) listen
# Idle keep-alive connections stay open this long: longer than load balancers' idle timeout
# (60 s on most), so that none sends a request on a connection the gateway just closed.
KEEP_ALIVE_S = 75
# `serve` without --processes: half the usable CPUs, from 2 (on a smaller host the gateway
# would take its cores from the model and Redis) to 4 (at 64 callers, 4 processes answered
# as fast as the Python client straight to an H200's MiniLM worker, 8 no faster:
# bench/gateway.py); more with --processes, or replicas
AUTO_MIN_PROCESSES, AUTO_MAX_PROCESSES = 2, 4
# `serve --processes N`: the settings each of the N processes builds its app from (each
# starts as a fresh interpreter, so they take them from the environment, as JSON)
ENV_SERVE_SETTINGS = "BATCHERY_SERVE_SETTINGS"


@dataclass(frozen=True)
class ServeSettings:
    """What an app of `batchery serve` is built from, in the process that serves it."""

    queues: tuple[str, ...]
    keys_file: str | None
    files_dir: str
    jobs_queue: str
    redis_url: str | None
    cluster: bool


def default_processes(cpus: int) -> int:
    """`serve`'s processes without --processes, on a host where it may use ``cpus``."""
    half = cpus // 2
    return 1 if half < AUTO_MIN_PROCESSES else min(half, AUTO_MAX_PROCESSES)


def default_files_dir() -> str:
    return str(state_dir() / "files")


@click.command("serve")
@click.option("--host", help=f"Address to listen on [default: {ANY_HOST} with API keys, "
              f"{LOOPBACK} without: then anything but loopback is refused].")
@click.option("--port", default=SERVE_PORT, show_default=True, type=int)
@click.option("--queue", "-q", "queues", multiple=True, help="Serve this queue (repeatable); "
              "default: every queue registered in Redis, each as the model of its name.")
@click.option("--keys-file", type=click.Path(dir_okay=False), help="API keys, one "
              f"`KEY TENANT [QUEUE,...|*]` per line (also from {ENV_API_KEYS}).")
@click.option("--processes", type=click.IntRange(1, 256), help="Processes answering on "
              "the port, each with its own event loop (one that dies is started again) "
              f"[default: {AUTO_MAX_PROCESSES} at most, half the usable CPUs, 1 under "
              f"{2 * AUTO_MIN_PROCESSES} CPUs].")
@click.option("--files-dir", help="Where /v1/files and batch outputs live: a directory the "
              "jobs workers read too (a shared volume) [default: BATCHERY_HOME/files].")
@jobs_queue_option
@redis_options
def serve(host: str | None, port: int, queues: tuple[str, ...], keys_file: str | None,
          processes: int | None, files_dir: str | None, jobs_queue: str, redis_url: str | None,
          cluster: bool) -> None:
    """Serve the OpenAI API (/v1/models, embeddings, completions, chat, files, batches)
    over batchery's queues."""
    try:
        import uvicorn
        importlib.import_module("starlette")  # the app's framework, in the extra too
        from batchery.gateway.auth import Keys
    except ImportError as exc:
        raise ConfigError(f"the gateway needs its extra ({exc.name} is missing): "
                          "pip install 'batchery[serve]'") from None
    from batchery.batching.keys import check_queue_name
    keys = Keys.load(keys_file, os.environ.get(ENV_API_KEYS))
    host = host or (ANY_HOST if keys.configured else LOOPBACK)
    if not keys.configured and not is_loopback(host):
        raise ConfigError(f"refusing to serve on {host} without API keys: anyone who reaches "
                          f"it could use every queue. Give keys (--keys-file, or {ENV_API_KEYS}"
                          f"), or keep the default --host {LOOPBACK}")
    check_port_free(host, port)
    processes = processes or default_processes(usable_cpus())
    settings = ServeSettings(tuple(check_queue_name(q) for q in queues), keys_file,
                             files_dir or default_files_dir(), jobs_queue, redis_url, cluster)
    try:
        Path(settings.files_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--files-dir {settings.files_dir}: cannot create it "
                          f"({exc.strerror}); give a directory this user can write") from None
    probe = RedisSettings.from_url(redis_url, cluster=cluster).client()
    try:
        probe.ping()
    except redis_errors.ConnectionError as exc:  # it may start after us: /ready says 503 till then
        click.echo(f"warning: Redis does not answer yet ({exc}); serving anyway, /ready "
                   "answers 503 until it does", err=True)
    finally:
        probe.close()
    shown = f"[{host}]" if ":" in host else host
    served = ", ".join(queues) if queues else "every registered queue"
    if processes > 1:
        served += f"; {processes} processes"
    if keys.configured:
        click.echo(f"batchery serve: OpenAI API on http://{shown}:{port}/v1 ({served}; "
                   f"{len(keys)} API key(s))", err=True)
    else:
        click.echo(f"batchery serve: OpenAI API on http://{shown}:{port}/v1 ({served}); no API "
                   f"keys configured, so it listens on {host} only and takes any key", err=True)
    listen = {"host": host, "port": port, "log_level": "warning", "access_log": False,
              "timeout_keep_alive": KEEP_ALIVE_S}
    app = build_app(settings)  # with N processes, what would fail in each fails here, once
    if processes == 1:
        uvicorn.run(app, **listen)
        return
    # each process imports the app's factory, which reads the settings from the environment
    os.environ[ENV_SERVE_SETTINGS] = json.dumps(asdict(settings))
    factory = {"app": f"{__name__}:app_from_environment", "factory": True}
    if BALANCED:  # a socket per process: the kernel spreads the connections over them
        serve_processes(processes, **factory, **listen)
    else:  # uvicorn's workers, on one shared socket
        uvicorn.run(**factory, workers=processes, **listen)


def build_app(settings: ServeSettings) -> Any:
    """The gateway's app: its queues' catalog, the API keys, the Batch API's routes."""
    from batchery.gateway.app import Gateway, create_app
    from batchery.gateway.auth import Keys
    from batchery.gateway.catalog import Catalog
    redis = RedisSettings.from_url(settings.redis_url, cluster=settings.cluster)
    gateway = Gateway(Catalog(redis, settings.queues),
                      Keys.load(settings.keys_file, os.environ.get(ENV_API_KEYS)))
    _add_batches(gateway, redis, settings.files_dir, settings.jobs_queue)
    return create_app(gateway)


def app_from_environment() -> Any:
    """uvicorn's factory in each process of `batchery serve --processes N`: the app of the
    settings the command put in the environment."""
    raw = json.loads(os.environ[ENV_SERVE_SETTINGS])
    return build_app(ServeSettings(**{**raw, "queues": tuple(raw["queues"])}))


def _add_batches(gateway: Any, redis: RedisSettings, files_dir: str, jobs_queue: str) -> None:
    """The Batch API's routes: /v1/files and /v1/batches over the file store and RQ."""
    from starlette.routing import Route
    from batchery.gateway.batches import BatchRoutes
    from batchery.gateway.files import FileRoutes, FileStore
    store = FileStore(files_dir)
    files = FileRoutes(store, gateway.authorize)
    batches = BatchRoutes(store, gateway.catalog, redis, jobs_queue, gateway.authorize)
    gateway.extra_routes += [
        Route("/v1/files", files.upload, methods=["POST"]),
        Route("/v1/files", files.list, methods=["GET"]),
        Route("/v1/files/{file_id}", files.get, methods=["GET"]),
        Route("/v1/files/{file_id}", files.delete, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", files.content, methods=["GET"]),
        Route("/v1/batches", batches.create, methods=["POST"]),
        Route("/v1/batches", batches.list, methods=["GET"]),
        Route("/v1/batches/{batch_id}", batches.get, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", batches.cancel, methods=["POST"])]
