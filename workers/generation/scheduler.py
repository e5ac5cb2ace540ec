"""The generate worker's admission and preemption decisions, over plain data.

No torch and no Redis here: ``workers/generation/loop.py`` hands in what waits and what runs
(each as its queue rank and the cache tokens it may come to hold) and applies the
decision (prefill these, pause those), as vLLM's ``Scheduler.schedule()`` is apart from
its model runner. The rules, each with its test in ``tests/test_scheduler.py``:

1. What waits starts most urgent first (lowest rank), while the budgets of sequences
   and cache tokens allow; the first that cannot start stops the rest, so no later
   request overtakes it in the line. The cache is left-padded, every row as wide as the
   widest, so a set of sequences costs its size times its largest reservation (prompt
   plus max_new_tokens), not the sum: the memory the batch really comes to take.
2. An idle worker (nothing decoding or being prefilled) starts the head whatever its
   size: a request larger than the budget still runs, alone.
3. A waiting sequence that does not fit preempts running rows less urgent than it,
   least urgent first, only as many as it needs.
4. A row as urgent as the newcomer or more is never preempted; if the less urgent rows
   cannot make the room, none is preempted and the newcomer waits.
5. A preempted row goes back to the waiting line at its rank (its cache is freed; it is
   prefilled again from its prompt and what it generated, so nothing is lost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass(frozen=True)
class Entry:
    """A sequence as the scheduler sees it."""

    key: Any       # the caller's handle on it, returned as is
    rank: int      # the request's queue rank (enqueue ms + class delay ms): lower is more urgent
    reserved: int  # cache tokens it may come to hold: prompt plus max_new_tokens


@dataclass(frozen=True)
class Budget:
    sequences: int  # in flight at once (--max-batch-size)
    tokens: int     # cache tokens reserved at once (--max-batch-tokens)


@dataclass
class Admission:
    """What to do before the next step."""

    start: list[Any] = field(default_factory=list)    # keys to prefill now, most urgent first
    preempt: list[Any] = field(default_factory=list)  # running keys to pause for them


def cost(entries: list[Entry]) -> int:
    """Cache tokens ``entries`` may come to take together: every row of the left-padded
    cache as wide as the widest reservation."""
    return len(entries) * max((e.reserved for e in entries), default=0)


def fits(entries: list[Entry], budget: Budget) -> bool:
    return len(entries) <= budget.sequences and cost(entries) <= budget.tokens


def room(held: Iterable[Entry], budget: Budget) -> tuple[int, int]:
    """Sequences and cache tokens still free beside ``held`` (what to claim into)."""
    entries = list(held)
    return budget.sequences - len(entries), budget.tokens - cost(entries)


def admit(waiting: list[Entry], running: list[Entry], preemptible: list[Entry],
          budget: Budget, busy: bool) -> Admission:
    """Which of ``waiting`` start now and which of ``preemptible`` (the decoding rows, a
    part of ``running``: every sequence holding room) pause for them. ``busy``: something
    decodes or is being prefilled (else the worker is idle: rule 2)."""
    line = sorted(waiting, key=lambda e: e.rank)
    pool = sorted(preemptible, key=lambda e: e.rank, reverse=True)  # least urgent first
    held = list(running)
    decision = Admission()
    while line:
        head = line[0]
        if (busy or decision.start) and not fits(held + [head], budget):
            victims = _victims(head, pool, held, budget)
            if victims is None:
                break
            pool = [e for e in pool if e not in victims]
            held = [e for e in held if e not in victims]
            decision.preempt += [v.key for v in victims]
            line = sorted(line + victims, key=lambda e: e.rank)  # (stable: head stays first)
        decision.start.append(line.pop(0).key)
        held.append(head)
    return decision


def _victims(newcomer: Entry, pool: list[Entry], held: list[Entry],
             budget: Budget) -> list[Entry] | None:
    """The fewest least urgent rows of ``pool`` whose leaving lets ``newcomer`` fit beside
    the rest of ``held``, all less urgent than it; None if they cannot."""
    chosen: list[Entry] = []
    for victim in pool:
        if fits([e for e in held if e not in chosen] + [newcomer], budget) \
                or victim.rank <= newcomer.rank:
            break
        chosen.append(victim)
    return chosen if fits([e for e in held if e not in chosen] + [newcomer], budget) else None
