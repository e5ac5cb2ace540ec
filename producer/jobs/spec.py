"""What an offline job is: its spec (the RQ job's kwargs), its progress (the RQ job's
meta) and the states it goes through. Shared by the bookkeeping and the run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PRIORITY = "batch"   # offline work: overtaken by interactive requests, never starved
DEFAULT_MAX_IN_FLIGHT = 2000  # lines queued at once: Redis never holds more of a job than this
DEFAULT_RETRIES = 3          # RQ re-runs a failed or abandoned job this often; each run resumes

# The lifecycle `batchery job status` shows; the running job writes its phase into meta.
QUEUED, RUNNING, FINALIZING = "queued", "running", "finalizing"
FINISHED, FAILED, CANCELLED, STOPPED = "finished", "failed", "cancelled", "stopped"
COUNTING = "counting"        # phase: the job counts the input's lines (state: running)


@dataclass(frozen=True)
class JobSpec:
    """What a job runs: its RQ kwargs, plain JSON."""

    input: str               # absolute paths: the jobs worker may run elsewhere in the tree
    output: str
    errors: str
    queue: str               # the request queue its lines go to
    priority: str | int      # for lines that name none
    max_in_flight: int
    input_size: int          # the input as submitted: a changed file cannot resume safely
    input_mtime_ns: int
    output_format: str = "batchery"   # or "openai": OpenAI's batch output and error lines
    expires_at: float | None = None   # epoch seconds: every request's deadline (a batch's window)
    tenant: str | None = None  # for lines that name none; None: the job's own id

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "JobSpec":
        """From the RQ kwargs; a job submitted by an older batchery lacks the later fields."""
        return cls(**{k: kwargs[k] for k in cls.__dataclass_fields__ if k in kwargs})


@dataclass
class Progress:
    """A job's counts, kept in its RQ meta. error includes invalid lines."""

    total: int | None = None     # request lines in the input (None until counted)
    ok: int = 0
    error: int = 0
    invalid: int = 0
    done_at_start: int = 0       # lines done before this run: the rate counts this run only
    started_at: float = field(default_factory=time.time)

    @property
    def done(self) -> int:
        return self.ok + self.error

    @property
    def pending(self) -> int | None:
        return None if self.total is None else max(self.total - self.done, 0)

    def rate(self) -> float:
        elapsed = time.time() - self.started_at
        return (self.done - self.done_at_start) / elapsed if elapsed > 0 else 0.0

    def meta(self, phase: str) -> dict[str, Any]:
        return {"phase": phase, "total": self.total, "ok": self.ok, "error": self.error,
                "invalid": self.invalid, "pending": self.pending, "rate": round(self.rate(), 1),
                "updated_at": time.time()}
