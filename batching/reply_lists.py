"""A client's reads of its reply lists: one round trip each (``reply_read``), what it
read (``parse_reply_read``), and what a reader carries from one read to the next
(``ReadState``: which results to delete, which to keep by id). Producers read with them
(batching/shard_producer.py pop_replies, its asyncio twin) for producer/replies.py's
readers; the workers' reaper keeps what a stopped reader left (batching/queue.py
drain_readers, lua/drain.lua)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Container, Sequence

import redis

from batchery.batching.keys import Keys
from batchery.batching.messages import CANCELLED, DEAD, Result

log = logging.getLogger(__name__)

READER_LIVE_MS = 5_000  # a reader's mark lasts this long past each read (Keys.reader_prefix)
MARK_EVERY_S = 1.0  # a reader renews its mark at most this often


class UnreadableRead(redis.exceptions.ResponseError):
    """A reply list read that Redis ran and that read nothing it could, its inboxes of
    another type than a list: the reader's next read is of the other parity, whose DEL
    lets go of them (they were never readable)."""


@dataclass(frozen=True)
class Popped:
    """A read of reply lists: the results, in the order they were pushed on each list, and
    the ids of those kept under their result keys too (pushed marked KEPT: _common.lua);
    the others were pushed onto the list alone, and nowhere else holds them."""

    results: list[Result]
    kept: frozenset[str]


def reply_read(pipe: Any, shards: Sequence[Keys], client_id: str, parity: int, alone: bool,
               block_s: float, forget: Sequence[str] = (), cluster: bool = False,
               mark: bool = True) -> int:
    """A client's read of its reply lists on ``shards`` in one round trip, queued on
    ``pipe`` (a pipeline, not a transaction; run it with raise_on_error=False):

    - the DEL of ``forget``: result keys the last read delivered
      (QueueSettings.delete_delivered); on a Cluster each key is its own DEL (routed by
      its slot: a result read after the shard count changed may live in another slot);
    - on each shard, the DEL of the last read's inbox (what it held was delivered), and
      with ``mark`` the reader's mark: its reader key ("1" when it reads ``alone``, a
      commit then pushing results onto the list alone: lua/complete.lua) for
      READER_LIVE_MS, and the client in the shard's readers set (where the reaper finds it
      once it lapsed);
    - a BLPOP of up to ``block_s`` on the client's bells (a push while the reader is
      marked rings them: lua/_common.lua push_replies);
    - on each shard, the bell deleted (it holds the rings since the BLPOP, for what the
      move below takes too), the reply list moved whole to this read's inbox (RENAMENX:
      none when a read retried after its reply was lost left the inbox there, which it
      then reads again) and the inbox read.

    Nothing leaves Redis until the next read's DEL, sent after what this one read was
    delivered: a reply lost on the way loses nothing, and a list not yet read or an inbox
    not yet deleted holds any result on its way (ShardedQueue.replies_waiting). Returns
    how many DELs lead the replies, for parse_reply_read."""
    deletes = ([[key] for key in forget] if cluster else [list(forget)]) if forget else []
    for keys in deletes:
        pipe.execute_command("DEL", *keys)
    for k in shards:
        pipe.delete(k.inbox(client_id, 1 - parity))
        if mark:
            pipe.set(k.reader(client_id), int(alone), px=READER_LIVE_MS)
            pipe.sadd(k.readers, client_id)
    bells = [k.bell(client_id) for k in shards]
    pipe.blpop(bells, timeout=block_s)
    for k in shards:
        pipe.delete(k.bell(client_id))  # the rings since: what they rang for moves below
        # (RENAMENX by name: redis-py refuses it in a Cluster pipeline, not Redis)
        pipe.execute_command("RENAMENX", k.reply(client_id), k.inbox(client_id, parity))
        pipe.lrange(k.inbox(client_id, parity), 0, -1)
    return len(deletes)


def keep_in(pipe: Any, k: Keys, results: Sequence[Result], ttl: int) -> None:
    """Queue on ``pipe`` the SET of each result under its key on shard ``k`` for ``ttl``
    s: those a read found on a list alone that reached nobody (ReadState.keep)."""
    for result in results:
        pipe.set(k.result(result.id), result.to_json(), ex=ttl)


def waiting_in(pipe: Any, shards: Sequence[Keys], client_id: str) -> int:
    """Queue on ``pipe`` whether the client's reply list or either inbox exists on each of
    ``shards`` (a result may be on its way there); returns how many replies that is."""
    for k in shards:
        pipe.exists(k.reply(client_id), k.inbox(client_id, 0), k.inbox(client_id, 1))
    return len(shards)


def unmark_in(pipe: Any, shards: Sequence[Keys], client_id: str, parity: int) -> None:
    """Queue on ``pipe`` what a reader that stops sends on each of ``shards``: the last
    read's inbox deleted (delivered; ``parity``: the next read's) and its mark lifted."""
    for k in shards:  # (one DEL a shard: the keys share its slot)
        pipe.delete(k.inbox(client_id, 1 - parity), k.reader(client_id))


def parse_reply_read(replies: list[Any], deletes: int, shards: int,
                     marked: bool = True) -> Popped:
    """The results of a reply_read of ``shards`` lists whose first ``deletes`` replies are
    its DELs (``marked``: it marked the reader). A DEL of results that failed is logged
    (they expire after result_ttl); a refused DEL of an inbox or mark raises (a reader that
    cannot let go of what it read would read it again, each time); any other part that
    failed raises unless a list was read: then what was read is returned, not dropped, and
    the failure logged. A read that read nothing because an inbox is no list raises
    UnreadableRead (the next read, of the other parity, deletes it)."""
    failed = [r for r in replies[:deletes] if isinstance(r, Exception)]
    if failed:
        log.warning("deleting delivered results failed (%s); they expire after their "
                    "result_ttl", failed[0])
    marks = deletes + (3 if marked else 1) * shards
    refused = next((r for r in replies[deletes:marks] if isinstance(r, Exception)), None)
    if refused is not None:
        raise refused
    reads, raws = replies[marks + 1:], []
    errors = [r for r in [replies[marks], *reads[0::3]] if isinstance(r, Exception)]
    for moved, read in zip(reads[1::3], reads[2::3]):
        if isinstance(moved, Exception) and "no such key" not in str(moved):
            errors.append(moved)  # (no list to move: nothing was pushed since the last read)
        if isinstance(read, Exception):
            errors.append(read)
        elif read:
            raws += read
    if errors and not raws:
        if all("WRONGTYPE" in str(e) for e in errors):
            raise UnreadableRead(str(errors[0])) from errors[0]
        raise errors[0]
    if errors:
        log.warning("part of a reply list read failed (%s); what it read is delivered",
                    errors[0])
    raws = results_in(raws)
    kept = [raw for raw in raws if is_kept(raw)]
    return Popped(Result.from_json_many(raws),
                  frozenset(r.id for r in Result.from_json_many(kept)) if kept else frozenset())


def results_in(entries: Sequence[Any]) -> list[Any]:
    """The result JSONs of reply-list entries, in order: an entry led by KEPT holds one;
    any other one or more, a line each (a commit's results for one client pushed as one
    entry: lua/complete.lua)."""
    out: list[Any] = []
    for entry in entries:
        newline = "\n" if isinstance(entry, str) else b"\n"
        if newline in entry and not is_kept(entry):
            out += entry.split(newline)
        else:
            out.append(entry)
    return out


def is_kept(entry: str | bytes) -> bool:
    """Whether a reply-list entry is kept under its result key too: led by KEPT, a space
    (lua/_common.lua), where one pushed onto the list alone starts its JSON."""
    return entry[:1] in (" ", b" ")


def entry_id(entry: str) -> str | None:
    """The id of a reply-list entry pushed alone, as lua/drain.lua reads it (a JSON object
    with a text id; an entry led by a space is kept under its key already): None for any
    other entry."""
    if is_kept(entry):
        return None
    try:
        found = json.loads(entry)
    except ValueError:
        return None
    return found.get("id") if isinstance(found, dict) and isinstance(found.get("id"), str) else None


def unreached(popped: Popped, reached: Sequence[Result]) -> list[Result]:
    """The results of a read pushed onto the list alone that reached nobody: to keep."""
    got = {r.id for r in reached}
    return [r for r in popped.results if r.id not in got and r.id not in popped.kept]


def to_delete(reached: Sequence[Result], deletes_delivered: Callable[[], bool] | None,
              kept: Container[str] | None = None) -> list[str]:
    """The ids of results that reached their waiters and are to be deleted: none when the
    queue keeps delivered results, nor dead letters or cancelled ones (they stay: for
    `queue dead list`, for a generation's text attached after its cancel), nor those a
    read found on a list alone (not in ``kept``; None: all were kept)."""
    ids = [r.id for r in reached if r.status not in (DEAD, CANCELLED)
           and (kept is None or r.id in kept)]
    if not ids or deletes_delivered is None:
        return []
    try:
        return ids if deletes_delivered() else []
    except redis.RedisError as exc:  # the settings unreadable: kept, expiring after result_ttl
        not_deleted(ids, exc)
        return []


def not_deleted(ids: Sequence[str], exc: Exception) -> None:
    if ids:  # they expire after result_ttl anyway
        log.warning("deleting %d delivered result(s) failed (%s)", len(ids), exc)


@dataclass(frozen=True)
class Read:
    """What one read sends (reply_lists.reply_read)."""

    forget: list[str]
    parity: int
    alone: bool
    mark: bool


class ReadState:
    """What a reader carries from one read to the next.

    The next read deletes the inbox this one filled, so the results kept by id
    (``keep``: those that reached nobody) are stored before it. A reader marks itself
    reading alone only once a read of its went through (one refused for want of rights
    would strand what commits push alone), and renews its mark every MARK_EVERY_S, not
    at each read. Once its mark may have lapsed (a stall), the reaper may have stored the
    last read's results under their keys (lua/drain.lua): the next read deletes those."""

    def __init__(self, alone: bool) -> None:
        self.alone = alone
        self.parity = 0
        self.forget: list[str] = []  # result keys to delete with the next read
        self.keep: list[Result] = []  # results to store by id before the next read
        self.delivered: list[str] = []  # the last read's results pushed alone, delivered
        self.read_ok = False
        self.marked_at: float | None = None  # when the last mark was sent
        self.marked_alone = False  # ... and whether it said the reader reads alone
        self.remark = True  # mark with the next read, whenever the last was sent

    def next_read(self, now: float) -> Read:
        lapsed = READER_LIVE_MS / 1000 - MARK_EVERY_S  # a mark this old may have lapsed
        if self.marked_at is not None and now - self.marked_at > lapsed:
            self.forget, self.delivered, self.remark = self.forget + self.delivered, [], True
        alone = self.alone and self.read_ok
        mark = (self.remark or self.marked_at is None or now - self.marked_at >= MARK_EVERY_S
                or self.marked_alone != alone)
        if mark:
            self.marked_at, self.marked_alone, self.remark = now, alone, False
        return Read(self.forget, self.parity, alone, mark)

    def done(self, read: Read, popped: Popped, reached: Sequence[Result],
             deletes_delivered: Callable[[], bool] | None) -> None:
        self.parity, self.read_ok = 1 - read.parity, True
        self.forget = to_delete(reached, deletes_delivered, popped.kept)
        self.keep = unreached(popped, reached)
        self.delivered = [r.id for r in reached if r.id not in popped.kept]

    def failed(self, exc: Exception) -> None:
        """A read (or the keeping before it) failed: its parity stays (its inbox may hold
        what it moved), unless Redis ran it and it could read nothing (UnreadableRead)."""
        self.forget, self.read_ok, self.remark = [], False, True
        if isinstance(exc, UnreadableRead):
            self.parity = 1 - self.parity
