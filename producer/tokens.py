"""How a producer prices a request in tokens before a worker sees it.

With the queue's tokenizer (announced by its workers, or set by an operator) installed
here, the count is exact and capped at the length the workers truncate to. Otherwise
the counter answers None: the request is stored priced by estimate, marked so, and a
worker counts it exactly before any batch is chosen. A counter without a tokenizer
asks again after REFRESH_S, so a producer started before its workers starts counting
as soon as they announce one.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache
from typing import Any, Callable

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
