"""``batchery dashboard``: serve the page (the ``dashboard`` extra)."""

from __future__ import annotations

import click

from batchery.cli_shared import FINITE, jobs_queue_option, redis_options
from batchery.config import ENV_DASHBOARD_HOST, ENV_DASHBOARD_PORT
from batchery.connection import RedisSettings
from batchery.dashboard.access import ENV_TOKEN, Access, check_token
from batchery.dashboard.state import SAMPLE_S, Board, Options
from batchery.errors import ConfigError
from batchery.listening import check_port_free, is_loopback

DEFAULT_HOST = "127.0.0.1"   # only this machine: binding elsewhere is a decision, with a token
DASHBOARD_PORT = 8480        # clear of 8000/8080 (the gateway, web apps) and 9090 (Prometheus)


@click.command("dashboard")
@click.option("--host", default=DEFAULT_HOST, show_default=True, envvar=ENV_DASHBOARD_HOST,
              help="Address to listen on; anything but loopback needs --token.")
@click.option("--port", default=DASHBOARD_PORT, show_default=True, type=int,
              envvar=ENV_DASHBOARD_PORT)
@click.option("--token", envvar=ENV_TOKEN, help="Needed by the buttons (retry, purge, cancel), "
              "and by every read when --host is not loopback. Default on loopback: a new "
              "one, printed in the URL at start.")
@click.option("--show-payloads", is_flag=True, help="Show dead letters' inputs (users' data: "
              "hidden unless asked for).")
@click.option("--interval", type=FINITE, default=SAMPLE_S, show_default=True,
              help="Seconds between refreshes of the page and samples of the depth chart.")
@jobs_queue_option
@redis_options
def dashboard(host: str, port: int, token: str | None, show_payloads: bool, interval: float,
              jobs_queue: str, redis_url: str | None, cluster: bool) -> None:
    """A web page of queues, workers, dead letters and offline jobs, refreshing itself."""
    try:
        import uvicorn
        from batchery.dashboard.app import create_app
    except ImportError as exc:
        raise ConfigError(f"the dashboard needs its extra ({exc.name} is missing): "
                          "pip install 'batchery[dashboard]'") from None
    if not 0.2 <= interval <= 3600:
        raise ConfigError(f"--interval must be 0.2..3600 seconds, got {interval}")
    token, made_up = check_token(host, token)
    check_port_free(host, port)
    board = Board(RedisSettings.from_url(redis_url, cluster=cluster),
                  Options(jobs_queue=jobs_queue, show_payloads=show_payloads))
    board.sample()  # Redis unreachable or refusing: say so now, not on the first page load
    app = create_app(board, Access(token=token, loopback=is_loopback(host)), interval)
    shown = f"[{host}]" if ":" in host else host
    where = f"http://{shown}:{port}/"
    if made_up:
        click.echo(f"batchery dashboard on {where}?token={token} (read-only at {where})", err=True)
    else:
        click.echo(f"batchery dashboard on {where} (open it with ?token=TOKEN to use the buttons)",
                   err=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        board.close()

