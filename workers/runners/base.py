"""What a worker needs from a model: prepare a batch (CPU), run it, count tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class InputError(ValueError):
    """This input can never run (wrong type, missing text): it fails at once, no retry."""


@dataclass
class Prepared:
    """A batch ready for the model."""

    data: Any            # what Runner.run takes (e.g. tokenized tensors)
    lengths: list[int]   # exact tokens per request, after truncation
    padded: int          # tokens the model processes, padding included

    @property
    def efficiency(self) -> float:
        return sum(self.lengths) / self.padded if self.padded else 1.0


class Runner:
    """Base of every runner. ``prepare`` runs in the claim thread while the model is busy."""

    tokenizer: str = ""       # announced in the queue settings so producers count exactly
    max_input_tokens: int = 0  # inputs are truncated to this (0: no limit)
    warmup_inputs: list[Any] | None = ["warm-up", "a second, somewhat longer warm-up input"]

    def prepare(self, inputs: list[Any]) -> Prepared:
        raise NotImplementedError

    def run(self, data: Any) -> list[Any]:
        """Outputs for a prepared batch, JSON-ready, one per input, in order."""
        raise NotImplementedError

    def count_tokens(self, inputs: list[Any]) -> list[int | None] | None:
        """Exact tokens each input costs as this runner runs it (None where the input
        cannot run); None when this runner cannot count apart from running, so requests
        priced by a producer's estimate keep it."""
        return None

    def warmup(self) -> None:
        """Run a dummy batch so the first real one does not pay for lazy initialisation."""
        if self.warmup_inputs:
            self.run(self.prepare(list(self.warmup_inputs)).data)


def text_of(value: Any, fields: tuple[str, ...] = ("text",)) -> str:
    """The text of an input (a string, or an object with one of ``fields``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        for field in fields:
            if isinstance(value.get(field), str):
                return value[field]
    names = " or ".join(repr(f) for f in fields)
    raise InputError(f"input must be a string or an object with a string {names} field, "
                     f"got {type(value).__name__}")
