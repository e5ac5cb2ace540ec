"""The page: Jinja2 templates (autoescaped: error messages and ids are users' text) and
the small helpers they use, among them the inline SVG of queue depth."""

from __future__ import annotations

import time
from typing import Any, Sequence

from jinja2 import Environment, PackageLoader, select_autoescape

CHART_W, CHART_H = 240, 44


def ago(seconds: float | None) -> str:
    """"4s", "3m 12s", "1m", "2h 05m", "3d 4h": short enough for a table cell."""
    if seconds is None:
        return "–"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m" + (f" {s % 60:02d}s" if s % 60 else "")
    if s < 86_400:
        return f"{s // 3600}h" + (f" {s % 3600 // 60:02d}m" if s % 3600 // 60 else "")
    return f"{s // 86_400}d {s % 86_400 // 3600}h"


def number(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, int) or float(value).is_integer() and digits == 0:
        return f"{int(value):,}"
    return f"{value:,.{digits}f}"


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def chart(history: Sequence[Sequence[float]], now: float | None = None) -> dict[str, Any]:
    """Polyline points of pending and in flight, the newest sample at the right edge,
    over the samples' span (at least a minute, at most the history's window), scaled to
    the highest value seen."""
    from batchery.dashboard.state import HISTORY_S
    now = time.time() if now is None else now
    if not history:
        return {"pending": "", "inflight": "", "top": 0, "span": 0, "w": CHART_W, "h": CHART_H}
    span = min(HISTORY_S, max(60.0, now - history[0][0]))
    top = max(1, max(max(p, i) for _, p, i in history))

    def points(column: int) -> str:
        return " ".join(f"{CHART_W * (1 - min(span, now - row[0]) / span):.1f},"
                        f"{CHART_H - 2 - (CHART_H - 4) * row[column] / top:.1f}"
                        for row in history)
    return {"pending": points(1), "inflight": points(2), "top": top, "span": span,
            "w": CHART_W, "h": CHART_H}


def environment() -> Environment:
    env = Environment(loader=PackageLoader("batchery.dashboard", "templates"),
                      autoescape=select_autoescape(["html"]), trim_blocks=True, lstrip_blocks=True)
    env.filters.update(ago=ago, number=number, percent=percent,
                       clock=lambda at: time.strftime("%H:%M:%S", time.localtime(at)))
    env.globals.update(chart=chart)
    return env
