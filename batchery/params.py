"""Click parameter types shared by every command: numbers that must be finite."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloat(click.ParamType):
    """A float option that refuses nan and inf (Python's float() accepts both)."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number; give seconds such as 30 or 0.5",
                      param, ctx)
        return number


FINITE = FiniteFloat()
