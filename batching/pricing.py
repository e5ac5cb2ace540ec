"""How a request is priced in tokens: the one owner of the rule.

- ``estimate_tokens``: without a tokenizer, about 4 characters per token. A producer
  stores such a request marked as estimated;
- ``TokenCounter`` / ``QueueCounter``: a producer with the queue's tokenizer (announced by
  its workers, or set by an operator) counts exactly, capped at the length the workers
  truncate to. Without one the counter answers None (priced by estimate) and asks again
  after REFRESH_S, so a producer started before its workers counts as soon as they
  announce one;
- ``exact_counts``: a worker that counts re-prices the estimated requests before any batch
  is chosen (batching/lua/claim.lua's pricing round); an input its tokenizer cannot take
  keeps its estimate and fails alone when it runs.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)
REFRESH_S = 5.0  # how often a counter without a tokenizer asks the queue for one again


def input_text(value: Any) -> str | None:
    """The text a model would read from an input: a string, or its "text"/"prompt" field."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        for field in ("text", "prompt"):
            if isinstance(value.get(field), str):
                return value[field]
    return None


class TokenCounter:
    def __init__(self, tokenizer: str = "", max_tokens: int = 0) -> None:
        self._max = max_tokens or None
        self._encode = _load(tokenizer, max_tokens) if tokenizer else None
        self._made = time.monotonic()

    def __call__(self, value: Any) -> int | None:
        """The exact count, or None when only an estimate is possible here."""
        if self._encode is None:  # the common case (no tokenizer here): per request
            return None
        text = input_text(value)
        count = self._exact(text) if text is not None else None
        return min(count, self._max) if count is not None and self._max else count

    @property
    def stale(self) -> bool:
        """True when it cannot count exactly and should ask the queue again."""
        return self._encode is None and time.monotonic() - self._made > REFRESH_S

    def _exact(self, text: str) -> int | None:
        try:
            return len(self._encode(text))  # type: ignore[misc]
        except Exception:  # text the tokenizer cannot take: validation will say why
            return None


@lru_cache(maxsize=8)  # one per process, however many clients share it
def _load(name: str, max_tokens: int) -> Callable[[str], list[int]] | None:
    try:
        from transformers import AutoTokenizer  # optional: only with batchery[worker]
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as exc:  # not installed, or the model is not on this machine
        log.debug("counting tokens by estimate: tokenizer %r unavailable (%s)", name, exc)
        return None
    limit = max_tokens or tokenizer.model_max_length
    return lambda text: tokenizer(text, truncation=True, max_length=limit)["input_ids"]


class QueueCounter:
    """A TokenCounter for a queue's tokenizer, asked for again while there is none."""

    def __init__(self, read_settings: Callable[[], Any]) -> None:
        self._read = read_settings
        self._count: TokenCounter | None = None

    def __call__(self, value: Any) -> int | None:
        if self._count is None or self._count.stale:
            settings = self._read()
            self._count = TokenCounter(settings.tokenizer, settings.max_input_tokens)
        return self._count(value)


def estimate_tokens(value: Any) -> int:
    """A tokenizer-free guess of a request's cost: about 4 characters per token.

    Counts the text inside the input (strings in lists and objects too), plus 2 for
    the special tokens a model adds. Such a request is marked as estimated in Redis; a
    worker that can count writes the exact count before any batch is chosen.
    """
    return 2 + _text_length(value) // 4


def _text_length(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_length(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_length(v) for v in value)
    return 1 if value is not None else 0


def exact_counts(count_tokens: Callable[[list[Any]], list[int | None] | None],
                 candidates: Sequence[tuple[str, Any]]) -> list[tuple[str, int]]:
    """(id, exact tokens) of (id, input) candidates priced by estimate, counted by a
    worker's ``count_tokens``. One input the tokenizer cannot take is counted alone, and
    keeps its estimate (unmarked: it fails alone when it runs); the others are counted."""
    inputs = [value for _, value in candidates]
    try:
        counts = count_tokens(inputs) or [None] * len(inputs)
    except Exception:  # one input the tokenizer cannot take: count each alone
        counts = [_count_one(count_tokens, value) for value in inputs]
    return [(i, c or estimate_tokens(v)) for (i, v), c in zip(candidates, counts)]


def _count_one(count_tokens: Callable[[list[Any]], list[int | None] | None], value: Any) -> int | None:
    try:
        return (count_tokens([value]) or [None])[0]
    except Exception as exc:  # it fails alone when it runs
        log.info("could not count an input's tokens (%s: %s); keeping its estimate",
                 type(exc).__name__, str(exc)[:200])
        return None
