"""Claiming from a sharded queue (batching/sharded.py): aging holds across shards.

Before each claim the worker reads every shard's head (its most urgent pending rank:
enqueue ms + class delay) in one pipeline, and claims from the shard whose head ranks
lowest (none pending: the shard whose retry is due first, a second read), with a rank
ceiling: the next-lowest head + SHARD_SLACK_MS. lua/claim.lua leases nothing ranked
above it. So a request is never overtaken by one of its class enqueued more than
SHARD_SLACK_MS (plus the head read's round trip) after it, on any shard. One shard with
work: no ceiling, as on a queue of one shard.

Idle, a worker waits for a wake-up token from any shard: on a single Redis (no Cluster)
one BLPOP on every shard's list; on a Cluster one blocked thread per shard
(batching/wake_watch.py). Pickup of a request enqueued into an idle queue: the token's
push, a head read and a claim, as on a queue of one shard.
"""

from __future__ import annotations

import time
from typing import Sequence

from batchery.batching.claim_call import ClaimReply
from batchery.batching.keys import shard_of
from batchery.batching.queue import RequestQueue
from batchery.batching.shard_layout import ShardLayout
from batchery.batching.wake_watch import WakeWatch

# How much later (ms of rank) a request on one shard may be claimed before the head of
# another: the ceiling's slack, so a claim still fills a batch from its own shard (it
# takes about the shard's arrivals in that time; 50 ms starved 6 shards of a few thousand
# requests/s each into batches of 37). Small beside the class delays (5 s, 60 s).
SHARD_SLACK_MS = 250
# A worker on a queue of one shard reads the shard count this often (a claim on more
# reads it with every head read): a new count is served within a second.
LAYOUT_CHECK_S = 1.0


class ShardClaims(ShardLayout):
    """The claim side of ShardedQueue (mixed into it)."""

    _wake: WakeWatch | None = None
    _layout_checked = 0.0
    _last_claim: tuple[str, int] = ("", 0)  # the last claim's token and shard
    _turn = 0  # which of the shards whose heads are near the most urgent claims next

    def _heads(self, shards: Sequence[RequestQueue], zset: str = "pending",
               count: bool = True) -> tuple[list[float | None], int]:
        """Each shard's head score in ``zset`` (pending: rank; delayed: retry ms), None
        where empty, and with ``count`` the shard count shard 0 holds now (else 0): one
        pipeline (split per node on a Cluster)."""
        pipe = self.client.pipeline(transaction=False)
        for q in shards:
            pipe.zrange(getattr(q.keys, zset), 0, 0, withscores=True)
        if count:
            pipe.hget(self.first.keys.settings, "shards")
        replies = pipe.execute()
        heads = [r[0][1] if r else None for r in replies[:len(shards)]]
        return heads, int(replies[-1] or 1) if count else 0

    def claim(self, token: str, max_batch_size: int, max_batch_tokens: int, max_wait_ms: int,
              lookahead: int, price_estimates: bool = False,
              counts: Sequence[tuple[str, int]] = (), ceiling: float | None = None,
              ahead: Sequence[tuple[str, int]] = (), batches: int = 1) -> ClaimReply:
        """RequestQueue.claim on the shard with the most urgent head, under the ceiling
        the other heads set. ``counts`` (a pricing round) go back to their ids' shard;
        ``ahead`` (counts of what an earlier claim priced ahead, ``price_ahead``) go
        with the claim to the shard it picks, those of its ids."""
        shards = self.shards
        if len(shards) == 1:  # one shard: its claim alone, and now and then a look at the count
            if time.monotonic() >= self._layout_checked + LAYOUT_CHECK_S:
                self._layout_checked = time.monotonic()
                self.settings()
            if len(self.shards) == 1:
                return self.first.claim(token, max_batch_size, max_batch_tokens, max_wait_ms,
                                        lookahead, price_estimates, [*counts, *ahead], ceiling,
                                        batches)
            shards = self.shards
        heads, stored = self._heads(shards)
        if stored != len(shards):  # the shard count changed (on an empty queue)
            self._layout(stored)
            shards = self.shards
            heads, _ = self._heads(shards)
        ranked = sorted((rank, i) for i, rank in enumerate(heads) if rank is not None)
        if counts:
            target = shard_of(counts[0][0], len(shards))
        elif ranked:  # the shards whose heads are within the slack take turns, so each is
            # drained at the pace of the others: each shares its classes between its
            # tenants, and the sum does too (one claimed alone ran its heavy tenant dry)
            near = [i for rank, i in ranked if rank <= ranked[0][0] + SHARD_SLACK_MS]
            self._turn += 1
            target = near[self._turn % len(near)]
        else:  # a due retry moves to pending in its claim; else shard 0 says "none"
            due, _ = self._heads(shards, "delayed", count=False)
            retries = sorted((at, i) for i, at in enumerate(due) if at is not None)
            target = retries[0][1] if retries else 0
        if token == self._last_claim[0] and not counts and self._last_claim[1] < len(shards):
            target = self._last_claim[1]  # a claim sent again after its reply was lost:
            # the shard that remembers its token hands back the batch that reply held
        self._last_claim = (token, target)
        others = [rank for rank, i in ranked if i != target]
        if ceiling is None and others:
            ceiling = others[0] + SHARD_SLACK_MS
        counts = [*counts, *(c for c in ahead if shard_of(c[0], len(shards)) == target)]
        return shards[target].claim(token, max_batch_size, max_batch_tokens, max_wait_ms,
                                    lookahead, price_estimates, counts, ceiling, batches)

    def head_rank(self) -> float | None:
        """The rank that outranks a claimed or running request (the worker then gives its
        batch back, or preempts): the most urgent pending head of any shard, plus
        SHARD_SLACK_MS. A claim takes requests up to that much past another shard's head;
        without the slack the batch just claimed would be given back for that head."""
        heads, _ = self._heads(self.shards, count=False)  # a retry in backoff outranks nothing
        head = min((rank for rank in heads if rank is not None), default=None)
        return None if head is None else head + SHARD_SLACK_MS

    def wait_for_work(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for an enqueue's wake-up token from any shard."""
        shards = self.shards
        if len(shards) == 1 or not self.cluster:
            self.client.blpop([q.keys.wake for q in shards], timeout=timeout_s)
            return
        if self._wake is None:
            self._wake = WakeWatch()
        self._wake.wait(shards, timeout_s)

    def stop_waking(self) -> None:
        """End the Cluster wake-up watchers (before the client closes: they read with it)."""
        if self._wake is not None:
            self._wake.close()
