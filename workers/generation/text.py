"""A sequence's text as its tokens arrive: where it stops, and what its stream is sent.

A row that streams or has stop strings decodes only what each token adds
(``runner.text_delta``) and looks for its stops in the new tail alone; any other row is
decoded once, when it ends."""

from __future__ import annotations

from typing import Any

from batchery.workers.generation.batch import Sequence


def append(s: Sequence, token: int, runner: Any) -> None:
    """Add the token, and end the sequence where it stops: EOS, a stop string, its length."""
    p = s.params
    if token in runner.eos_ids:
        s.finish_reason = "stop"
    else:
        s.generated.append(token)
    if p.stop or p.stream:
        before = len(s.text)
        last = s.finish_reason is not None or len(s.generated) >= p.max_new_tokens
        s.text += runner.text_delta(s, final=last)
        if p.stop and len(s.text) > before:
            tail = max(0, before - max(len(stop) for stop in p.stop) + 1)
            cut = min((i for i in (s.text.find(stop, tail) for stop in p.stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                s.text, s.finish_reason = s.text[:cut], "stop"
    if s.finish_reason is None and len(s.generated) >= p.max_new_tokens:
        s.finish_reason = "length"
    if s.finish_reason and not (p.stop or p.stream):
        s.text = runner.text(s.generated)


def so_far(s: Sequence, runner: Any) -> str:
    """The text generated so far, for a sequence stopped early (deadline, cancel)."""
    return s.text if s.params.stop or s.params.stream else runner.text(s.generated)


def stream_delta(s: Sequence) -> str | None:
    """The text to write to the stream now, marked as sent; None: nothing yet. Held back:
    a trailing half character (a byte-level token may end inside one) and what could
    begin a stop string; all of it at the end. If decoding ever rewrote text already
    sent, the rest waits for the result."""
    if not s.text.startswith(s.sent):
        return None
    shown = len(s.text)
    if not s.finish_reason:
        shown = min(len(s.text.rstrip("\ufffd")), shown - s.params.holdback)
    # the first token always gets an entry, its text possibly empty (a special token):
    # the reader learns that generation started
    if shown > len(s.sent) or len(s.generated) == 1 and not s.sent:
        delta, s.sent = s.text[len(s.sent):shown], s.text[:shown]
        return delta
    return None
