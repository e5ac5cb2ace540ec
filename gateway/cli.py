"""``batchery serve``: the OpenAI-compatible gateway (the ``serve`` extra)."""

from __future__ import annotations

import os
from typing import Any

import click
from redis import exceptions as redis_errors

from batchery.cli_shared import jobs_queue_option, redis_options
from batchery.config import ENV_API_KEYS, state_dir
from batchery.connection import RedisSettings
from batchery.listening import check_port_free, is_loopback
from batchery.errors import ConfigError

LOOPBACK = "127.0.0.1"   # no keys: only this machine may call
ANY_HOST = "0.0.0.0"     # keys configured: a replica behind a load balancer
SERVE_PORT = 8000         # where OpenAI-compatible servers (vLLM, TGI's router) listen
# Idle keep-alive connections stay open this long: longer than load balancers' idle timeout
# (60 s on most), so that none sends a request on a connection the gateway just closed.
KEEP_ALIVE_S = 75


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
@click.option("--files-dir", help="Where /v1/files and batch outputs live: a directory the "
              "jobs workers read too (a shared volume) [default: BATCHERY_HOME/files].")
@jobs_queue_option
@redis_options
def serve(host: str | None, port: int, queues: tuple[str, ...], keys_file: str | None,
          files_dir: str | None, jobs_queue: str, redis_url: str | None, cluster: bool) -> None:
    """Serve the OpenAI API (/v1/models, embeddings, completions, chat, files, batches)
    over batchery's queues."""
    try:
        import uvicorn
        from batchery.gateway.app import Gateway, create_app
        from batchery.gateway.auth import Keys
        from batchery.gateway.catalog import Catalog
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
    redis = RedisSettings.from_url(redis_url, cluster=cluster)
    catalog = Catalog(redis, tuple(check_queue_name(q) for q in queues))
    try:
        catalog.ping()
    except redis_errors.ConnectionError as exc:  # it may start after us: /ready says 503 till then
        click.echo(f"warning: Redis does not answer yet ({exc}); serving anyway, /ready "
                   "answers 503 until it does", err=True)
    gateway = Gateway(catalog, keys)
    _add_batches(gateway, redis, files_dir or default_files_dir(), jobs_queue)
    shown = f"[{host}]" if ":" in host else host
    served = ", ".join(queues) if queues else "every registered queue"
    if keys.configured:
        click.echo(f"batchery serve: OpenAI API on http://{shown}:{port}/v1 ({served}; "
                   f"{len(keys)} API key(s))", err=True)
    else:
        click.echo(f"batchery serve: OpenAI API on http://{shown}:{port}/v1 ({served}); no API "
                   f"keys configured, so it listens on {host} only and takes any key", err=True)
    uvicorn.run(create_app(gateway), host=host, port=port, log_level="warning",
                access_log=False, timeout_keep_alive=KEEP_ALIVE_S)


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
