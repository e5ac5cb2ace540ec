"""What planning costs the batches: padding, and reads of the lookahead, per request.

``python -m bench.plan_quality [-n N]`` feeds N requests of real text (both corpora,
their lengths as ``bench.runners.words`` counts them, in a shuffled order) through the
batching rule alone (batching/policy.py: no Redis, no model), a backlog of B requests
standing, and claims batches with the worker's defaults (64 requests, 8,192 padded
tokens, a lookahead of 1,024) two ways: each claim choosing from the lookahead it reads
(``select_batch``), and a claim that read the lookahead also planning the next batches
from what it read (``planned_after``, the claim's way since planning came in). It prints
the padding efficiency (real tokens over padded tokens: 1.0 is no padding) and how many
times each request was read, for backlogs smaller than, about and past the lookahead.
"""

from __future__ import annotations

import argparse
import random

from batchery.batching.policy import Candidate, planned_after, select_batch
from batchery.workers.options import WorkerOptions
from bench import common, corpus
from bench.runners import words

DEFAULTS = WorkerOptions()
NOW = 10 ** 13  # every request has waited past any max_wait: each claim leases
BACKLOGS = (600, 1_200, 3_000)


def run(lengths: list[int], backlog: int, plan: bool) -> tuple[float, float]:
    """(padding efficiency, reads per request) of claiming ``lengths`` in their order,
    ``backlog`` of them standing; ``plan``: claims plan as lua/claim.lua does."""
    size, budget = DEFAULTS.max_batch_size, DEFAULTS.max_batch_tokens
    lookahead = max(DEFAULTS.claim_lookahead, 4 * size)
    queue: list[Candidate] = []
    arrived = real = padded = reads = 0
    planned: list[list[str]] = []
    while True:
        while len(queue) < backlog and arrived < len(lengths):  # ranks in arrival order
            queue.append(Candidate(str(arrived), lengths[arrived], arrived, rank=arrived))
            arrived += 1
        if not queue:
            break
        if planned and planned[0][0] == queue[0].id:
            batch = planned.pop(0)
        else:
            read = queue[:lookahead]
            reads += len(read)
            chosen = select_batch(read, NOW, size, budget, 0)
            batch = chosen.batch
            planned = planned_after(read, chosen, NOW, size, budget, lookahead) if plan else []
        taken = set(batch)
        tokens = [c.tokens for c in queue if c.id in taken]
        real += sum(tokens)
        padded += max(tokens) * len(tokens)
        queue = [c for c in queue if c.id not in taken]
    return real / padded, reads / len(lengths)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="bench.plan_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=20_000, help="requests per run (default 20,000)")
    args = p.parse_args(argv)
    rows = []
    for name, texts in (("paragraphs", corpus.paragraphs(args.n)), ("passages", corpus.passages(args.n))):
        lengths = [words(t) for t in texts]
        random.Random(1).shuffle(lengths)
        for backlog in BACKLOGS:
            each, each_reads = run(lengths, backlog, plan=False)
            planning, planning_reads = run(lengths, backlog, plan=True)
            rows.append({"corpus": name, "backlog": backlog, "each": each, "planning": planning,
                         "ratio": planning / each, "each_reads": each_reads,
                         "planning_reads": planning_reads})
    print(common.table(rows, [
        ("corpus", "corpus", ""), ("backlog", "backlog", ","),
        ("each", "padding efficiency, each claim reads", ".3f"),
        ("planning", "planning", ".3f"), ("ratio", "planning / each", ".3f"),
        ("each_reads", "reads per request, each claim reads", ".1f"),
        ("planning_reads", "planning", ".1f")]))
    print(f"\n({args.n:,} requests per run, in one shuffled order; {common.machine()})")
    return rows


if __name__ == "__main__":
    main()
