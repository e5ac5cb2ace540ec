"""Batch size by measurement, the seeds' adaptive batching.

At start a worker times its model over doubling batch sizes, stops once two doublings
in a row gained less than TOLERANCE, and keeps the smallest size within TOLERANCE of
the best throughput: past it a larger batch buys no speed, only latency and padding.
Each size is timed on the threads the worker will run batches on, after one untimed
run of that shape, twice (in two passes; the faster counts).

The inputs are short paragraphs (TYPICAL_TOKENS). Batch size matters most for short
inputs: on long ones the model's time is all compute and throughput is flat past a few
requests (MiniLM on one CPU thread at 128 tokens: 19-21 requests/s from batch 1 to 64).
Shorter still would favour larger batches, whose wider spread of lengths costs more in
padding than the few percent of speed they gain: on this project's 2-core machine,
timed at 32 tokens the worker chose 16 and `make demo` padded to 88%; at 64 tokens it
chooses 8 (42 against the best 44 requests/s) and pads to about 95%. The token budget
(--max-batch-tokens) bounds long inputs' memory.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from batchery.workers.options import UNTIMED_BATCH_SIZE

log = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOLERANCE = 0.05       # "within a few percent of the best"
TYPICAL_TOKENS = 64    # a short paragraph: between a sentence and the 256 an encoder keeps
MIN_TIMED_S = 0.2      # each size is timed at least this long


def pick_batch_size(runner: Any, max_batch_tokens: int, most: int = SIZES[-1]) -> tuple[int, dict[int, float]]:
    """(the batch size, requests/s by size); (UNTIMED_BATCH_SIZE, {}) when the runner offers no
    ``sample_input(tokens)`` to time."""
    sample = getattr(runner, "sample_input", None)
    if sample is None:
        return UNTIMED_BATCH_SIZE, {}
    length = min(TYPICAL_TOKENS, runner.max_input_tokens or TYPICAL_TOKENS)
    text = sample(length)
    rates: dict[int, float] = {}
    for size in SIZES:
        if size > most or (rates and size * length > max_batch_tokens):
            break
        try:
            rates[size] = _rate(runner, [text] * size)
        except Exception as exc:  # out of memory at this size: the sizes below it stand
            if not rates:
                raise
            log.info("calibration stopped at batch size %d: %s", size, exc)
            break
        if _flat(list(rates.values())):
            break
    for size in rates:  # a second pass, best of two: a busy neighbour slows one, not both
        rates[size] = max(rates[size], _rate(runner, [text] * size))
    return smallest_within_tolerance(rates), rates


def smallest_within_tolerance(rates: dict[int, float]) -> int:
    """The smallest batch size whose requests/s is within TOLERANCE of the best."""
    best = max(rates.values())
    return min(s for s, r in rates.items() if r >= (1 - TOLERANCE) * best)


def _flat(rates: list[float]) -> bool:
    """True when neither of the last two doublings beat the best before it by TOLERANCE."""
    if len(rates) < 3:
        return False
    before = max(rates[:-2])
    return max(rates[-2:]) < (1 + TOLERANCE) * before


def _rate(runner: Any, inputs: list[Any]) -> float:
    prepared = runner.prepare(inputs)
    runner.run(prepared.data)  # this shape's first run pays for its allocations
    runs, started = 0, time.perf_counter()
    while True:
        runner.run(prepared.data)
        runs += 1
        elapsed = time.perf_counter() - started
        if elapsed >= MIN_TIMED_S:
            return runs * len(inputs) / elapsed
