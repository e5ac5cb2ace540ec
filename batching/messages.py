"""Requests and results as they travel through Redis: JSON only, never pickle."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from batchery.batching.codec import dumps, frozen, loads, loads_many
from batchery.batching.request import DEFAULT_TENANT

OK, ERROR, EXPIRED, CANCELLED, DEAD = "ok", "error", "expired", "cancelled", "dead"


@dataclass(frozen=True)
class Result:
    """The one committed result of a request, stored under its id for result_ttl."""

    id: str
    status: str                      # ok | error | expired | cancelled | dead
    output: Any = None               # what the model returned (status ok)
    error: dict[str, str] | None = None  # {"type", "message"} when status is not ok
    attempts: int = 0                # runs it took (a lost lease counts as a run)
    worker: str | None = None        # id of the worker that committed it
    batch_size: int | None = None    # size of the batch it ran in
    queued_ms: int | None = None     # from enqueue to claim, on the Redis clock
    run_ms: float | None = None      # model time of its batch

    @property
    def ok(self) -> bool:
        return self.status == OK

    @classmethod
    def from_json(cls, raw: str | bytes, request_id: str | None = None) -> "Result":
        """The result stored as ``raw``. Text that is no result (written by something
        other than a worker) raises ValueError, or, given the ``request_id`` it is stored
        under, is that request's result with status "error" saying so: one unreadable
        result never fails the read of others."""
        result = _result(loads(raw) if request_id is None else _loads_or_none(raw))
        if result is not None:
            return result
        if request_id is None:
            raise ValueError(f"not a stored result: {str(raw)[:80]!r}")
        return cls(id=request_id, status=ERROR, error={
            "type": "ResultUnreadable", "message": "the result stored for this request is not "
            "one a worker wrote (something else overwrote it); enqueue the request again"})

    @classmethod
    def from_json_many(cls, raws: list[str]) -> list["Result"]:
        """The results pushed onto a reply list, decoded together (codec.loads_many); an
        entry that is no result (not a worker's) is left out: its request's waiter reads
        the result under its id instead."""
        try:
            decoded = loads_many(raws)
        except ValueError:
            decoded = [_loads_or_none(r) for r in raws]
        return [r for r in map(_result, decoded) if r is not None]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return dumps(self.to_dict())


_RESULT_FIELDS = tuple(Result.__dataclass_fields__)
_RESULT_KEYS = set(_RESULT_FIELDS)


def _result(data: Any) -> Result | None:
    """A decoded result object as a Result; None when it is not one (no string id and
    status)."""
    if not isinstance(data, dict):
        return None
    if data.keys() == _RESULT_KEYS:  # what workers write: no need to pick the fields
        return frozen(Result, data) if isinstance(data["id"], str) and isinstance(
            data["status"], str) else None
    if not isinstance(data.get("id"), str) or not isinstance(data.get("status"), str):
        return None
    return Result(**{k: data.get(k) for k in _RESULT_FIELDS if k in data})


def _loads_or_none(raw: Any) -> Any:
    try:
        return loads(raw)
    except ValueError:
        return None


def stored_body(payload: str | None) -> tuple[dict[str, Any], str | None]:
    """A stored request's JSON object, and None; or {} and why it cannot run (missing,
    not JSON, not an object)."""
    try:
        body = loads(payload) if payload else None
    except ValueError as exc:
        return {}, f"its stored request is not JSON ({exc})"
    if body is None:
        return {}, "its stored request is missing"
    if not isinstance(body, dict):
        return {}, f"its stored request is not a JSON object (a {type(body).__name__})"
    if "input" not in body:
        return body, "its stored request has no input"
    return body, None


def stored_trace(payload: str | None) -> Any:
    """The trace context in a stored request's JSON (None: none, or not JSON)."""
    return stored_body(payload)[0].get("trace")


def stored_input(payload: str | None) -> Any:
    """The input in a stored request's JSON (None: none, or not JSON)."""
    return stored_body(payload)[0].get("input")


@dataclass(frozen=True)
class Claimed:
    """A request as a worker receives it from a claim."""

    id: str
    input: Any
    meta: dict[str, Any] | None
    tokens: int          # the producer's count (the worker recounts exactly)
    enqueued_ms: int
    expire_ms: int       # 0: no deadline
    priority: str        # its class, for metrics
    attempt: int         # this run's number, from 1
    lease_token: str     # the lease this worker holds the request under: it commits with it
    invalid: str | None = None  # why the stored request cannot run (not written by a client)
    rank: int = 0        # its score in the pending set (enqueue ms + class delay ms)
    client: str = ""     # the client that enqueued it, whose reply list gets its result
    trace: Any = None    # the producer's W3C traceparent, as stored (batchery/tracing.py)
    tenant: str = DEFAULT_TENANT  # whose fair share it was served from
    # the rank of the most urgent pending request when its batch was chosen (0: unknown):
    # only a request ranked before it is more urgent than the batch (fair share may serve
    # a tenant's later requests before another's earlier ones, on purpose)
    chosen_against: int = 0

    @classmethod
    def decode(cls, id: str, payload: str | None, sched: str | None, failures: str | None,
               token: str, chosen_against: int = 0) -> "Claimed":
        """The claimed request, or, whatever is wrong with what Redis holds for it (its
        stored JSON, its schedule entry, its attempt count), one marked ``invalid`` with
        the reason: never an exception, so the claim's other requests and every lease it
        took reach the worker (the per-request boundary of a claim)."""
        if not sched:  # the claim hands over no entry it cannot read (lua/claim.lua)
            return cls(id=id, input=None, meta=None, tokens=1, enqueued_ms=0, expire_ms=0,
                       priority="normal", attempt=_attempt(failures), lease_token=token,
                       invalid="its schedule entry in Redis (tokens, deadline, times, class, "
                               "client) is missing or cannot be read")
        try:
            tokens, expire, enqueued, rank, priority, client, *tenant = sched.split(":", 6)
            body, invalid = stored_body(payload)
            meta = body.get("meta")
            if invalid is None and meta is not None and not isinstance(meta, dict):
                invalid = f"its stored meta is not a JSON object (a {type(meta).__name__})"
            return frozen(cls, {
                "id": id, "input": body.get("input"), "meta": meta if invalid is None else None,
                "tokens": int(tokens.lstrip("~")), "enqueued_ms": int(enqueued),
                "expire_ms": int(expire), "priority": priority,
                "attempt": int(failures or 0) + 1, "lease_token": token, "invalid": invalid,
                "rank": int(rank), "client": client, "trace": body.get("trace"),
                "tenant": tenant[0] if tenant and tenant[0] else DEFAULT_TENANT,
                "chosen_against": chosen_against})
        except Exception as exc:  # the boundary: anything one request holds fails it alone
            return cls(id=id, input=None, meta=None, tokens=1, enqueued_ms=0, expire_ms=0,
                       priority="normal", attempt=_attempt(failures), lease_token=token,
                       invalid=f"its stored state cannot be read ({type(exc).__name__}: "
                               f"{str(exc)[:200]})")


def _attempt(failures: Any) -> int:
    try:
        return int(failures or 0) + 1
    except (TypeError, ValueError):
        return 1
