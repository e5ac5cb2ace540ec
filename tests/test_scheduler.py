"""The generate worker's admission and preemption rules (workers/generation/scheduler.py), one test
per rule, over plain data: no torch, no Redis, no model."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from batchery.workers.generation.scheduler import Budget, Entry, admit, room

BUDGET = Budget(sequences=4, tokens=100)


def entry(name: str, rank: int, reserved: int = 10) -> Entry:
    return Entry(name, rank, reserved)


def test_rule_1_most_urgent_first_while_it_fits_and_no_one_overtakes() -> None:
    waiting = [entry("late", 30, 10), entry("big", 20, 90), entry("first", 10, 10)]
    decision = admit(waiting, [entry("r", 50, 10)], [], BUDGET, busy=True)
    # "first" fits (20 of 100 then); "big" (90) does not, and "late", which would fit,
    # does not overtake it
    assert decision.start == ["first"] and decision.preempt == []


def test_rule_2_an_idle_worker_starts_the_head_whatever_its_size() -> None:
    decision = admit([entry("huge", 10, 5000), entry("next", 20, 10)], [], [], BUDGET, busy=False)
    assert decision.start == ["huge"]  # alone: the next one waits for room
    assert admit([entry("huge", 10, 5000)], [], [], BUDGET, busy=True).start == []


def test_rule_3_a_newcomer_preempts_the_least_urgent_rows_it_needs() -> None:
    running = [entry("a", 100, 30), entry("b", 300, 30), entry("c", 200, 30)]
    decision = admit([entry("urgent", 1, 50)], running, running, BUDGET, busy=True)
    # 10 tokens free, 50 needed: "b" (least urgent) frees 30, then "c" 30 more; "a" stays
    assert decision.preempt == ["b", "c"] and decision.start[0] == "urgent"


def test_rule_4_no_row_as_urgent_is_preempted_and_none_if_room_cannot_be_made() -> None:
    running = [entry("same", 5, 50), entry("less", 9, 40)]
    decision = admit([entry("new", 5, 60)], running, running, BUDGET, busy=True)
    # "less" alone frees 40 of the 50 missing; "same" is as urgent: nothing is preempted
    assert decision == admit([entry("new", 5, 60)], running, running, BUDGET, busy=True)
    assert decision.start == [] and decision.preempt == []


def test_rule_4_only_decoding_rows_are_preempted() -> None:
    prefilling = entry("prefilling", 900, 80)
    decision = admit([entry("new", 1, 50)], [prefilling], [], BUDGET, busy=True)
    assert decision.preempt == [] and decision.start == []


def test_rule_5_a_preempted_row_waits_again_at_its_rank() -> None:
    running = [entry("row", 50, 60)]
    waiting = [entry("urgent", 1, 60), entry("later", 80, 10)]
    decision = admit(waiting, running, running, Budget(sequences=2, tokens=100), busy=True)
    # "row" makes room for "urgent", then ranks before "later" in the line; it does not
    # fit again beside "urgent", so the line stops there
    assert decision.preempt == ["row"] and decision.start == ["urgent"]


def test_room_counts_sequences_and_padded_tokens() -> None:
    # the cache is left-padded: two rows take twice the wider one's 30 tokens, not 55
    assert room([entry("a", 1, 30), entry("b", 2, 25)], BUDGET) == (2, 40)


def test_admission_counts_the_padded_width_not_the_sum() -> None:
    # 10 + 10 + 60 = 80 tokens fit a budget of 100 as a sum, but the cache holds three
    # rows of 60: 180. The long one waits (the short ones do not overtake it)
    running = [entry("a", 1, 10), entry("b", 2, 10)]
    assert admit([entry("long", 5, 60), entry("short", 6, 10)], running, [], BUDGET,
                 busy=True).start == []
    assert admit([entry("short", 6, 10)], running, [], BUDGET, busy=True).start == ["short"]


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 60)), max_size=8),
       st.lists(st.tuples(st.integers(0, 50), st.integers(1, 60)), max_size=6))
def test_budgets_hold_and_each_sequence_has_one_place(waiting_specs, running_specs) -> None:
    waiting = [entry(f"w{i}", r, t) for i, (r, t) in enumerate(waiting_specs)]
    running: list[Entry] = []
    for i, (r, t) in enumerate(running_specs):  # what runs fits: the scheduler let it in
        if min(room(running + [entry(f"r{i}", r, t)], BUDGET)) >= 0:
            running.append(entry(f"r{i}", r, t))
    decision = admit(waiting, running, running, BUDGET, busy=bool(running))
    kept = [e for e in running if e.key not in decision.preempt]
    started = [e for e in waiting + running if e.key in decision.start]
    assert len(set(decision.start)) == len(decision.start)
    if running or len(started) > 1:  # (rule 2: an idle worker's head may exceed the budget)
        slots, tokens = room(kept + started, BUDGET)
        assert slots >= 0 and tokens >= 0
    for victim in (e for e in running if e.key in decision.preempt):
        assert any(e.rank < victim.rank for e in started)  # only for something more urgent


def test_the_scheduler_needs_no_torch() -> None:
    check = "import sys; import batchery.workers.generation.scheduler; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0
