"""The web app: the page, the fragment its script polls, the JSON state, and the buttons.

Starlette (on uvicorn) because it is small, well kept and has no opinion on the rest: a
handful of routes, plain ``def`` handlers that Starlette runs in its thread pool (batchery's
Redis code is synchronous), no ORM, forms or sessions to switch off. Jinja2 renders.

Who may read and act is decided in :mod:`batchery.dashboard.access`.
"""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import redis
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from batchery.batching.keys import check_queue_name
from batchery.dashboard.access import COOKIE, NO_TOKEN_HINT, Access
from batchery.dashboard.render import environment
from batchery.dashboard.state import SAMPLE_S, Board
from batchery.errors import BatcheryError, JobNotFound
from batchery.producer.jobs import bookkeeping as jobs

log = logging.getLogger(__name__)


class Denied(Exception):
    """A request without the right to what it asks (status 401 or 403)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def create_app(board: Board, access: Access, interval_s: float = SAMPLE_S) -> Starlette:
    templates = environment()

    def check_read(request: Request) -> None:
        if not access.host_allowed(request):
            raise Denied(403, "this dashboard answers to a loopback host name only (127.0.0.1, "
                         "localhost); to serve others, bind it with --host and a --token")
        if not access.may_read(request):
            raise Denied(401, "this dashboard needs its token: open the URL with ?token=TOKEN, "
                         "or send the header X-Batchery-Token")

    def check_act(request: Request) -> None:
        check_read(request)
        if not access.may_act(request):
            raise Denied(403, f"the buttons need the dashboard's token: {NO_TOKEN_HINT}")

    def render(name: str, can_act: bool, **extra: Any) -> str:
        act = Markup("") if can_act else Markup(f'disabled title="{NO_TOKEN_HINT}"')
        return templates.get_template(name).render(s=board.state(), act=act, **extra)

    def page(request: Request) -> Response:
        check_read(request)
        presented = request.query_params.get("token") or request.cookies.get(COOKIE)
        token = access.token if access.matches(presented) else ""
        response = HTMLResponse(render("page.html", can_act=bool(token), token=token,
                                       interval_ms=int(interval_s * 1000)))
        if token and access.matches(request.query_params.get("token")):
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    def fragment(request: Request) -> Response:
        check_read(request)
        return HTMLResponse(render("state.html", can_act=access.may_act(request)))

    def api_state(request: Request) -> Response:
        check_read(request)
        return JSONResponse(board.state())

    async def dead_action(request: Request) -> Response:
        check_act(request)
        queue = check_queue_name(request.path_params["queue"])
        ids = await _ids(request)
        action = request.path_params["action"]
        rq_ = board.queue(queue)
        if action == "retry":
            n = await run_in_threadpool(rq_.revive, ids)
            return JSONResponse({"ok": True, "count": n,
                                 "message": f"{n} request(s) back in queue {queue}"})
        n = await run_in_threadpool(rq_.purge, ids)
        return JSONResponse({"ok": True, "count": n,
                             "message": f"{n} dead request(s) purged from queue {queue}"})

    def job_cancel(request: Request) -> Response:
        check_act(request)
        job_id = request.path_params["job_id"]
        before, removed = jobs.cancel(board.rq(), job_id, wait_s=2.0)
        if before in (jobs.FINISHED, jobs.CANCELLED):
            return JSONResponse({"ok": False, "state": before,
                                 "message": f"job {job_id} was {before} already"})
        return JSONResponse({"ok": True, "state": jobs.CANCELLED, "withdrawn": removed,
                             "message": f"job {job_id} cancelled ({removed} queued request(s) "
                                        "withdrawn)"})

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        stop = threading.Event()
        sampler = threading.Thread(target=_sample, args=(board, stop, interval_s),
                                   name="batchery-dashboard-sampler", daemon=True)
        sampler.start()
        try:
            yield
        finally:
            stop.set()
            sampler.join(timeout=5)

    routes = [Route("/", page), Route("/fragment", fragment), Route("/api/state", api_state),
              Route("/api/queues/{queue}/dead/{action:str}", dead_action, methods=["POST"]),
              Route("/api/jobs/{job_id}/cancel", job_cancel, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        Denied: _denied, BatcheryError: _batchery_error, redis.RedisError: _redis_error})


async def _ids(request: Request) -> list[str]:
    """The request ids a dead-letter button names: {"ids": [...]} or {"all": true}."""
    if request.path_params["action"] not in ("retry", "purge"):
        raise Denied(404, "no such action: use .../dead/retry or .../dead/purge")
    try:
        body = await request.json()
    except ValueError:
        raise BatcheryError('the body must be JSON: {"ids": ["ID", ...]} or {"all": true}') from None
    if isinstance(body, dict) and body.get("all") is True and "ids" not in body:
        return []
    ids = body.get("ids") if isinstance(body, dict) else None
    if not ids or not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise BatcheryError('name the dead letters: {"ids": ["ID", ...]}, or {"all": true}')
    return ids


def _sample(board: Board, stop: threading.Event, interval_s: float) -> None:
    """Depth history for the chart, sampled whether or not a page is open."""
    while not stop.wait(interval_s):
        try:
            board.sample()
        except Exception as exc:  # Redis away: the chart has a gap, the page says why
            log.warning("sampling the queues failed: %s", exc)


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/") or request.method != "GET"


def _error(request: Request, status: int, message: str) -> Response:
    if _wants_json(request) or request.url.path == "/fragment":
        return JSONResponse({"ok": False, "error": message}, status_code=status)
    return HTMLResponse(f"<!doctype html><title>batchery</title><p>{Markup.escape(message)}</p>",
                        status_code=status)


async def _denied(request: Request, exc: Exception) -> Response:
    return _error(request, getattr(exc, "status", 403), str(exc))


async def _batchery_error(request: Request, exc: Exception) -> Response:
    return _error(request, 404 if isinstance(exc, JobNotFound) else 400, str(exc))


async def _redis_error(request: Request, exc: Exception) -> Response:
    log.warning("Redis error serving %s: %s", request.url.path, exc)
    return _error(request, 503, f"Redis did not answer ({type(exc).__name__}: {exc}); the page "
                  "tries again at its next refresh")
