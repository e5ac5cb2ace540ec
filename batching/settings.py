"""Per-queue settings as stored in Redis (the settings hash the Lua scripts read): the
dataclass, its defaults with their reasons, its checks and its codec."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from batchery.errors import ConfigError

# Seconds added to a request's enqueue time to rank it. A request is overtaken only by
# requests of a faster class that arrive within (its delay - their delay) after it.
DEFAULT_CLASS_DELAYS: dict[str, float] = {"realtime": 0.0, "normal": 5.0, "batch": 60.0}
# A priority class name: lowercase, and never a word Lua or Python reads as a number
# (inf, infinity, nan), so a name is never taken for a delay. The Lua side reads only
# digits as a delay (lua/enqueue.lua); everything else is looked up as a class.
# Read with fullmatch, as every name rule is: `$` would let a name end in a newline.
CLASS_NAME = re.compile(r"(?!(?:inf|infinity|nan)\Z)[a-z][a-z0-9_-]{0,31}")

@dataclass(frozen=True)
class QueueSettings:
    """Per-queue settings, stored in Redis so that producers and workers agree."""

    # Refuse enqueue once this many requests are queued: a bound on Redis memory.
    max_pending: int = 1_000_000
    # Seconds added to enqueue time per priority class (see DEFAULT_CLASS_DELAYS).
    class_delays: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_CLASS_DELAYS))
    # Runs of one request (failed or lost with its worker) before it is dead-lettered.
    max_attempts: int = 3
    # A claim not renewed for this long is taken back; heartbeats renew at a third of it.
    lease_seconds: float = 30.0
    # How long results stay readable: long enough for a client that reconnects next day.
    result_ttl: int = 86_400
    # Inputs above this are refused at enqueue: 1 MiB keeps Lua calls and replies short.
    max_request_bytes: int = 1 << 20
    # Tokenizer workers announce (model dir or id), so producers can count exactly.
    tokenizer: str = ""
    # Length the workers' model truncates inputs to (0: none); counts are capped by it.
    max_input_tokens: int = 0
    # Room left in a batch led by a faster class is filled with slower-class requests
    # (throughput); off, it runs with its own class and faster ones only (its latency).
    fill_from_slower: bool = True
    # Enqueue is refused (QueueFull, reason memory) once Redis uses this fraction of its
    # maxmemory: the rest stays free for results, so workers can always commit. 0: off.
    # No effect on a Redis without maxmemory.
    memory_high_water: float = 0.9
    # Seconds a dead letter is kept for `batchery queue dead list|retry` (its dead result at
    # least as long); then the reaper forgets it and its id may be enqueued afresh.
    # A week: an operator back from a weekend still finds last Friday's failures.
    dead_ttl: int = 7 * 86_400
    # A result handed to the client that waited for it (or written to an offline job's
    # output) is deleted from Redis at once; off, it stays for result_ttl.
    delete_delivered: bool = True
    # Workers claim nothing while set (`batchery queue pause`); producers still enqueue.
    paused: bool = False
    # Hash slots the queue is spread over (batching/sharded.py), each with its own Lua
    # scripts' keys: one Redis Cluster node's core no longer caps the queue. 1: one slot.
    # Stored in every shard's settings hash; max_pending holds per shard (ceil of 1/N).
    shards: int = 1
    # Share each class's served tokens between its backlogged tenants by weight
    # (docs/fair-share.md); off, a class is served by age alone (counters still kept).
    fair_share: bool = True
    # Fair share within a class: a tenant's weight; its share of the
    # class's served tokens is its weight over the backlogged tenants' total. Absent: 1.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # Most requests one tenant may hold queued (on a sharded queue, ceil(N / shards) per
    # shard); over it, its enqueues get QueueFull (reason tenant). Absent or 0: no limit.
    tenant_max_pending: dict[str, int] = field(default_factory=dict)
    # Most tokens per second a tenant is served (on a sharded queue, rate / shards per
    # shard); over it, its requests wait, nobody else's. Absent or 0: no limit.
    tenant_token_rates: dict[str, float] = field(default_factory=dict)

    def to_redis(self) -> dict[str, str]:
        """The settings as the flat hash the Lua scripts read."""
        flat = {k: str(int(v) if isinstance(v, bool) else v)  # Lua reads booleans as 1 / 0
                for k, v in asdict(self).items() if k not in _MAPS}
        for name, prefix in _MAPS.items():
            flat.update({prefix + key: str(v) for key, v in getattr(self, name).items()})
        # whether any rate is set: a claim reads the buckets only then (lua/claim.lua)
        flat[RATED] = str(sum(1 for v in self.tenant_token_rates.values() if v > 0))
        return flat

    @classmethod
    def from_redis(cls, flat: Mapping[str, str]) -> "QueueSettings":
        base = cls()
        values: dict[str, Any] = {}
        maps: dict[str, dict[str, Any]] = {"class_delays": dict(base.class_delays),
                                           "tenant_weights": {}, "tenant_max_pending": {},
                                           "tenant_token_rates": {}}
        for key, raw in flat.items():
            name, _, rest = key.partition(":")
            if rest and name + ":" in _MAP_OF:
                field_name = _MAP_OF[name + ":"]
                maps[field_name][rest] = _MAP_TYPES[field_name](raw)
            elif key in _FIELD_TYPES:
                values[key] = _FIELD_TYPES[key](raw)
        return replace(base, **maps, **values)

    def updated(self, **changes: Any) -> "QueueSettings":
        """A copy with changes applied and checked; raises ConfigError naming the bad value."""
        new = replace(self, **changes)
        new.check()
        return new

    def check(self) -> None:
        """Raise ConfigError naming the first setting out of its range (nan and inf too)."""
        for name, (low, high) in LIMITS.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
                raise ConfigError(f"{name} must be a number from {low:g} to {high:g}, got {value!r}")
        for name, delay in self.class_delays.items():
            if not CLASS_NAME.fullmatch(name):
                raise ConfigError(f"priority class {name!r}: use lowercase letters, digits, '-' or "
                                  "'_', starting with a letter (not inf, infinity or nan)")
            if not (math.isfinite(delay) and 0 <= delay <= MAX_CLASS_DELAY_S):
                raise ConfigError(f"class delay for {name!r} must be 0..{MAX_CLASS_DELAY_S} "
                                  f"seconds, got {delay}")
        for name, weight in self.tenant_weights.items():
            if not (isinstance(weight, (int, float)) and math.isfinite(weight)
                    and MIN_TENANT_WEIGHT <= weight <= MAX_TENANT_WEIGHT):
                raise ConfigError(f"tenant weight for {name!r} must be a number from "
                                  f"{MIN_TENANT_WEIGHT:g} to {MAX_TENANT_WEIGHT:g}, got {weight!r}")
        for name, most in self.tenant_max_pending.items():
            if isinstance(most, bool) or not isinstance(most, int) or not 0 <= most <= 1_000_000_000:
                raise ConfigError(f"tenant max pending for {name!r} must be an integer from 0 "
                                  f"(no limit) to 1000000000, got {most!r}")
        for name, rate in self.tenant_token_rates.items():
            if not (isinstance(rate, (int, float)) and math.isfinite(rate)
                    and 0 <= rate <= MAX_TENANT_TOKEN_RATE):
                raise ConfigError(f"tenant token rate for {name!r} must be a number of tokens "
                                  f"per second from 0 (no limit) to {MAX_TENANT_TOKEN_RATE:g}, "
                                  f"got {rate!r}")


MAX_CLASS_DELAY_S = 7 * 86_400  # a class (or an integer priority) waits a week at most: past that, it is a schedule
# A weight's range: counters grow by tokens / weight and stay exact in Lua's doubles.
MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT = 0.01, 1000.0
# A token rate's ceiling: far above any GPU pool's tokens per second, and exact in Lua.
MAX_TENANT_TOKEN_RATE = 1e9
MAX_SHARDS = 256  # more than any cluster's masters need; keeps per-claim head reads small
# Accepted range of each numeric setting. The upper bounds keep every value one Redis
# and Lua can use (an expire of 10**16 s is "invalid expire time" on every commit).
LIMITS: dict[str, tuple[float, float]] = {
    "max_pending": (1, 1_000_000_000),
    "max_attempts": (1, 1000),
    "lease_seconds": (1, 86_400),             # a day: a lease is a heartbeat's grace, not a job's
    "result_ttl": (1, 366 * 86_400),          # a year
    "dead_ttl": (1, 366 * 86_400),
    "max_request_bytes": (64, 512 << 20),     # Redis' bulk string limit
    "max_input_tokens": (0, 10_000_000),
    "memory_high_water": (0, 1),
    "shards": (1, MAX_SHARDS),
}


# The settings that map names to values, each stored as one hash field per name, under
# its prefix: "delay:batch", "tenant_weight:team-a", "tenant_max_pending:team-a".
_MAPS = {"class_delays": "delay:", "tenant_weights": "tenant_weight:",
         "tenant_max_pending": "tenant_max_pending:", "tenant_token_rates": "tenant_token_rate:"}
RATED = "tenant_rates"  # the hash's count of tenants with a token rate (not a setting)
_MAP_OF = {prefix: name for name, prefix in _MAPS.items()}
_MAP_TYPES = {"class_delays": float, "tenant_weights": float, "tenant_max_pending": int,
              "tenant_token_rates": float}
_PARSERS = {"int": int, "float": float, "str": str, "bool": lambda raw: raw != "0"}
_FIELD_TYPES = {f.name: _PARSERS[str(f.type)]
                for f in fields(QueueSettings) if f.name not in _MAPS}


# What a script falls back to where the queue's settings hash lacks a value.
DEFAULTS = QueueSettings()
