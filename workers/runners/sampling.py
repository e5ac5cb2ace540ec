"""Per-request generation parameters, and choosing the next token of each sequence.

An input is a prompt string, or an object with ``prompt`` (or ``text``, or chat
``messages``: a list of ``{"role", "content"}`` that the runner renders with its
tokenizer's chat template) and any of ``max_new_tokens``, ``stop``, ``temperature``,
``top_p``, ``top_k``, ``seed`` and ``stream``. Greedy unless ``temperature`` > 0; a seeded request draws from its own
generator, so the same seed gives the same text.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch

from batchery.workers.runners.base import InputError

DEFAULT_NEW_TOKENS = 32  # a short answer unless the request asks for more
MAX_NEW_TOKENS = 1024    # bounds one sequence's KV cache and its stream
MAX_STOPS, MAX_STOP_CHARS = 16, 200
FIELDS = ("prompt", "text", "messages", "max_new_tokens", "stop", "temperature", "top_p", "top_k", "seed",
          "stream")


@dataclass(frozen=True)
class GenParams:
    prompt: str
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    stop: tuple[str, ...] = ()      # generation ends before the first of these in the text
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0              # nucleus: smallest set of tokens with this much probability
    top_k: int = 0                  # 0: no limit
    seed: int | None = None         # None: a fresh random seed per run
    stream: bool = False            # write each token to the request's Redis stream
    messages: tuple[tuple[str, str], ...] = ()  # chat (role, content) pairs; prompt is then ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def holdback(self) -> int:
        """Characters a stream keeps back: they may be the start of a stop string."""
        return max((len(s) for s in self.stop), default=1) - 1


def parse_params(value: Any) -> GenParams:
    """The request's parameters; raises InputError naming the field and what it accepts."""
    if isinstance(value, str):
        return GenParams(prompt=value)
    if not isinstance(value, dict):
        raise InputError(f"input must be a prompt string or an object with a string 'prompt', "
                         f"got {type(value).__name__}")
    unknown = sorted(set(map(str, value)) - set(FIELDS))
    if unknown:
        raise InputError(f"unknown generation field(s) {unknown}; allowed: {', '.join(FIELDS)}")
    messages = _messages(value["messages"]) if "messages" in value else ()
    prompt = "" if messages else value.get("prompt", value.get("text"))
    if not isinstance(prompt, str):
        raise InputError("input must have a string 'prompt' (or 'text', or chat 'messages')")
    return GenParams(prompt=prompt, messages=messages,
                     max_new_tokens=_int(value, "max_new_tokens", DEFAULT_NEW_TOKENS, 1, MAX_NEW_TOKENS),
                     stop=_stops(value.get("stop")),
                     temperature=_number(value, "temperature", 0.0, 0.0, 100.0),
                     top_p=_number(value, "top_p", 1.0, 0.0, 1.0, open_low=True),
                     top_k=_int(value, "top_k", 0, 0, 1_000_000),
                     seed=_int(value, "seed", None, 0, 2**63 - 1),
                     stream=_bool(value, "stream"))


def _messages(messages: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InputError('messages must be a non-empty list of {"role": str, "content": str}')
    return tuple((m["role"], m["content"]) for m in messages)


def _int(value: dict[str, Any], name: str, default: Any, low: int, high: int) -> Any:
    n = value.get(name)
    if n is None:
        return default
    if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= high:
        raise InputError(f"{name} must be an integer {low}..{high}, got {n!r}")
    return n


def _number(value: dict[str, Any], name: str, default: float, low: float, high: float,
            open_low: bool = False) -> float:
    x = value.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not low <= x <= high \
            or (open_low and x == low):
        bound = f"more than {low}" if open_low else f"at least {low}"
        raise InputError(f"{name} must be a number {bound} and at most {high}, got {x!r}")
    return float(x)


def _bool(value: dict[str, Any], name: str) -> bool:
    x = value.get(name, False)
    if not isinstance(x, bool):
        raise InputError(f"{name} must be true or false, got {x!r}")
    return x


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                              for s in stops) or len(stops) > MAX_STOPS:
        raise InputError(f"stop must be a string or a list of at most {MAX_STOPS} non-empty "
                         f"strings of at most {MAX_STOP_CHARS} characters, got {stop!r}")
    return tuple(stops)


def new_generator(params: GenParams) -> torch.Generator | None:
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed)


def choose(logits: torch.Tensor, params: list[GenParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """The next token of each row of ``logits`` [rows, vocab] (float32, on the CPU)."""
    chosen = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            chosen[row] = _sample(logits[row], p, gen)
    return chosen


def _sample(logits: torch.Tensor, p: GenParams, gen: torch.Generator | None) -> int:
    scores = logits.float() / p.temperature
    if p.top_k and p.top_k < scores.numel():
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        ordered, index = torch.sort(scores, descending=True)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - ordered.softmax(dim=-1) >= p.top_p  # keep the token that crosses it
        scores = scores.scatter(0, index[drop], float("-inf"))
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())
