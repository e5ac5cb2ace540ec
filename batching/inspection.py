"""What a queue shard holds, read for people and dashboards: worker reports, the oldest
request per class, stored inputs, dead letters (list, retry, purge) and stats.

``QueueInspection`` is part of RequestQueue (batching/queue.py), kept apart so that the
protocol of producers and workers reads on its own.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from batchery.batching.calls import (oldest_call, parse_oldest, purge_call, revive_call,
                                     sched_tenant)
from batchery.batching.keys import QUEUES, Keys
from batchery.batching.messages import Result, stored_input
from batchery.batching.scripts import Scripts
from batchery.batching.settings import DEFAULTS

# the error `dead list` shows for a dead letter whose dead result was deleted
RESULT_GONE = {"type": "ResultGone", "message": "its dead result (with the error) was deleted: "
               "written to an offline job's output (see its errors there) or expired; "
               "`batchery queue dead retry ID` runs it again"}
REVIVE_CHUNK = 1000           # ids per call where the caller lists many (revive --all)
# A worker's report outlives its last heartbeat by this many leases: one that died shows
# as stale on the dashboard for a while (5 minutes at the default lease), then vanishes.
WORKER_INFO_LEASES = 10
OLDEST_LOOKAHEAD = 5000       # most pending requests the dashboard's aging read walks
# Tenants `queue stats` names, the most loaded first; the rest are summed as one "other":
# a million job ids as tenants do not make a million lines (or metric series).
TENANTS_SHOWN = 10
DEAD_SHOWN = 100              # dead letters listed at once, newest first: a screenful or two
TENANT_DEPTH = "tenant:"      # depth hash fields counting a tenant's queued requests (lua/_common.lua)
# Tenants the served-tokens hash names at most (lua/fold.lua, run by the reaper): past it
# the idle ones served least are summed as folded, down to half. Far above TENANTS_SHOWN,
# so the most served stay by name; small enough to read whole in a few ms.
SERVED_KEPT = 1000
# The served hash's fields summing the folded tenants (a tab starts no tenant's name)
FOLDED_TOKENS, FOLDED_TENANTS = "\tfolded_tokens", "\tfolded_tenants"
FOLDED = "\tfolded"          # the loads' entry of the folded tenants (tenants: how many)
INFLIGHT_CHUNK = 1000         # leased ids per HMGET when counting in-flight per tenant
LOAD = ("pending", "inflight", "served_tokens")


def top_tenants(loads: dict[str, dict[str, int]], most: int = TENANTS_SHOWN
                ) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """The ``most`` tenants with the most queued requests (then in flight, then the most
    tokens served), and the rest summed with the folded ones: {"tenants": how many,
    "pending", "inflight", "served_tokens"}."""
    loads = dict(loads)
    folded = loads.pop(FOLDED, {})
    ranked = sorted(loads.items(), key=lambda kv: (-kv[1]["pending"], -kv[1]["inflight"],
                                                   -kv[1]["served_tokens"], kv[0]))
    rest = ranked[most:]
    other = {"tenants": len(rest) + folded.get("tenants", 0),
             **{k: sum(v[k] for _, v in rest) + folded.get(k, 0) for k in LOAD}}
    return dict(ranked[:most]), other


def merge_loads(*loads: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per-tenant loads of several shards, summed."""
    total: dict[str, dict[str, int]] = {}
    for shard in loads:
        for tenant, load in shard.items():
            into = total.setdefault(tenant, {})
            for k, v in load.items():
                into[k] = into.get(k, 0) + v
    return total


def dead_results(ids: Sequence[str], results: Sequence[Result | None]) -> list[Result]:
    """Each dead letter's result; RESULT_GONE where it was deleted."""
    return [r or Result(id=i, status="dead", error=RESULT_GONE) for i, r in zip(ids, results)]


def held_count(leases: Iterable[str]) -> int:
    """How many requests the leases' texts (newline-separated ids each) hold."""
    return sum(text.count("\n") + 1 for text in leases if text)


class QueueInspection:
    """RequestQueue's reads and dead-letter handling for operators."""

    client: Any
    keys: Keys
    scripts: Scripts

    def results(self, ids: Sequence[str]) -> list[Result | None]:
        raise NotImplementedError

    def live_workers(self, forget_ms: int = 0) -> int:
        raise NotImplementedError

    def publish_worker(self, worker_id: str, info: dict[str, Any], lease_seconds: float) -> None:
        """Store what a worker reports at its heartbeat (model, device, counts) for the
        dashboard, kept WORKER_INFO_LEASES leases past its last beat."""
        key = self.keys.worker(worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping={k: str(v) for k, v in info.items()})
        pipe.expire(key, max(1, int(WORKER_INFO_LEASES * lease_seconds)))
        pipe.execute()

    def worker_reports(self) -> tuple[int, list[dict[str, Any]]]:
        """(now on the Redis clock in ms, workers): each registered worker with its last
        heartbeat ``seen_ms``, ``live`` (beat within a lease, as `stats` counts) and its
        report; those stale past their report's expiry are left out."""
        seconds, micros = self.client.time()
        now = seconds * 1000 + micros // 1000
        lease_s = self.client.hget(self.keys.settings, "lease_seconds")
        live_after = now - 1000 * float(lease_s or DEFAULTS.lease_seconds)
        registered = self.client.zrange(self.keys.workers, 0, -1, withscores=True)
        pipe = self.client.pipeline(transaction=False)
        for worker_id, _ in registered:
            pipe.hgetall(self.keys.worker(worker_id))
        found = []
        for (worker_id, seen), info in zip(registered, pipe.execute() if registered else []):
            live = seen >= live_after
            if live or info:
                found.append({**info, "id": worker_id, "seen_ms": int(seen), "live": live})
        return now, found

    def oldest(self, classes: Sequence[str], limit: int = OLDEST_LOOKAHEAD) -> tuple[int, int, dict[str, int]]:
        """(now ms, requests looked at, class -> enqueue ms of its oldest pending request)
        for the classes found among the ``limit`` most urgent (see lua/oldest.lua)."""
        call = oldest_call(self.keys, classes, limit)
        return parse_oldest(self.scripts.oldest(call.keys, call.args))

    def inputs(self, ids: Sequence[str]) -> list[Any]:
        """The stored input of each request (None where it is gone): `--show-payloads`."""
        if not ids:
            return []
        raws = self.client.hmget(self.keys.requests, list(ids))
        return [stored_input(r) for r in raws]

    # -- dead letters ------------------------------------------------------------------
    def dead_entries(self, limit: int = DEAD_SHOWN) -> list[tuple[str, float]]:
        """(id, ms it was dead-lettered) of the newest ``limit`` dead letters."""
        return self.client.zrevrange(self.keys.dead, 0, limit - 1, withscores=True)

    def dead(self, limit: int = DEAD_SHOWN) -> list[Result]:
        """Dead-lettered requests, newest first, with their last error."""
        ids = [i for i, _ in self.dead_entries(limit)]
        return dead_results(ids, self.results(ids))

    def revive(self, ids: Sequence[str] = (), everything: bool = False) -> int:
        """Send the dead requests ``ids`` (``everything``: all of them) back to the queue."""
        k = self.keys
        ids = self.client.zrange(k.dead, 0, -1) if everything else list(ids)
        revived = 0
        for start in range(0, len(ids), REVIVE_CHUNK):  # each call declares its ids' result keys
            chunk = ids[start:start + REVIVE_CHUNK]
            call = revive_call(k, chunk)
            revived += int(self.scripts.revive(call.keys, call.args))
        return revived

    def purge(self, ids: Sequence[str] = (), everything: bool = False) -> int:
        """Forget the dead requests ``ids`` (``everything``: all of them) for good."""
        call = purge_call(self.keys, ids, everything)
        return int(self.scripts.purge(call.keys, call.args))

    # -- observation -------------------------------------------------------------------
    def held(self) -> dict[str, int]:
        """What this shard holds: pending, delayed, in flight, dead (one round trip)."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(k.pending)
        pipe.zcard(k.delayed)
        pipe.hgetall(k.lease_ids)
        pipe.zcard(k.dead)
        pending, delayed, leases, dead = pipe.execute()
        return {"pending": pending, "delayed": delayed, "inflight": held_count(leases.values()),
                "dead": dead}

    def stats(self, workers: bool = True) -> dict[str, Any]:
        """Depth by class, in flight, dead letters, live workers (``workers``: counted)
        and running totals."""
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(k.pending)
        pipe.zcard(k.delayed)
        pipe.hgetall(k.depth)
        pipe.hgetall(k.lease_ids)
        pipe.zcard(k.dead)
        pipe.hgetall(k.stats)
        pipe.hget(k.settings, "paused")
        pending, delayed, depth, leases, dead, totals, paused = pipe.execute()
        tenants, other = top_tenants(self.tenant_loads(depth, leases))
        return {"pending": pending + delayed, "delayed": delayed,  # retries waiting out backoff
                "tenants": tenants, "tenants_other": other,
                "pending_by_priority": {c: int(n) for c, n in sorted(depth.items())
                                        if int(n) and ":" not in c},
                "inflight": held_count(leases.values()), "dead": dead,
                "paused": paused not in (None, "0"),
                "workers": self.live_workers() if workers else 0,
                "totals": {name: int(n) for name, n in sorted(totals.items())}}

    def tenant_loads(self, depth: dict[str, str] | None = None,
                     leases: dict[str, str] | None = None) -> dict[str, dict[str, int]]:
        """Each tenant's queued requests (pending + delayed), requests in flight and tokens
        served (claimed), for those with any; the folded tenants (lua/fold.lua) summed
        under FOLDED. ``depth``, ``leases``: the depth and lease_ids hashes, when read
        already."""
        if depth is None:
            depth = self.client.hgetall(self.keys.depth)
        loads: dict[str, dict[str, int]] = {}

        def load(tenant: str) -> dict[str, int]:
            return loads.setdefault(tenant, dict.fromkeys(LOAD, 0))
        for field, n in depth.items():
            if field.startswith(TENANT_DEPTH) and int(n) > 0:
                load(field[len(TENANT_DEPTH):])["pending"] = int(n)
        for tenant, n in self.tenant_inflight(leases).items():
            load(tenant)["inflight"] = n
        folded = dict.fromkeys(LOAD, 0)
        for tenant, tokens in self.client.hscan_iter(self.keys.served, count=1000):
            if tenant == FOLDED_TOKENS:
                folded["served_tokens"] = int(tokens)
            elif tenant == FOLDED_TENANTS:
                folded["tenants"] = int(tokens)
            else:
                load(tenant)["served_tokens"] = int(tokens)
        if folded.get("tenants"):
            loads[FOLDED] = folded
        return loads

    def tenant_inflight(self, leases: dict[str, str] | None = None) -> dict[str, int]:
        """Requests in flight (leased) per tenant: O(in flight), which the workers' batch
        sizes bound, read from the leases (``leases``: the lease_ids hash, when read
        already) and their sched entries."""
        if leases is None:
            leases = self.client.hgetall(self.keys.lease_ids)
        ids = [i for text in leases.values() for i in text.split("\n")]
        counts: dict[str, int] = {}
        for start in range(0, len(ids), INFLIGHT_CHUNK):
            for raw in self.client.hmget(self.keys.sched, ids[start:start + INFLIGHT_CHUNK]):
                if raw:
                    tenant = sched_tenant(raw)
                    counts[tenant] = counts.get(tenant, 0) + 1
        return counts

    def leases(self) -> dict[str, list[str]]:
        """Each claim's lease token -> the ids it holds, in its order (one lease per
        claim: lua/_common.lua lease_read)."""
        return {token: ids.split("\n") for token, ids in self.client.hgetall(self.keys.lease_ids).items()}

    @staticmethod
    def known_queues(client: Any) -> list[str]:
        """Every queue registered on this Redis, sorted (what `batchery queue stats` lists)."""
        return sorted(client.smembers(QUEUES))
