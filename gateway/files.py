"""/v1/files: a directory store the jobs workers read too.

Each file is two entries in ``DIR/files``: ``ID.jsonl`` (its bytes) and ``ID.json`` (its
object: name, purpose, owner, times). Uploads are streamed to disk in chunks, downloads
streamed from it: a 200 MB input never sits in memory. A batch's jobs worker reads the
input and writes the outputs at these paths, so the directory must be the same path for
the gateway replicas and the jobs workers (a shared volume in Kubernetes). Object storage
plugs in as a filesystem mounted at that path (s3fs, gcsfuse, blobfuse2, Mountpoint for S3
with appends allowed).

Files expire after the retention period (``expires_after`` may shorten it): a file past
it is deleted when a later upload or batch sweeps the store.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, BinaryIO

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from batchery.gateway.auth import Principal
from batchery.gateway.errors import ApiError, bad_request, json_response, not_found

COPY_BYTES = 1 << 20                  # bytes copied at a time
RETENTION_S = 30 * 86_400             # files and batches are kept 30 days (OpenAI's batch files too)
UPLOAD_PURPOSES = ("batch",)          # what /v1/files takes; outputs are "batch_output"
MAX_UPLOAD_BYTES = 512 * 1024 * 1024  # OpenAI's limit per file


class FileStore:
    def __init__(self, root: str | Path, retention_s: float = RETENTION_S) -> None:
        self.dir = Path(root).expanduser().absolute() / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.retention_s = retention_s

    def content(self, file_id: str) -> Path:
        return self.dir / f"{_checked(file_id)}.jsonl"

    def _meta_path(self, file_id: str) -> Path:
        return self.dir / f"{_checked(file_id)}.json"

    def new(self, filename: str, purpose: str, tenant: str | None,
            expires_in: float | None = None) -> dict[str, Any]:
        """A new file's object, written; its content is written by the caller."""
        now = int(time.time())
        meta = {"id": f"file-{secrets.token_hex(12)}", "object": "file", "bytes": 0,
                "created_at": now, "filename": filename, "purpose": purpose,
                "status": "processed", "expires_at": now + int(expires_in or self.retention_s),
                "tenant": tenant}
        self.content(meta["id"]).touch()
        write_json(self._meta_path(meta["id"]), meta)
        return meta

    def get(self, file_id: str, who: Principal) -> dict[str, Any]:
        """The file's object (its size read now: an output grows while its batch runs);
        raises 404 for a file that is not there, expired, or another tenant's."""
        try:
            meta = json.loads(self._meta_path(file_id).read_text())
            size = self.content(file_id).stat().st_size
        except (OSError, ValueError):
            raise not_found(f"no file {file_id!r}", param="file_id") from None
        if meta.get("tenant") != who.tenant or meta.get("expires_at", 0) < time.time():
            raise not_found(f"no file {file_id!r}", param="file_id")
        return {**meta, "bytes": size}

    def delete(self, file_id: str) -> None:
        self._meta_path(file_id).unlink(missing_ok=True)
        self.content(file_id).unlink(missing_ok=True)

    def listed(self, who: Principal) -> list[dict[str, Any]]:
        found = []
        for path in self.dir.glob("file-*.json"):
            try:
                found.append(self.get(path.stem, who))
            except ApiError:
                continue
        return sorted(found, key=lambda m: m["created_at"], reverse=True)

    def sweep(self) -> int:
        """Delete the files past their expiry; how many."""
        gone = 0
        for path in self.dir.glob("file-*.json"):
            try:
                expired = json.loads(path.read_text()).get("expires_at", 0) < time.time()
            except (OSError, ValueError):
                continue
            if expired:
                self.delete(path.stem)
                gone += 1
        return gone


def public(meta: dict[str, Any]) -> dict[str, Any]:
    """The file object as OpenAI sends it (the owner is ours)."""
    return {k: v for k, v in meta.items() if k != "tenant"}


def _checked(file_id: str) -> str:
    if not file_id.startswith("file-") or not file_id[5:].isalnum():
        raise not_found(f"no file {file_id!r}", param="file_id")
    return file_id


def write_json(path: Path, value: Any) -> None:
    """Written whole or not at all (a reader never sees half an object)."""
    temp = path.with_suffix(f".tmp{secrets.token_hex(4)}")
    temp.write_text(json.dumps(value))
    os.replace(temp, path)


def _copy(source: BinaryIO, target: Path) -> int:
    copied = 0
    with open(target, "wb") as out:
        while chunk := source.read(COPY_BYTES):
            copied += len(chunk)
            if copied > MAX_UPLOAD_BYTES:
                raise bad_request(f"the file is over {MAX_UPLOAD_BYTES >> 20} MB; split it", "file")
            out.write(chunk)
    return copied


class FileRoutes:
    """The handlers of /v1/files."""

    def __init__(self, store: FileStore, authorize: Any) -> None:
        self.store, self.authorize = store, authorize

    async def upload(self, request: Request) -> Response:
        who = self.authorize(request)
        async with request.form(max_files=1, max_fields=10) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("send the file as multipart/form-data field 'file'", "file")
            if purpose not in UPLOAD_PURPOSES:
                raise bad_request(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)} (batchery "
                                  f"stores batch inputs), got {purpose!r}", "purpose")
            expires_in = _expires_after(form)
            await run_in_threadpool(self.store.sweep)
            meta = await run_in_threadpool(self.store.new, upload.filename or "upload.jsonl",
                                           purpose, who.tenant, expires_in)
            try:  # the form parser spooled it to a temporary file: copied in chunks
                await run_in_threadpool(_copy, upload.file, self.store.content(meta["id"]))
            except BaseException:
                self.store.delete(meta["id"])
                raise
        return json_response(public(self.store.get(meta["id"], who)))

    async def get(self, request: Request) -> Response:
        who = self.authorize(request)
        return json_response(public(self.store.get(request.path_params["file_id"], who)))

    async def list(self, request: Request) -> Response:
        who = self.authorize(request)
        files = await run_in_threadpool(self.store.listed, who)
        purpose = request.query_params.get("purpose")
        data = [public(f) for f in files if purpose in (None, f["purpose"])]
        return json_response({"object": "list", "data": data, "has_more": False})

    async def content(self, request: Request) -> Response:
        who = self.authorize(request)
        file_id = request.path_params["file_id"]
        self.store.get(file_id, who)
        return FileResponse(self.store.content(file_id), media_type="application/jsonl")

    async def delete(self, request: Request) -> Response:
        who = self.authorize(request)
        file_id = request.path_params["file_id"]
        self.store.get(file_id, who)
        self.store.delete(file_id)
        return json_response({"id": file_id, "object": "file", "deleted": True})


def _expires_after(form: Any) -> float | None:
    """expires_after[anchor]=created_at, expires_after[seconds]=N, as the SDK sends it."""
    seconds = form.get("expires_after[seconds]")
    if seconds is None:
        return None
    try:
        value = int(seconds)
    except ValueError:
        value = 0
    if not 3600 <= value <= RETENTION_S:
        raise bad_request(f"expires_after.seconds must be 3600..{RETENTION_S}", "expires_after")
    return value
