"""The claim's call and reply: its KEYS and ARGV (a worker's counts among them), and its
reply read back with the payloads read after it (lua/claim.lua returns ids, not payloads:
a value a script reads costs Redis about three times a plain read's)."""

from __future__ import annotations

import numbers
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

from batchery.batching.calls import Call, fixed_keys
from batchery.batching.keys import Keys
from batchery.batching.messages import Claimed, stored_input
from batchery.batching.settings import DEFAULTS
from batchery.connection import ENCODING_ERRORS

MAX_LOOKAHEAD = 4096          # keeps every variadic call in the claim below Lua's limits
NOTHING_PENDING = -1          # a claim's wait_ms when the queue holds nothing it could lease
NEXT_LEASE = "+"              # a claim's token and this: the lease of a deep queue's next batch
TO_PRICE = -2                 # ... when it leased nothing: its candidates need counting first


@dataclass
class ClaimReply:
    now_ms: int
    wait_ms: int      # > 0: held back; NOTHING_PENDING: nothing to lease
    expired: list[Claimed] = field(default_factory=list)
    batch: list[Claimed] = field(default_factory=list)
    # candidates priced by estimate, (id, input): count them, claim again with the counts
    to_price: list[tuple[str, Any]] = field(default_factory=list)
    # with a batch: requests next in line, (id, input), for a counting worker to count now
    # and send with its next claim (which then needs no pricing round); the claim hands
    # them over when its own candidates were estimated (lua/claim.lua: "priced ahead")
    price_ahead: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def nothing_pending(self) -> bool:
        return self.wait_ms == NOTHING_PENDING


def claim_call(k: Keys, token: str, max_batch_size: int, max_batch_tokens: int,
               max_wait_ms: int, lookahead: int, price_estimates: bool,
               counts: Sequence[tuple[str, int]], ceiling: float | None,
               batches: int = 1) -> Call:
    """The claim script's KEYS and ARGV (see lua/claim.lua and RequestQueue.claim)."""
    if batches not in (1, 2):
        raise ValueError(f"a claim leases one batch or two, not {batches}")
    return Call(fixed_keys(k, "claim", claim=k.claim(token)),
                [token, max_batch_size, max_batch_tokens, max_wait_ms,
                 min(lookahead, MAX_LOOKAHEAD), DEFAULTS.lease_seconds, int(price_estimates),
                 "" if ceiling is None else int(ceiling), *packed_counts(counts), batches])


def packed_counts(counts: Sequence[tuple[str, Any]]) -> list[bytes]:
    """A worker's counts as the claim takes them: two MessagePack arrays, the ids and their
    counts in the same order, which the claim unpacks with one call each (cmsgpack: a
    pattern splitting a joined text ran per character, about 4k instructions a request).
    A count that is not a positive integer goes as 0 (the claim ignores it)."""
    return [packed_array([i for i, _ in counts]), packed_array([count_of(c) for _, c in counts])]


def count_of(count: Any) -> int:
    """A count the claim takes (a positive integer of at most 8 digits, numpy's integers
    too) as itself; 0 for anything else."""
    if isinstance(count, numbers.Integral) and not isinstance(count, bool) and 0 < count < 10**8:
        return int(count)
    return 0


# MessagePack's headers wider than one byte: (struct format, type code, lengths below)
ARRAY_HEADERS = ((">BH", 0xDC, 1 << 16), (">BI", 0xDD, 1 << 32))
TEXT_HEADERS = ((">BB", 0xD9, 1 << 8), (">BH", 0xDA, 1 << 16), (">BI", 0xDB, 1 << 32))


def packed_array(items: Sequence[str | int]) -> bytes:
    """``items`` (texts and integers from 0 to 2**32 - 1) as one MessagePack array
    (msgpack.org's format: a length, then each item with its type and length). A text
    holding bytes that are not UTF-8 (read from Redis as lone surrogates) goes as those
    bytes."""
    out = [length_header(len(items), 0x90, 16, ARRAY_HEADERS)]
    for item in items:
        if isinstance(item, int):
            out.append(bytes([item]) if item < 0x80 else struct.pack(">BI", 0xCE, item))
        else:
            b = item.encode("utf-8", ENCODING_ERRORS)  # an id read from Redis as it was there
            out += [length_header(len(b), 0xA0, 32, TEXT_HEADERS), b]
    return b"".join(out)


def length_header(n: int, fixed: int, fixed_below: int,
                  wider: tuple[tuple[str, int, int], ...]) -> bytes:
    """The header of an array or text of length ``n``: the length inside its one byte
    (``fixed | n``) below ``fixed_below``, else the narrowest of ``wider`` that holds it."""
    if n < fixed_below:
        return bytes([fixed | n])
    fmt, code, _ = next(w for w in wider if n < w[2])
    return struct.pack(fmt, code, n)


def opened(reply: list[Any]) -> list[Any]:
    """The claim's reply with its joined texts (lua/claim.lua reply_for: ids, entries and
    the ids handed ahead, or the ids to price; newline-free) split into lists, once: the
    form claim_payload_ids, payloads_read_ahead and parse_claim read. An entry '' is one
    handed over without it."""
    if int(reply[1]) == TO_PRICE:
        return [*reply[:3], lines(reply[3])]
    if len(reply) == 3:
        return reply
    return [*reply[:4], lines(reply[4]), reply[5].split("\n"), reply[6], lines(reply[7]),
            int(reply[8])]


def lines(text: str) -> list[str]:
    """One of the claim's joined texts as its items; none for ''."""
    return text.split("\n") if text else []


def by_lease(requests: Sequence[Claimed]) -> list[list[Claimed]]:
    """A claim's requests, a list per lease in the claim's order (its own batch, then a
    deep queue's next one): each is run and committed as a batch of its own."""
    leases: dict[str, list[Claimed]] = {}
    for r in requests:
        leases.setdefault(r.lease_token, []).append(r)
    return list(leases.values())


def claim_payload_ids(reply: list[Any]) -> list[str]:
    """The ids (of a reply ``opened``) whose payloads the caller of a claim reads after
    it, with one plain ``HMGET`` of ``requests``, in this order: the candidates to price,
    or the ids leased and then the ones handed ahead (lua/claim.lua: a value a script reads
    costs Redis about three times a plain read's)."""
    if int(reply[1]) == TO_PRICE:
        return list(reply[3])
    if len(reply) == 3:
        return []
    return [*reply[4], *reply[7]]


def payloads_read_ahead(reply: list[Any], ahead: dict[str, tuple[Any, int]]) -> dict[int, Any]:
    """The payloads of requests this claim leased that the worker read when an earlier
    claim handed them ahead (``ahead``: id -> (payload, that claim's now_ms)), by place in
    ``claim_payload_ids(reply)``: read once, not again with the lease. Only those whose
    schedule entry says they were enqueued before that claim: a request cancelled, or
    finished and its result delivered, and enqueued again under its id since, is enqueued
    after it, and its payload read again. (Both times are the shard's Redis clock, as every
    rank and lease of the queue: lua/_common.lua now_ms.)"""
    if not ahead or len(reply) == 3 or int(reply[1]) == TO_PRICE:
        return {}
    out = {}
    for n, (request_id, sched) in enumerate(zip(reply[4], reply[5])):
        got = ahead.get(request_id)
        if got is not None and sched and enqueued_before(sched, got[1]):
            out[n] = got[0]
    return out


def enqueued_before(sched: str, ms: int) -> bool:
    """Whether a schedule entry ("tokens:expire:enqueued:...") was enqueued before ``ms``;
    False for one that cannot be read."""
    fields = sched.split(":", 3)
    return len(fields) > 3 and fields[2].isdigit() and int(fields[2]) < ms


def parse_claim(reply: list[Any], token: str, payloads: Sequence[str | None]) -> ClaimReply:
    """The claim's reply (``opened``) with the payloads of ``claim_payload_ids(reply)``,
    read after it. A request leased whose payload is gone (cancelled since) is handed over
    as one that cannot run (Claimed.decode), as one whose payload is missing: its lease
    was taken with it, so what its worker reports is discarded. One handed ahead whose
    payload is gone (taken and finished by another worker since) is left out. The last
    ``n_next`` leased (a deep queue's next batch) hold the lease ``token + NEXT_LEASE`` and
    were chosen against their own head (its rank), not the claim's."""
    now_ms, wait_ms, n_expired = int(reply[0]), int(reply[1]), int(reply[2])
    if wait_ms == TO_PRICE:
        return ClaimReply(now_ms, 0, to_price=[(i, stored_input(p))
                                               for i, p in zip(reply[3], payloads, strict=True)])
    if len(reply) == 3:  # nothing leased
        return ClaimReply(now_ms, wait_ms)
    head = int(reply[3])  # the rank the batch was chosen against
    # each list opened (''-entry: none readable); attempts empty when no request has failed
    ids, scheds, failures, ahead, n_next = reply[4:9]
    n = len(ids)
    first = n - n_next  # the claim's own batch (and its expired and unreadable), then the next
    claimed = [Claimed.decode(i, p, s, f, *((token, head) if k < first else (token + NEXT_LEASE, 0)))
               for k, (i, p, s, f)
               in enumerate(zip(ids, payloads[:n], scheds, failures or [None] * n, strict=True))]
    priced_ahead = zip(ahead, payloads[n:], strict=True)
    return ClaimReply(now_ms, wait_ms, claimed[:n_expired], claimed[n_expired:],
                      price_ahead=[(i, stored_input(p)) for i, p in priced_ahead if p is not None])
