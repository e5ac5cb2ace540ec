"""/v1/batches: OpenAI's Batch API as batchery offline jobs.

A batch is an offline job (RQ, producer/jobs/) over its input file, writing OpenAI's output
and error lines into two files of the store, on its model's queue at priority ``batch``,
each request with the completion window's end as its deadline. Its record (endpoint,
files, window, metadata, owner) is a JSON file beside the files; its status and counts are
read from the job. Nothing lives in a gateway process: a batch survives any replica's
restart, and a jobs worker's restart resumes the job where it stopped.

Before anything runs, the input's shape is checked whole, as OpenAI does: JSON lines,
unique custom_ids, method POST, url equal to the batch's endpoint, one model. A body the
endpoint refuses is that line's error in the error file; the other lines run.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from batchery.connection import RedisSettings
from batchery.gateway.auth import Principal
from batchery.gateway.catalog import Catalog
from batchery.gateway.errors import ApiError, bad_request, json_response, not_found
from batchery.gateway.files import FileStore, write_json
from batchery.gateway.online import read_json
from batchery.producer.jobs import bookkeeping as jobs
from batchery.producer.jobs.files import IdSet, read_lines
from batchery.producer.jobs.spec import COUNTING, FINALIZING, RUNNING
from batchery.producer.openai_api import TASKS

WINDOW = re.compile(r"(\d{1,3})h")  # (fullmatch: not "24h\n")
MAX_WINDOW_H = 7 * 24        # OpenAI offers 24h; longer windows are allowed up to a week
LINE_LIMIT = 64 << 20        # the shape check reads lines up to this long
MAX_SHAPE_ERRORS = 100       # reported per failed batch
META_KEYS, META_KEY_CHARS, META_VALUE_CHARS = 16, 64, 512   # OpenAI's metadata limits
STATES = {jobs.QUEUED: "in_progress", jobs.RUNNING: "in_progress",
          jobs.FINALIZING: "finalizing", jobs.FINISHED: "completed", jobs.FAILED: "failed",
          jobs.CANCELLED: "cancelled"}
ENDED = ("completed", "failed", "cancelled", "expired")


def check_shape(path: Path, endpoint: str) -> tuple[list[dict[str, Any]], str | None]:
    """(errors in OpenAI's shape, the model every line names) of an input file."""
    errors: list[dict[str, Any]] = []
    ids, model, count = IdSet(), None, 0

    def fail(number: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_SHAPE_ERRORS:
            errors.append({"code": code, "line": number, "message": message, "param": param})

    with open(path, "rb") as f:
        for number, raw in read_lines(f, LINE_LIMIT):
            count += 1
            try:
                obj = json.loads(raw) if raw is not None else None
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                fail(number, "invalid_json_line", "the line is not a JSON object")
                continue
            custom_id = obj.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                fail(number, "missing_custom_id", "custom_id must be a non-empty string", "custom_id")
            elif not ids.add(custom_id):
                fail(number, "duplicate_custom_id", f"custom_id {custom_id[:80]!r} is on an "
                     "earlier line too; custom_ids must be unique", "custom_id")
            if obj.get("method") != "POST":
                fail(number, "invalid_method", "method must be POST", "method")
            if obj.get("url") != endpoint:
                fail(number, "mismatched_endpoint", f"url must be the batch's endpoint {endpoint}",
                     "url")
            body = obj.get("body")
            named = body.get("model") if isinstance(body, dict) else None
            if not isinstance(named, str) or not named:
                fail(number, "invalid_body", "body must be an object with a model", "body.model")
            elif model is None:
                model = named
            elif named != model:
                fail(number, "mismatched_model", f"every line must use one model; line 1 "
                     f"names {model!r}", "body.model")
    if not count:
        fail(0, "empty_file", "the input file has no lines")
    return errors, model


class BatchRoutes:
    """The handlers of /v1/batches over a file store, the catalog and RQ."""

    def __init__(self, files: FileStore, catalog: Catalog, redis: RedisSettings,
                 jobs_queue: str, authorize: Any) -> None:
        self.files, self.catalog, self.authorize = files, catalog, authorize
        self.dir = files.dir.parent / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.redis, self.jobs_queue = redis, jobs_queue
        self._rq: Any = None

    def rq(self) -> Any:
        if self._rq is None:
            self._rq = self.redis.binary_client()
        return self._rq

    # -- records ---------------------------------------------------------------------
    def _path(self, batch_id: str) -> Path:
        if not batch_id.startswith("batch_") or not batch_id[6:].isalnum():
            raise not_found(f"no batch {batch_id!r}", param="batch_id")
        return self.dir / f"{batch_id}.json"

    def load(self, batch_id: str, who: Principal) -> dict[str, Any]:
        try:
            record = json.loads(self._path(batch_id).read_text())
        except (OSError, ValueError):
            raise not_found(f"no batch {batch_id!r}", param="batch_id") from None
        if record.get("tenant") != who.tenant:
            raise not_found(f"no batch {batch_id!r}", param="batch_id")
        return record

    def save(self, record: dict[str, Any]) -> None:
        write_json(self._path(record["id"]), record)

    # -- handlers ----------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        who = self.authorize(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        endpoint, window = body.get("endpoint"), body.get("completion_window", "24h")
        if endpoint not in TASKS:
            raise bad_request(f"endpoint must be one of {', '.join(TASKS)}", "endpoint")
        match = WINDOW.fullmatch(window) if isinstance(window, str) else None
        if not match or not 1 <= int(match.group(1)) <= MAX_WINDOW_H:
            raise bad_request(f"completion_window must be like 24h (1h..{MAX_WINDOW_H}h)",
                              "completion_window")
        metadata = _metadata(body.get("metadata"))
        source = self.files.get(str(body.get("input_file_id")), who)
        if source["purpose"] != "batch":
            raise bad_request("input_file_id must be a file uploaded with purpose batch",
                              "input_file_id")
        now = int(time.time())
        record: dict[str, Any] = {
            "id": f"batch_{secrets.token_hex(12)}", "endpoint": endpoint,
            "input_file_id": source["id"], "completion_window": window, "created_at": now,
            "expires_at": now + 3600 * int(match.group(1)), "metadata": metadata,
            "tenant": who.tenant, "model": None, "job_id": None, "errors": None}
        path = self.files.content(source["id"])
        errors, model = await run_in_threadpool(check_shape, path, endpoint)
        if not errors and model is not None:
            try:
                record["model"] = (await self.catalog.require(model, endpoint, who)).id
            except ApiError as exc:
                errors = [{"code": exc.code or "invalid_model", "line": 1, "message": exc.message,
                           "param": "body.model"}]
        if errors:
            record.update(errors={"object": "list", "data": errors}, failed_at=now)
        else:
            await run_in_threadpool(self._submit, record, path, who)
        await run_in_threadpool(self.save, record)
        return json_response(await run_in_threadpool(self.view, record))

    def sweep(self) -> None:
        """Forget the batches (and files) past the retention period."""
        self.files.sweep()
        oldest = time.time() - self.files.retention_s
        for path in self.dir.glob("batch_*.json"):
            try:
                if json.loads(path.read_text())["created_at"] < oldest:
                    path.unlink(missing_ok=True)
            except (OSError, ValueError, KeyError):
                continue

    def _submit(self, record: dict[str, Any], path: Path, who: Principal) -> None:
        self.sweep()
        out = self.files.new(f"{record['id']}_output.jsonl", "batch_output", who.tenant)
        err = self.files.new(f"{record['id']}_error.jsonl", "batch_output", who.tenant)
        job = jobs.submit(self.rq(), str(path), str(self.files.content(out["id"])),
                          str(self.files.content(err["id"])), queue=record["model"],
                          priority="batch", overwrite=True, jobs_queue=self.jobs_queue,
                          output_format="openai", expires_at=float(record["expires_at"]),
                          meta={"batch": record["id"]}, tenant=who.tenant)
        record.update(job_id=job.id, output_file_id=out["id"], error_file_id=err["id"],
                      in_progress_at=int(time.time()))

    async def get(self, request: Request) -> Response:
        record = self.load(request.path_params["batch_id"], self.authorize(request))
        return json_response(await run_in_threadpool(self.view, record))

    async def list(self, request: Request) -> Response:
        who = self.authorize(request)
        try:
            limit = max(1, min(100, int(request.query_params.get("limit", 20))))
        except ValueError:
            raise bad_request("limit must be an integer 1..100", "limit") from None
        after = request.query_params.get("after")
        views = await run_in_threadpool(self._page, who, limit, after)
        return json_response({"object": "list", "data": views[:limit],
                              "first_id": views[0]["id"] if views else None,
                              "last_id": views[:limit][-1]["id"] if views else None,
                              "has_more": len(views) > limit})

    def _page(self, who: Principal, limit: int, after: str | None) -> list[dict[str, Any]]:
        records = []
        for path in self.dir.glob("batch_*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record.get("tenant") == who.tenant:
                records.append(record)
        records.sort(key=lambda r: (r["created_at"], r["id"]), reverse=True)
        if after:
            ids = [r["id"] for r in records]
            records = records[ids.index(after) + 1:] if after in ids else []
        return [self.view(r) for r in records[:limit + 1]]

    async def cancel(self, request: Request) -> Response:
        record = self.load(request.path_params["batch_id"], self.authorize(request))
        view = await run_in_threadpool(self.view, record)
        if view["status"] in ENDED:
            raise ApiError(409, f"batch {record['id']} is {view['status']} already; only a "
                           "batch in progress can be cancelled", code="batch_not_cancellable")
        record["cancelling_at"] = int(time.time())
        await run_in_threadpool(self.save, record)
        await run_in_threadpool(jobs.cancel, self.rq(), record["job_id"], 0.0)
        return json_response(await run_in_threadpool(self.view, record))

    # -- the view ----------------------------------------------------------------------
    def view(self, record: dict[str, Any]) -> dict[str, Any]:
        """The batch object: the record, with its status and counts read from its job."""
        shown = {k: record.get(k) for k in ("id", "endpoint", "input_file_id",
                                            "completion_window", "created_at", "expires_at",
                                            "metadata", "errors", "model", "in_progress_at",
                                            "cancelling_at", "expired_at", "failed_at")}
        shown.update(object="batch", request_counts={"total": 0, "completed": 0, "failed": 0})
        if record.get("job_id") is None:
            return {**shown, "status": "failed"}
        if record.get("final"):  # ended: kept as it was (its RQ job goes after a week)
            return {**shown, **record["final"]}
        job = jobs.fetch(self.rq(), record["job_id"])
        meta = job.get_meta()
        state = jobs.lifecycle(job.get_status(), meta.get("phase"))
        status = STATES[state]
        if status == "in_progress" and time.time() > record["expires_at"]:
            jobs.cancel(self.rq(), job.id, 0.0)   # the window passed: what ran is kept
            record["expired_at"] = int(time.time())
            self.save(record)
        if record.get("expired_at"):
            status = "expired"
        elif status == "cancelled" and _still_running(meta):
            status = "cancelling"   # its run has not stopped yet
        elif status == "in_progress" and record.get("cancelling_at"):
            status = "cancelling"
        ended = int(job.ended_at.timestamp()) if job.ended_at else int(time.time())
        shown.update(status=status, request_counts={
            "total": meta.get("total") or 0, "completed": meta.get("ok", 0),
            "failed": meta.get("error", 0)})
        if status in ("completed", "failed", "cancelled"):
            shown[f"{status}_at"] = shown.get(f"{status}_at") or ended
        if status in ("finalizing", "completed"):
            shown["finalizing_at"] = ended
        if status in ("completed", "cancelled", "expired"):
            shown["output_file_id"] = record["output_file_id"]
            if self.files.content(record["error_file_id"]).stat().st_size:
                shown["error_file_id"] = record["error_file_id"]
        if status in ENDED:
            record["final"] = {k: shown[k] for k in shown if k.endswith(("_at", "_id"))
                               or k in ("status", "request_counts")}
            self.save(record)
        return shown


def _still_running(meta: dict[str, Any]) -> bool:
    """A job's run is under way: a running phase, saved lately (a dead run's is not)."""
    fresh = time.time() - float(meta.get("updated_at") or 0) < jobs.STALE_S
    return fresh and meta.get("phase") in (RUNNING, COUNTING, FINALIZING)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > META_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= META_KEY_CHARS
            and len(v) <= META_VALUE_CHARS for k, v in value.items()):
        raise bad_request(f"metadata must be an object of at most {META_KEYS} string values "
                          f"(keys up to {META_KEY_CHARS} characters, values up to "
                          f"{META_VALUE_CHARS})", "metadata")
    return value
