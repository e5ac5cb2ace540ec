"""The worker side of ShardedQueue, beside claiming (shard_claim.py): commit, fail,
release and renew per shard, the reaper over every shard, the worker registry and
reports on shard 0."""

from __future__ import annotations

from typing import Any, Sequence

from batchery.batching.calls import Failed, Reaped
from batchery.batching.queue import RequestQueue
from batchery.batching.settings import QueueSettings
from batchery.batching.shard_layout import ShardLayout, first_field, grouped


class WorkerCalls(ShardLayout):
    """What workers call besides claims (mixed into ShardedQueue)."""

    def announce_tokenizer(self, tokenizer: str, max_input_tokens: int) -> QueueSettings:
        settings = self.first.announce_tokenizer(tokenizer, max_input_tokens)
        for q in self.shards[1:]:
            q.write_settings(settings, only=("tokenizer", "max_input_tokens"))
        return settings

    def complete(self, items: Sequence[tuple[str, str, str | bytes]], totals: dict[str, int],
                 clients: Sequence[str] | None = None) -> list[bool]:
        """Commit per shard; the batch totals are counted once, on the first."""
        clients = self.clients([i[0] for i in items]) if clients is None else clients
        first = [totals]

        def commit(q: RequestQueue, part: list[Any]) -> list[bool]:
            once = first.pop() if first else {}
            return q.complete([p[0] for p in part], once, [p[1] for p in part])
        return self._routed(list(zip(items, clients)), commit, lambda pair: pair[0][0])

    def fail(self, items: Sequence[tuple[str, str, str | bytes]],
             clients: Sequence[str] | None = None) -> list[Failed]:
        clients = self.clients([i[0] for i in items]) if clients is None else clients
        return self._routed(list(zip(items, clients)),
                            lambda q, part: q.fail([p[0] for p in part], [p[1] for p in part]),
                            lambda pair: pair[0][0])

    def release(self, leases: Sequence[tuple[str, str]]) -> int:
        return sum(self._per_shard(leases, RequestQueue.release, first_field))

    def renew(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        """Renew on shard 0 always (the worker registry) and on the shards holding leases."""
        shards = self.shards
        groups = grouped([lease[0] for lease in leases], len(shards))
        groups.setdefault(0, [])
        return [lost for i, positions in groups.items()
                for lost in shards[i].renew(worker_id, [leases[p] for p in positions])]

    def holders(self, leases: Sequence[tuple[str, str]]) -> list[str | None]:
        return self._routed(leases, RequestQueue.holders, first_field)

    def traces(self, ids: Sequence[str]) -> list[str | None]:
        return self._routed(ids, RequestQueue.traces)

    def inputs(self, ids: Sequence[str]) -> list[Any]:
        return self._routed(ids, RequestQueue.inputs)

    def attach_output(self, request_id: str, token: str, output: Any) -> bool:
        return self.shard(request_id).attach_output(request_id, token, output)

    def reap(self, limit: int = 1000) -> Reaped:
        reaped = Reaped()
        for q in self.shards:
            one = q.reap(limit)
            reaped.requeued += one.requeued
            reaped.dead += one.dead
        return reaped

    def take_reaper_turn(self, worker_id: str, ms: int) -> bool:
        return self.first.take_reaper_turn(worker_id, ms)

    def forget_workers(self, older_than_s: float) -> int:
        """Forget silent workers on every shard (renew registers them where they hold
        leases); the live count is shard 0's, where every worker beats."""
        for q in self.shards[1:]:
            q.forget_workers(older_than_s)
        return self.first.forget_workers(older_than_s)

    def live_workers(self, forget_ms: int = 0) -> int:
        return self.first.live_workers(forget_ms)

    def leave(self, worker_id: str) -> None:
        for q in self.shards:
            q.leave(worker_id)

    def publish_worker(self, worker_id: str, info: dict[str, Any], lease_seconds: float) -> None:
        self.first.publish_worker(worker_id, info, lease_seconds)

    def worker_reports(self) -> tuple[int, list[dict[str, Any]]]:
        return self.first.worker_reports()
