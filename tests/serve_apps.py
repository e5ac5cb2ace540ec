"""ASGI apps for the tests of `batchery serve`'s processes (gateway/processes.py)."""

from __future__ import annotations

import os
from typing import Any

ENV_MARKER = "BATCHERY_TEST_FIRST_FAILS"  # a path: the process that creates it first fails


def first_fails() -> Any:
    """uvicorn's factory: raises in the first process to call it, serves in the others."""
    try:
        open(os.environ[ENV_MARKER], "x").close()
    except FileExistsError:
        return _hello
    raise RuntimeError("this process was chosen to fail at startup")


async def _hello(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})
