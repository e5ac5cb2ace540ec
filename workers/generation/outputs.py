"""What a generated sequence's result holds: its text, token count, finish reason and,
when asked, each token's log-probabilities (the decode loop commits it)."""

from __future__ import annotations

import time
from typing import Any

from batchery.workers.execution import Executed, Outcome, failure
from batchery.workers.generation.batch import Sequence

DEADLINE_ERROR = {"type": "DeadlineExceeded",
                  "message": "the deadline passed while generating; output holds the text so far"}


def outcome(s: Sequence, runner: Any, batch_size: int) -> Outcome:
    """The result of a sequence that ended (its deadline passed: expired, with its text)."""
    output: dict[str, Any] = {"text": s.text, "tokens": len(s.generated),
                              "prompt_tokens": len(s.prompt_ids), "finish_reason": s.finish_reason}
    if s.params.logprobs is not None:
        output["logprobs"] = logprobs(s, runner)
    run_ms = round((time.perf_counter() - s.key.started) * 1000, 3)
    expired = s.finish_reason == "deadline"
    return Outcome(s.key.request, output=output, expired=expired, batch_size=batch_size,
                   run_ms=run_ms, error=dict(DEADLINE_ERROR) if expired else None)


def by_claim(ended: list[Sequence], failed: list[tuple[Sequence, Exception]], runner: Any,
             batch_size: int) -> list[Executed]:
    """The results of sequences that ended and of those that failed (their own error,
    retried as any), one Executed per claim they came in (a commit each)."""
    done = [(s, outcome(s, runner, batch_size)) for s in ended]
    done += [(s, failure(s.key.request, exc)) for s, exc in failed]
    claims: dict[int, list[Outcome]] = {}
    for s, o in done:
        claims.setdefault(s.key.claimed_ms, []).append(o)
    return [Executed(claimed_ms, group) for claimed_ms, group in claims.items()]


def cancelled(s: Sequence) -> dict[str, Any]:
    """What a cancelled sequence's result holds: the text it had generated."""
    return {"text": s.text, "tokens": len(s.generated), "prompt_tokens": len(s.prompt_ids),
            "finish_reason": "cancelled"}


def logprobs(s: Sequence, runner: Any) -> list[dict[str, Any]]:
    """Per generated token: its text, id and log-probability under the model, and the
    likeliest alternatives when the request asked for some."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": runner.text([token]), "id": token, "logprob": logprob}
    return [{**entry(token, mine), "top": [entry(t, lp) for t, lp in top]}
            for token, mine, top in s.logprobs[:len(s.generated)]]
