"""Runners the benchmarks start workers with (``--runner bench.runners:NAME``)."""

from __future__ import annotations

import os
import time
from typing import Any


def noop() -> Any:
    """Returns None for every input at once: what is left to measure is the queue."""
    def run(inputs: list[Any]) -> list[Any]:
        return [None] * len(inputs)
    run.tokens = lambda value: 1  # type: ignore[attr-defined]
    return run


def words(value: Any) -> int:
    """A text's words plus 2 (a model's special tokens), else 1: counts that vary with the
    text as a tokenizer's do, without loading one (``noop_words``, ``bench.redis_time --text``)."""
    return len(value.split()) + 2 if isinstance(value, str) else 1


def noop_words() -> Any:
    """bench.runners:noop counting each text's words (``words``): the claims group
    requests of varied lengths, as with a real tokenizer, and the model costs nothing."""
    def run(inputs: list[Any]) -> list[Any]:
        return [None] * len(inputs)
    run.tokens = words  # type: ignore[attr-defined]
    return run


def noop_uncounted() -> Any:
    """bench.runners:noop without a token count: its worker claims on the producer's
    estimates, with no pricing round (what that round costs is the difference)."""
    def run(inputs: list[Any]) -> list[Any]:
        return [None] * len(inputs)
    return run


def fixed_cost() -> Any:
    """Sleeps BENCH_COST_MS per request (default 2): a model of known capacity, idle CPU."""
    per_request = float(os.environ.get("BENCH_COST_MS", "2")) / 1000

    def run(inputs: list[Any]) -> list[Any]:
        time.sleep(per_request * len(inputs))
        return [None] * len(inputs)
    run.tokens = lambda value: 1  # type: ignore[attr-defined]
    return run


def vector384() -> Any:
    """Returns 384 floats per input, the size of a MiniLM embedding: what results cost."""
    import random

    def run(inputs: list[Any]) -> list[Any]:
        return [[random.uniform(-0.2, 0.2) for _ in range(384)] for _ in inputs]
    run.tokens = lambda value: 1  # type: ignore[attr-defined]
    return run


def poisoned() -> Any:
    """Sleeps 20 ms per batch; raises for a batch holding an input that mentions "poison"
    (single-request fallback isolates it, retries fail again, it is dead-lettered)."""
    def run(inputs: list[Any]) -> list[Any]:
        if any("poison" in str(v) for v in inputs):
            raise RuntimeError("reranker: input holds a poisoned document")
        time.sleep(0.02)
        return [{"score": 0.5} for _ in inputs]
    return run


def padded_cost() -> Any:
    """Sleeps BENCH_TOKEN_US (default 10) per padded token (the longest input's tokens x the
    batch's size) plus BENCH_BATCH_MS (default 1) per batch: a model whose time grows with
    padding, as a transformer's does, at no CPU. Inputs are {"n": tokens}."""
    per_token = float(os.environ.get("BENCH_TOKEN_US", "10")) / 1e6
    per_batch = float(os.environ.get("BENCH_BATCH_MS", "1")) / 1000

    def tokens(value: Any) -> int:
        return max(1, int(value["n"])) if isinstance(value, dict) and "n" in value else 1

    def run(inputs: list[Any]) -> list[Any]:
        time.sleep(per_batch + per_token * max(map(tokens, inputs)) * len(inputs))
        return [None] * len(inputs)
    run.tokens = tokens  # type: ignore[attr-defined]
    return run
