"""Batch formation: priority with aging, size and padded-token budgets, dynamic wait.

This is the scheduling rule as a pure function. ``lua/claim.lua`` implements the same
rule inside Redis; ``tests/test_policy.py`` checks that both choose the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def rank(enqueued_ms: int, class_delay_ms: int) -> int:
    """The score of a pending request: lowest runs first.

    A request of class delay d ranks as if it had arrived d ms later. So a request is
    overtaken only by requests of faster classes that arrive within the difference of
    the delays after it: no class starves under any load, and a ``batch`` request waits
    at most its delay plus the work ranked ahead of it.
    """
    return enqueued_ms + class_delay_ms


@dataclass(frozen=True)
class Candidate:
    """A pending request as the claim sees it, in rank order."""

    id: str
    tokens: int          # cost in tokens; a batch costs (longest x size) padded tokens
    enqueued_ms: int     # when it was accepted (Redis clock)
    expire_ms: int = 0   # deadline on the Redis clock; 0 means none
    rank: int = 0        # its score (enqueued_ms + class delay ms); see rank()

    @property
    def delay_ms(self) -> int:
        """Its class delay: the lower, the more urgent its class."""
        return self.rank - self.enqueued_ms


@dataclass(frozen=True)
class Selection:
    batch: list[str] = field(default_factory=list)    # ids to run, most urgent first
    expired: list[str] = field(default_factory=list)  # ids past their deadline: never run
    wait_ms: int = 0  # > 0: the batch is not full and its head may wait this much longer
    full: bool = False  # it reached the size, a candidate did not fit, or slower ones were left


def padded_tokens(token_counts: list[int]) -> int:
    """What a batch costs once padded to its longest request."""
    return max(token_counts) * len(token_counts) if token_counts else 0


def settled_by(candidates: list[Candidate], now_ms: int, max_batch_size: int) -> bool:
    """Whether the first ``max_batch_size`` of the rank-ordered lookahead decide the batch
    alone, so that the claim reads no further (``lua/claim.lua``): all of them live, as
    long as the head and of a class no slower than its. A later candidate is then never
    closer in length to the head than they are, nor earlier in rank, so
    :func:`select_batch` chooses among them only. ``candidates``: the first ones as read
    (an orphan, pending without state, is None)."""
    first = candidates[:max_batch_size]
    if len(first) < max_batch_size or any(c is None or 0 < c.expire_ms <= now_ms for c in first):
        return False
    head = first[0]
    return all(c.tokens == head.tokens and c.delay_ms <= head.delay_ms for c in first)


def select_batch(candidates: list[Candidate], now_ms: int, max_batch_size: int,
                 max_batch_tokens: int, max_wait_ms: int, fill_from_slower: bool = True
                 ) -> Selection:
    """Choose the next batch from the lookahead ``candidates`` (in rank order).

    The head (most urgent live candidate) is always in the batch, even alone over the
    token budget. Then the candidates of a class as urgent as the head's (class delay no
    larger) join, then (unless ``fill_from_slower`` is off) the others, each group in
    order of how close their length is to the head's (ties: rank), while the batch stays
    within ``max_batch_size`` requests and ``max_batch_tokens`` padded tokens. A batch is
    full when it reached the size, a candidate did not fit, or slower candidates were
    left out; a batch that is not full is held until its head has waited ``max_wait_ms``.
    """
    expired = [c.id for c in candidates if 0 < c.expire_ms <= now_ms]
    live = [c for c in candidates if not 0 < c.expire_ms <= now_ms]
    if not live:
        return Selection(expired=expired)
    head = live[0]
    chosen, longest = [0], head.tokens
    # Less urgent classes only fill what room is left: otherwise a realtime head could take
    # batch-class requests of a fitting length while the other realtime ones wait, one
    # per batch.
    joining = [i for i in range(1, len(live))
               if fill_from_slower or live[i].delay_ms <= head.delay_ms]
    # room left empty on purpose counts as full: slower work is waiting, so holding the
    # head for company would only idle the model
    rejected = len(joining) < len(live) - 1
    by_closeness = sorted(joining, key=lambda i: (
        live[i].delay_ms > head.delay_ms, abs(live[i].tokens - head.tokens), i))
    for i in by_closeness:
        if len(chosen) >= max_batch_size:
            break
        widest = max(longest, live[i].tokens)
        if widest * (len(chosen) + 1) <= max_batch_tokens:
            chosen.append(i)
            longest = widest
        else:
            rejected = True
    full = rejected or len(chosen) >= max_batch_size
    waited = now_ms - head.enqueued_ms
    if not full and waited < max_wait_ms:
        return Selection(expired=expired, wait_ms=max_wait_ms - waited)
    return Selection(batch=[live[i].id for i in sorted(chosen)], expired=expired, full=full)


PLAN_BATCHES = 4  # batches one read of the lookahead chooses at most, its own included


def planned_after(read: list[Candidate | None], first: Selection, now_ms: int,
                  max_batch_size: int, max_batch_tokens: int, lookahead: int,
                  fill_from_slower: bool = True) -> list[list[str]]:
    """The batches a claim plans after ``first`` (what it leased from ``read``, the
    candidates it read; an orphan is None), for the next claims to take in turn
    (``lua/claim.lua`` "planned"): from the live candidates it did not take, each headed
    by the most urgent of them, while they number at least half the ``lookahead`` and
    the batch chosen is full, ``PLAN_BATCHES`` in all. A claim plans only when it read
    past a batch's worth (varied lengths: it read up to the lookahead, which each claim
    would otherwise read again for its one batch) and leased a batch. Each planned batch
    is the rule's choice from a lookahead that lacks the requests queued since: padding
    stays within the rule's own noise (``bench/plan_quality.py``)."""
    if len(read) <= max_batch_size or not first.batch:
        return []
    taken = set(first.batch)
    rest = [c for c in read if c is not None and not 0 < c.expire_ms <= now_ms
            and c.id not in taken]
    plans: list[list[str]] = []
    while len(plans) < PLAN_BATCHES - 1 and 2 * len(rest) >= lookahead:
        chosen = select_batch(rest, now_ms, max_batch_size, max_batch_tokens, 0, fill_from_slower)
        if not chosen.full:
            break
        plans.append(chosen.batch)
        rest = [c for c in rest if c.id not in set(chosen.batch)]
    return plans


@dataclass(frozen=True)
class Backlog:
    """One backlogged tenant of a class, as a fair claim sees it."""

    tenant: str
    counter: float               # weighted tokens served: sum of tokens / weight
    queued: list[Candidate]      # its sub-queue: its pending requests of the class, in rank order


def fair_lookahead(backlogs: list[Backlog], quantum: float, lookahead: int) -> list[Candidate]:
    """The candidates of a claim that shares a class between two or more backlogged
    tenants (``lua/claim.lua`` fair_reader), to hand to :func:`select_batch`: the least
    served tenant's sub-queue first (its head heads the batch), then each next tenant's by
    counter (ties: name), skipping tenants more than ``quantum`` (max_batch_tokens)
    ahead of the least served, ``lookahead`` in all.

    Only tenants within ``quantum`` of the least served can be charged, and a claim
    charges one tenant at most T = max(max_batch_tokens, its longest request) tokens, so
    two backlogged tenants' counters never differ by more than quantum + T / w_min
    (docs/fair-share.md)."""
    order = sorted(backlogs, key=lambda b: (b.counter, b.tenant))
    chosen: list[Candidate] = []
    for backlog in order:
        if backlog.counter > order[0].counter + quantum or len(chosen) >= lookahead:
            break
        chosen.extend(backlog.queued[:lookahead - len(chosen)])
    return chosen


def charged(counter: float, tokens: int, weight: float) -> float:
    """A tenant's counter once a claim served it ``tokens`` (exact counts) at ``weight``."""
    return counter + tokens / weight
