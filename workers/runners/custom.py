"""``--runner module:factory``: any callable over a list of inputs.

``factory()`` returns either a callable ``f(inputs) -> outputs`` (same length, JSON-ready),
optionally with ``f.tokens(input) -> int``, or an object with ``prepare``/``run`` (the
full Runner interface). A callable that raises fails its batch; single-request fallback
then finds the bad input.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

from batchery.batching.pricing import estimate_tokens
from batchery.errors import ConfigError
from batchery.workers.runners.base import Prepared, Runner


class CallableRunner(Runner):
    warmup_inputs = None  # the input format is the runner's own: no generic dummy batch

    def __init__(self, fn: Callable[[list[Any]], list[Any]]) -> None:
        self._fn = fn
        self._tokens: Callable[[Any], int] = getattr(fn, "tokens", estimate_tokens)

    def prepare(self, inputs: list[Any]) -> Prepared:
        lengths = [max(1, int(self._tokens(v))) for v in inputs]
        return Prepared(data=inputs, lengths=lengths, padded=max(lengths) * len(lengths))

    def run(self, data: Any) -> list[Any]:
        return list(self._fn(data))

    def count_tokens(self, inputs: list[Any]) -> list[int | None] | None:
        if not hasattr(self._fn, "tokens"):
            return None  # only the estimate is known: nothing better to write
        return [self._count(v) for v in inputs]

    def _count(self, value: Any) -> int | None:
        try:
            return max(1, int(self._tokens(value)))
        except Exception:  # an input it cannot price: the run will say why
            return None

    def warmup(self) -> None:
        warm = getattr(self._fn, "warmup", None)
        if callable(warm):
            warm()


def load_factory(spec: str) -> Runner:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--runner {spec!r}: expected module:factory, e.g. mymodels:build")
    if "" not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: modules in the working directory load
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--runner {spec!r}: cannot load it ({exc})") from None
    made = factory()
    if hasattr(made, "prepare") and hasattr(made, "run"):
        return made
    if not callable(made):
        raise ConfigError(f"--runner {spec!r}: {attr}() returned {type(made).__name__}, "
                          "not a callable over a list of inputs")
    return CallableRunner(made)
