"""A claimed request on a generate worker, as its Sequence's ``key``: the claim, this
host's view of its clock (deadline, start), and its rank in the queue."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from batchery.batching.messages import Claimed


@dataclass(eq=False)
class Slot:
    request: Claimed
    claimed_ms: int        # Redis clock at claim
    deadline: float | None  # time.monotonic() past which it stops (finish_reason deadline)
    started: float = 0.0   # time.perf_counter() at prefill (the engine loop: at add)

    @classmethod
    def claimed(cls, request: Claimed, now_ms: int) -> "Slot":
        """The request as claimed at ``now_ms`` (Redis clock): its deadline moved onto
        this host's monotonic clock."""
        deadline = (time.monotonic() + (request.expire_ms - now_ms) / 1000
                    if request.expire_ms else None)
        return cls(request, now_ms, deadline)


def rank(s: Any) -> int:
    """A sequence's rank in the queue (enqueue ms + class delay ms): lower is more urgent."""
    return int(s.key.request.rank)
