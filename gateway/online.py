"""The online endpoints: /v1/embeddings, /v1/completions, /v1/chat/completions.

Each call becomes batchery requests on the queue its model names (one per embedding,
one per choice), enqueued through that queue's AsyncClient and awaited; a client that
disconnects cancels them. ``stream: true`` sends server-sent events fed by the requests'
token streams and ends with ``data: [DONE]``.

Priority: ``service_tier`` (priority -> realtime, default/auto -> normal, flex -> batch),
or the header ``X-Batchery-Priority`` (a class name or a delay in seconds), which wins.
``X-Batchery-Deadline`` (seconds) gives the requests a deadline: past it, 504.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from batchery import tracing
from batchery.batching.codec import encode, loads
from batchery.batching.messages import Result
from batchery.batching.request import check_deadline, check_priority, parse_priority
from batchery.batching.pricing import estimate_tokens
from batchery.errors import InvalidRequest, ResultTimeout
from batchery.gateway.auth import Principal
from batchery.gateway.catalog import Catalog
from batchery.gateway.errors import (ApiError, bad_request, from_batchery, from_result,
                                     json_response)
from batchery.producer.aio import AsyncClient, AsyncHandle
from batchery.producer.openai_api import (CHAT, EMBEDDINGS, Call, chunk, embeddings_body,
                                          finish_reason, generation_body, generation_usage,
                                          parse_body, usage_chunk)
from batchery.producer.replies import read_when_done

PRIORITY_HEADER = "x-batchery-priority"
DEADLINE_HEADER = "x-batchery-deadline"
DEADLINE_GRACE_S = 5.0   # past a deadline, a request no worker took is answered 504 after this
ID_PREFIX = {EMBEDDINGS: "embd", CHAT: "chatcmpl"}
_background: set[asyncio.Task] = set()  # cancels sent after a disconnect, kept till done


async def read_json(request: Request) -> Any:
    try:
        return loads(await request.body())
    except ValueError:
        raise bad_request("the body must be JSON (Content-Type: application/json)") from None


def request_fields(request: Request, call: Call, who: Principal) -> dict[str, Any]:
    """Priority, deadline and meta shared by the call's requests."""
    fields: dict[str, Any] = {"priority": call.priority}
    given = request.headers.get(PRIORITY_HEADER)
    try:
        if given is not None:
            fields["priority"] = check_priority(parse_priority(given))
        deadline = request.headers.get(DEADLINE_HEADER)
        if deadline is not None:
            fields["deadline"] = check_deadline(float(deadline))
    except (InvalidRequest, ValueError) as exc:
        raise bad_request(f"header: {exc}", PRIORITY_HEADER if given else DEADLINE_HEADER) from None
    if who.tenant:  # the API key's tenant: its fair share of the queue (docs/fair-share.md)
        fields["tenant"] = who.tenant
    request_id = request.headers.get("x-request-id")
    if request_id:
        fields["meta"] = {"request_id": request_id}
    return fields


class Online:
    """The three endpoints over one Catalog."""

    def __init__(self, catalog: Catalog, authorize: Any) -> None:
        self.catalog, self.authorize = catalog, authorize

    async def embeddings(self, request: Request) -> Response:
        return await self._serve(request, EMBEDDINGS)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/completions")

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, CHAT)

    async def _serve(self, request: Request, endpoint: str) -> Response:
        who = self.authorize(request)
        call = parse_body(endpoint, await read_json(request))
        model = await self.catalog.require(call.model, endpoint, who)
        client = await self.catalog.client(model.id)
        fields = request_fields(request, call, who)
        rid = f"{ID_PREFIX.get(endpoint, 'cmpl')}-{secrets.token_hex(12)}"
        ids = [rid] if len(call.inputs) == 1 else [f"{rid}.{i}" for i in range(len(call.inputs))]
        with tracing.caller(request.headers.get("traceparent")):
            handles = await client.enqueue_many([{"input": x, "id": i, **fields}
                                                 for x, i in zip(call.inputs, ids)])
        timeout = fields["deadline"] + DEADLINE_GRACE_S if "deadline" in fields else None
        headers = {"x-request-id": rid}
        if call.stream:
            return StreamingResponse(self._events(client, call, handles, rid, timeout),
                                     media_type="text/event-stream", headers=headers)
        results = await _awaited(request, client, handles, timeout)
        failed = next((r for r in results if not r.ok), None)
        if failed is not None:
            raise from_result(failed)
        outputs = [r.output for r in results]
        if endpoint == EMBEDDINGS:
            tokens = sum(h.tokens or estimate_tokens(x) for h, x in zip(handles, call.inputs))
            return json_response(embeddings_body(call, outputs, tokens), headers=headers)
        return json_response(generation_body(call, rid, int(time.time()), outputs), headers=headers)

    async def _events(self, client: AsyncClient, call: Call, handles: list[AsyncHandle],
                      rid: str, timeout: float | None) -> AsyncIterator[bytes]:
        """The SSE stream of a generation: chunks as text arrives, the last one with its
        finish_reason, the usage when asked for, then [DONE]. A failed request sends
        OpenAI's error event instead."""
        created, outputs = int(time.time()), [None] * len(handles)
        left = set(range(len(handles)))
        try:
            for i in range(len(handles)):  # the role first, as OpenAI sends it
                if call.endpoint == CHAT:
                    yield _event(chunk(call, rid, created, i, "", first=True))
            async for i, text, result in _merged(handles, timeout):
                if result is None:
                    yield _event(chunk(call, rid, created, i, text))
                    continue
                left.discard(i)
                if not result.ok:
                    yield _event(from_result(result).body())
                    break
                outputs[i] = result.output
                yield _event(chunk(call, rid, created, i, None, finish_reason(result.output)))
            else:
                if call.include_usage:
                    shared = [{**o, "prompt_index": i // call.n} for i, o in enumerate(outputs)
                              if isinstance(o, dict)]
                    yield _event(usage_chunk(call, rid, created, generation_usage(shared)))
            yield b"data: [DONE]\n\n"
        except ResultTimeout as exc:
            yield _event(from_batchery(exc).body())
            yield b"data: [DONE]\n\n"
        finally:
            if left:  # the client went away (or one failed): stop the others
                _cancel_later(client, [handles[i].id for i in left])


def _event(body: Any) -> bytes:
    return b"data: " + encode(body, "replace") + b"\n\n"


async def _merged(handles: list[AsyncHandle], timeout: float | None
                  ) -> AsyncIterator[tuple[int, str, Result | None]]:
    """(choice, new text, None) as text arrives, (choice, "", result) at each end. A run
    restarted from the beginning (its worker died) repeats the text already sent: it is
    skipped, so the client sees one continuous text."""
    if len(handles) == 1:
        async for item in _choice(0, handles[0], timeout):
            yield item
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: AsyncHandle) -> None:
        try:
            async for item in _choice(i, handle, timeout):
                await merged.put(item)
        except Exception as exc:  # raised where the stream is read
            await merged.put(exc)

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        for _ in range(len(handles)):
            while True:
                item = await merged.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item[2] is not None:
                    break
    finally:
        for task in tasks:
            task.cancel()


async def _choice(i: int, handle: AsyncHandle, timeout: float | None
                  ) -> AsyncIterator[tuple[int, str, Result | None]]:
    sent, skip = 0, 0
    async for event in handle.stream(timeout):
        if event.kind == "restarted":
            skip, sent = sent, 0
        elif event.kind == "text":
            text = event.text
            if skip:
                cut = min(skip, len(text))
                text, skip = text[cut:], skip - cut
            sent += len(event.text)
            if text:
                yield i, text, None
        elif event.result is not None:
            yield i, "", event.result


async def _awaited(request: Request, client: AsyncClient, handles: list[AsyncHandle],
                   timeout: float | None) -> list[Result]:
    """The handles' results; if the client disconnects first, their requests are cancelled."""
    # (cancelled below, or left behind when this handler is cancelled)
    waiting = read_when_done(asyncio.gather(*(h.result(timeout) for h in handles)))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((waiting, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if waiting.done():
        try:
            return waiting.result()
        except ResultTimeout:  # past the deadline and its grace: no worker took them
            _cancel_later(client, [h.id for h in handles])
            raise
    waiting.cancel()
    _cancel_later(client, [h.id for h in handles])
    raise ApiError(499, "the client closed the connection; its requests were cancelled",
                   code="client_closed_request")


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _cancel_later(client: AsyncClient, ids: list[str]) -> None:
    """Cancel in a task of its own: the caller may be inside a cancelled scope."""
    task = asyncio.get_running_loop().create_task(client.cancel(ids))
    _background.add(task)
    task.add_done_callback(_background.discard)
