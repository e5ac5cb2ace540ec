"""The operator side of ShardedQueue: settings changed on every shard (a new shard
count only while the queue is empty), stats, depth and tenants summed over the shards,
dead letters listed, retried and purged."""

from __future__ import annotations

from typing import Any, Sequence

from batchery.batching.inspection import (DEAD_SHOWN, OLDEST_LOOKAHEAD, dead_results, merge_loads,
                                          top_tenants)
from batchery.batching.messages import Result
from batchery.batching.queue import RequestQueue
from batchery.batching.settings import QueueSettings
from batchery.batching.shard_layout import ShardLayout
from batchery.batching.keys import shard_tags
from batchery.errors import ConfigError


class OperatorCalls(ShardLayout):
    """What operators and dashboards call (mixed into ShardedQueue)."""

    def update_settings(self, **changes: Any) -> QueueSettings:
        """Write the changed settings to every shard. A new shard count is refused unless
        the queue is empty on every shard; then the retired shards get it too, so a
        producer still routing by the old count is refused there and routes again."""
        current = self.settings()
        new = current.updated(**changes)
        old_tags = self.tags()
        if new.shards != current.shards:
            self._check_empty(new.shards)
        new_tags = shard_tags(self.name, new.shards)
        # retired shards first (a stale producer is refused there), shard 0 last (it is
        # where producers read the count from)
        tags = [*(t for t in old_tags if t not in new_tags), *new_tags[::-1]]
        for tag in tags:
            self._shard_at(tag).write_settings(new)
        self._layout(new.shards)
        if new.shards != current.shards and not self._empty(old_tags):
            for tag in tags:  # an enqueue slipped in as the layout changed: undo
                self._shard_at(tag).write_settings(current)
            self._layout(current.shards)
            raise ConfigError(f"queue {self.name!r}: requests arrived while its shard count "
                              "changed, so it was left unchanged; try again once it is empty")
        return new

    def _held(self, tags: Sequence[str]) -> dict[str, int]:
        """What the shards ``tags`` hold together: pending, delayed, in flight, dead."""
        held: dict[str, int] = {}
        for tag in tags:
            for name, count in self._shard_at(tag).held().items():
                held[name] = held.get(name, 0) + count
        return held

    def _empty(self, tags: Sequence[str]) -> bool:
        return not any(self._held(tags).values())

    def _check_empty(self, shards: int) -> None:
        held = self._held(self.tags())
        if any(held.values()):
            what = ", ".join(f"{n} {name}" for name, n in held.items() if n)
            raise ConfigError(
                f"queue {self.name!r} cannot go from {self.n} to {shards} shard(s) while it "
                f"holds requests ({what}): stop its producers, let the workers drain it, "
                f"retry or purge its dead letters (`batchery queue dead retry|purge --all -q "
                f"{self.name}`), then change it")

    def depth(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for q in self.shards:
            for c, n in q.depth().items():
                total[c] = total.get(c, 0) + n
        return total

    def top_tenants(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """The most loaded tenants over every shard, and the rest summed (top_tenants)."""
        return top_tenants(merge_loads(*(q.tenant_loads() for q in self.shards)))

    def oldest(self, classes: Sequence[str], limit: int = OLDEST_LOOKAHEAD) -> tuple[int, int, dict[str, int]]:
        now, looked, oldest = 0, 0, {}
        for q in self.shards:
            at, n, found = q.oldest(classes, limit)
            now, looked = max(now, at), looked + n
            for c, ms in found.items():
                oldest[c] = min(ms, oldest.get(c, ms))
        return now, looked, oldest

    def stats(self) -> dict[str, Any]:
        """RequestQueue.stats summed over the shards (paused and workers: shard 0's),
        and ``shards``."""
        merged = self.first.stats()
        for q in self.shards[1:]:
            s = q.stats(workers=False)
            for name in ("pending", "delayed", "inflight", "dead"):
                merged[name] += s[name]
            for group in ("pending_by_priority", "totals"):
                for k, v in s[group].items():
                    merged[group][k] = merged[group].get(k, 0) + v
        if self.n > 1:
            merged["tenants"], merged["tenants_other"] = self.top_tenants()
        merged["pending_by_priority"] = dict(sorted(merged["pending_by_priority"].items()))
        merged["totals"] = dict(sorted(merged["totals"].items()))
        return {**merged, "shards": self.n}

    @staticmethod
    def known_queues(client: Any) -> list[str]:
        return RequestQueue.known_queues(client)

    def dead(self, limit: int = DEAD_SHOWN) -> list[Result]:
        """Dead letters of every shard, newest first."""
        entries = sorted((e for q in self.shards for e in q.dead_entries(limit)),
                         key=lambda e: -e[1])[:limit]
        ids = [i for i, _ in entries]
        return dead_results(ids, self.results(ids))

    def revive(self, ids: Sequence[str] = (), everything: bool = False) -> int:
        if everything:
            return sum(q.revive(everything=True) for q in self.shards)
        return sum(self._per_shard(ids, RequestQueue.revive))

    def purge(self, ids: Sequence[str] = (), everything: bool = False) -> int:
        if everything:
            return sum(q.purge(everything=True) for q in self.shards)
        return sum(self._per_shard(ids, RequestQueue.purge))
