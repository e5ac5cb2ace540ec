"""How a producer prices a request in tokens before a worker sees it.

With the queue's tokenizer (announced by its workers) installed here, the count is
exact; otherwise it is estimated from the input's length. Either way it is capped at
the length the workers truncate to, and workers recount exactly before running.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any, Callable

from batchery.batching.messages import estimate_tokens

log = logging.getLogger(__name__)


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

    def __call__(self, value: Any) -> int:
        text = input_text(value) if self._encode else None
        count = self._exact(text) if text is not None else None
        count = estimate_tokens(value) if count is None else count
        return min(count, self._max) if self._max else count

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
