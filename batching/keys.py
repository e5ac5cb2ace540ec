"""Every Redis key batchery uses, in one place.

All keys of one queue shard carry one hash tag so that each Lua script touches a single
slot and the same code runs on Redis Cluster. Shard 0 of queue Q is tagged ``{Q}`` (a
queue of one shard is that alone); shard i of N is tagged ``{Q~i}`` or a salted
``{Q~i.S}`` placed in its own one of N equal slot ranges (see ``shard_tags``). No key
string literals elsewhere.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from functools import cached_property, lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from batchery.errors import ConfigError

PREFIX = "batchery"
QUEUES = f"{PREFIX}:queues"  # SET of queue names, for `batchery queue stats` (no tag: read alone)
QUEUE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # (fullmatch: no name ending in "\n")


def check_queue_name(name: str) -> str:
    if not QUEUE_NAME.fullmatch(name or ""):
        raise ConfigError(
            f"queue name {name!r} is not valid: use 1-64 letters, digits, '.', '_' or '-'")
    return name


# vtc's field holding the queue's sub-queue mode: "listed", "sole\tTENANT" or
# "listing\tRANK" (none: listed when `fair` holds anything); lua/_common.lua FAIR_MODE
FAIR_MODE_FIELD = "\tmode"
SHARD_MARK = "~"  # never in a queue name (QUEUE_NAME), so a shard's tag is no queue's


def tag_slot(tag: str) -> int:
    """The Redis Cluster hash slot of every key tagged ``{tag}``."""
    return key_slot(f"{{{tag}}}".encode())


@lru_cache(maxsize=256)
def shard_tags(queue: str, shards: int) -> tuple[str, ...]:
    """The hash tags of a queue's ``shards`` shards. Shard 0 is the queue name itself.

    Cut the slots into ``shards`` equal ranges from slot 0; shard 0 sits in the range of
    the queue's own slot, r. Shard i is the first of ``Q~i``, ``Q~i.1``, ``Q~i.2``... whose
    slot lies in the middle half of range (r + i) mod ``shards``. Masters that own equal
    contiguous ranges from slot 0 (`redis-cli --cluster create`'s layout) so get an equal
    share: N = k x masters shards land k on each master (the middle half keeps clear of
    where a master's range may end a slot off the equal cut)."""
    home = tag_slot(queue) * shards // REDIS_CLUSTER_HASH_SLOTS
    tags = [queue]
    for i in range(1, shards):
        wanted, salt = (home + i) % shards, 0
        while True:
            tag = f"{queue}{SHARD_MARK}{i}" + (f".{salt}" if salt else "")
            place = tag_slot(tag) * shards  # range = place // 16384, where in it = the rest
            if (place // REDIS_CLUSTER_HASH_SLOTS == wanted
                    and 0.25 <= place % REDIS_CLUSTER_HASH_SLOTS / REDIS_CLUSTER_HASH_SLOTS < 0.75):
                break
            salt += 1
        tags.append(tag)
    return tuple(tags)


def shard_of(request_id: str, shards: int) -> int:
    """The shard (index into ``shard_tags``) that holds ``request_id``: CRC32 of the id
    mod the shard count, so every enqueue of an id meets the first one."""
    return zlib.crc32(request_id.encode()) % shards if shards > 1 else 0


def queued_keys(queue: str, shards: int) -> list[str]:
    """Every sorted set holding a queue's queued requests: pending and delayed of each shard,
    shard 0 first. Their ZCARDs add up to the queue's queued requests (what
    ``batchery queue stats`` calls pending): what autoscaling reads (batchery/keda.py)."""
    return [key for tag in shard_tags(queue, shards) for key in (Keys(tag).pending, Keys(tag).delayed)]


@dataclass(frozen=True)
class Keys:
    tag: str  # the hash tag of one queue shard: the queue name for shard 0

    def _key(self, name: str) -> str:
        return f"{PREFIX}:{{{self.tag}}}:{name}"

    @property
    def pending(self) -> str:
        """ZSET id -> rank (enqueue ms + class delay ms): what runs next, lowest first."""
        return self._key("pending")

    @property
    def delayed(self) -> str:
        """ZSET id -> ms when a failed request may run again (retry backoff)."""
        return self._key("delayed")

    @property
    def requests(self) -> str:
        """HASH id -> request JSON (input, priority, meta): written once, read by the claimer."""
        return self._key("requests")

    @property
    def sched(self) -> str:
        """HASH id -> "tokens:expire_ms:enqueued_ms:rank:class:client:tenant": what claims
        decide on (entries written before tenants end at client: tenant "default")."""
        return self._key("sched")

    @property
    def fair(self) -> str:
        """ZSET, every score 0, of "class\ttenant\trank\tid" (rank zero-padded to 15
        digits): the sub-queue of each (class, tenant) in rank order, read by lex range
        (batching/lua/_common.lua fair_*; docs/fair-share.md)."""
        return self._key("fair")

    @property
    def fair_tenants(self) -> str:
        """ZSET, every score 0, of "class\tcounter\ttenant" (counter zero-padded): the
        backlogged tenants of each class, least served first."""
        return self._key("fair_tenants")

    @property
    def vtc(self) -> str:
        """HASH "class\ttenant" -> virtual token counter (tokens served / weight);
        "class\t" -> the class's floor, the counter a tenant back from idle starts at;
        FAIR_MODE_FIELD -> whether the queue keeps its sub-queues (docs/fair-share.md)."""
        return self._key("vtc")

    @property
    def served(self) -> str:
        """HASH tenant -> tokens served (claimed), for `batchery queue stats`."""
        return self._key("served")

    @property
    def rates(self) -> str:
        """HASH tenant -> "level:ms": the token bucket of each tenant with a token rate
        (settings tenant_token_rates), its level at that ms on the Redis clock."""
        return self._key("rates")

    @property
    def plan(self) -> str:
        """STRING the next batches one claim chose from the lookahead it read, for the next
        claims to take in turn ("shape:mark\\nid\\tid...\\nid\\tid...": batching/lua/claim.lua),
        kept for the lease time; '' or the first line alone when there are none."""
        return self._key("plan")

    @property
    def attempts(self) -> str:
        """HASH id -> runs that failed or were lost (absent means none)."""
        return self._key("attempts")

    @property
    def history(self) -> str:
        """HASH id -> JSON list of how its failed runs ended, oldest first: {"type",
        "message"} each (message clipped), at most max_attempts; for its dead letter."""
        return self._key("history")

    @property
    def lease_expiry(self) -> str:
        """ZSET lease token -> ms its lease expires: one entry per claim that leased
        requests, until they are all committed, failed, released, cancelled or reaped."""
        return self._key("lease_expiry")

    @property
    def lease_ids(self) -> str:
        """HASH lease token -> the ids its claim still holds, newline-separated, in the
        claim's order (ids hold no control character): a request is held by a claim
        exactly while it is in that claim's lease (lua/_common.lua lease_read)."""
        return self._key("lease_ids")

    @property
    def leased(self) -> str:
        """ZSET id -> lease expiry ms, one entry per request: the leases of versions before
        per-claim leases (``lease_expiry``), which the reaper still takes back."""
        return self._key("leased")

    @property
    def owner(self) -> str:
        """HASH id -> lease token, one entry per request: the lease holders of versions
        before per-claim leases (``lease_ids``), which the reaper still clears."""
        return self._key("owner")

    @property
    def dead(self) -> str:
        """ZSET id -> ms it was dead-lettered; its request stays in `requests` for retry."""
        return self._key("dead")

    @property
    def depth(self) -> str:
        """HASH priority class -> queued requests (pending + delayed) of that class."""
        return self._key("depth")

    @property
    def stats(self) -> str:
        """HASH of running totals: requests/batches/tokens/padded_tokens and per status."""
        return self._key("stats")

    @property
    def settings(self) -> str:
        """HASH of QueueSettings.to_redis()."""
        return self._key("settings")

    @property
    def workers(self) -> str:
        """ZSET worker id -> last heartbeat ms."""
        return self._key("workers")

    def worker(self, worker_id: str) -> str:
        """HASH of what one worker reports at each heartbeat (model, device, batch counts)
        for `batchery dashboard`; it expires once the worker stops beating."""
        return self._key(f"worker:{worker_id}")

    @property
    def wake(self) -> str:
        """LIST idle workers block on; enqueue pushes a token to wake one."""
        return self._key("wake")

    @property
    def reaper_lock(self) -> str:
        return self._key("reaper")

    def claim(self, token: str) -> str:
        """STRING "wait\\nhead rank\\nexpired\\nunreadable\\nnext\\nid..." (lua/claim.lua): the ids
        one claim leased (the last ``next`` under its next batch's lease), kept for the
        lease time so that a retried claim (its reply lost) returns them again."""
        return self._key("claim:" + token)

    def call(self, call_id: str) -> str:
        """STRING the reply of one enqueue or fail call (integers, comma-separated), kept
        60 s so that the call retried after a lost reply gets its first run's reply."""
        return self._key("call:" + call_id)

    @property
    def cancelled_prefix(self) -> str:
        """Prefix of the per-request STRING lease token a cancel found running (60 s TTL):
        that worker may attach its partial output to the cancelled result (lua/attach.lua)."""
        return self._key("cancelled:")

    def cancelled(self, request_id: str) -> str:
        return self.cancelled_prefix + request_id

    @cached_property  # read once per request by enqueue and result deletion
    def result_prefix(self) -> str:
        """Prefix of the per-request result keys (STRING JSON with a TTL)."""
        return self._key("result:")

    def result(self, request_id: str) -> str:
        return self.result_prefix + request_id

    @property
    def reply_prefix(self) -> str:
        """Prefix of the per-client reply lists that workers push results onto."""
        return self._key("reply:")

    def reply(self, client_id: str) -> str:
        return self.reply_prefix + client_id

    # A client's reader, on each shard it reads: the keys below sit beside its reply list
    # (lua/_common.lua reader_keys makes the reader's and the bell's from the list's
    # prefix: "reply:" -> "reader:", "bell:").
    @property
    def reader_prefix(self) -> str:
        """Prefix of the per-client STRING its reader sets at each read, for
        reply_lists.READER_LIVE_MS: "1" when the reader's owner deletes what it delivers (a
        commit then pushes the client's results onto its list alone, not under their keys
        too: lua/complete.lua), "0" when not; while set, a push rings the bell."""
        return self._key("reader:")

    def reader(self, client_id: str) -> str:
        return self.reader_prefix + client_id

    def bell(self, client_id: str) -> str:
        """LIST of at most one entry, pushed with results while the client's reader is
        set: the reader blocks on its bells, not on its lists, so that no result is taken
        off a list in a reply that may be lost (reply_lists.reply_read)."""
        return self._key("bell:") + client_id

    def inbox(self, client_id: str, parity: int) -> str:
        """LIST a reader's read moves its reply list to (RENAMENX) and reads; deleted by
        its next read, once what it held was delivered. Two, by the reads' parity: a read
        retried after a lost reply finds its own still there."""
        return self._key(f"inbox:{parity}:") + client_id

    @property
    def readers(self) -> str:
        """SET of the clients whose readers read here: where the reaper looks for one that
        stopped, to keep what its lists hold under the result keys (lua/drain.lua)."""
        return self._key("readers")

    def stream(self, request_id: str) -> str:
        """STREAM of a generation's events (start, tokens, end), trimmed and expiring:
        see batching/streams.py."""
        return self._key("stream:") + request_id
