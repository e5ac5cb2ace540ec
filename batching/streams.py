"""Token streams: one Redis stream per generation request, written by the worker as it
decodes, read by ``Handle.stream()`` (and its asyncio twin) and ``enqueue --stream``.

Entries, field ``e`` giving the kind:

- ``start``  ``attempt``: a run of the request begins. A second start means the request
  was run again from the beginning (its worker crashed or handed it back): the reader
  reports "restarted" and the tokens that follow are the new run's.
- ``text``   ``text``, ``tokens``: the text generated since the previous entry, and the
  tokens generated so far. Text that could begin a stop string is held back until it
  cannot.
- ``end``    ``finish_reason``: the run ended; its result is committed (the reader
  then reads it: the stream ends with the final result).

A stream is trimmed to about MAXLEN entries and expires TTL_S after its last start or
end, whether or not anyone reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from batchery.batching.keys import Keys
from batchery.batching.messages import Result

START, TEXT, END = "start", "text", "end"
MAXLEN = 4096   # more than a 1024-token generation's entries, reruns' included
TTL_S = 3600    # a stream serves a live reader; its result outlives it (result_ttl)
BLOCK_MS = 500  # a reader's blocking read; between two it checks for a result by other paths


@dataclass(frozen=True)
class StreamEvent:
    """What a stream reader yields: text as it is generated, then the result."""

    kind: str                    # "text" | "restarted" | "result"
    text: str = ""               # kind "text": the new text
    tokens: int = 0              # kind "text": tokens generated so far in this run
    attempt: int = 0             # kind "restarted": the number of the run that starts
    result: Result | None = None  # kind "result": the request's committed result


class StreamWriter:
    """The worker's side: every entry of one decode step in one round trip.
    ``keys_for``: the keys of a request's queue shard (ShardedQueue.keys_for)."""

    def __init__(self, client: Any, keys_for: Callable[[str], Keys]) -> None:
        self.client, self.keys_for = client, keys_for
        self._entries: list[tuple[str, dict[str, Any], bool]] = []

    def start(self, request_id: str, attempt: int) -> None:
        self._entries.append((request_id, {"e": START, "attempt": attempt}, True))

    def text(self, request_id: str, text: str, tokens: int) -> None:
        self._entries.append((request_id, {"e": TEXT, "text": text, "tokens": tokens}, False))

    def end(self, request_id: str, finish_reason: str) -> None:
        self._entries.append((request_id, {"e": END, "finish_reason": finish_reason}, True))

    def flush(self) -> None:
        self.write(self.take())

    def take(self) -> list[tuple[str, dict[str, Any], bool]]:
        """The entries added since the last take, to ``write`` (on another thread)."""
        entries, self._entries = self._entries, []
        return entries

    def write(self, entries: list[tuple[str, dict[str, Any], bool]]) -> None:
        if not entries:
            return
        pipe = self.client.pipeline(transaction=False)
        for request_id, fields, expire in entries:
            key = self.keys_for(request_id).stream(request_id)
            pipe.xadd(key, fields, maxlen=MAXLEN, approximate=True)
            if expire:
                pipe.expire(key, TTL_S)
        pipe.execute()


class StreamReader:
    """The client's side, over sync or asyncio Redis: where it is, and how entries read."""

    def __init__(self, keys: Keys, request_id: str) -> None:
        self.key = keys.stream(request_id)
        self.last_id = "0-0"
        self.starts = 0
        self.ended = False

    def read(self, client: Any, block: bool = True) -> list[StreamEvent]:
        """The next events (sync client); [] after BLOCK_MS without any."""
        return self.events(client.xread(**self._args(block)))

    async def aread(self, client: Any, block: bool = True) -> list[StreamEvent]:
        """The next events (asyncio client); [] after BLOCK_MS without any."""
        return self.events(await client.xread(**self._args(block)))

    def _args(self, block: bool) -> dict[str, Any]:
        return {"streams": {self.key: self.last_id}, "count": 256,
                "block": BLOCK_MS if block else None}

    def events(self, reply: Sequence[Any] | None) -> list[StreamEvent]:
        """The events in an XREAD reply; sets ``ended`` at an end entry."""
        events = []
        for _key, entries in reply or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                kind = fields.get("e")
                if kind == START:
                    self.starts += 1
                    if self.starts > 1:
                        events.append(StreamEvent("restarted", attempt=int(fields.get("attempt", 0))))
                elif kind == TEXT:
                    events.append(StreamEvent("text", text=fields.get("text", ""),
                                              tokens=int(fields.get("tokens", 0))))
                elif kind == END:
                    self.ended = True
        return events
