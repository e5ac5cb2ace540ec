"""Requests and results as they travel through Redis: JSON only, never pickle."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable

from batchery.batching.codec import dumps, encode, loads, loads_many
from batchery.batching.settings import CLASS_NAME
from batchery.errors import InvalidRequest

OK, ERROR, EXPIRED, CANCELLED, DEAD = "ok", "error", "expired", "cancelled", "dead"
MAX_ID_LENGTH = 512
MAX_DEADLINE_S = 30 * 86_400
MAX_TOKENS = 10_000_000
DEFAULT_TENANT = "default"  # whose share a request is served from when it names none
MAX_TENANT_LENGTH = 128     # a job id as tenant fits; stored in every request's sched entry

_CONTROL = re.compile(r"[\x00-\x1f]")


@dataclass(frozen=True)
class Request:
    """A request as a producer submits it, checked by :meth:`validated`."""

    id: str
    input: Any
    priority: str = "normal"   # class name, or an integer: its delay in seconds
    deadline: float | None = None  # seconds from now; past it the request is expired
    tokens: int | None = None  # cost in tokens; None: estimated, and workers count it exactly
    meta: dict[str, Any] | None = None
    trace: str | None = None  # W3C traceparent of the producer's span (batchery/tracing.py)
    tenant: str = DEFAULT_TENANT  # who it is served for: fair share between tenants of a class

    @classmethod
    def validated(cls, id: Any, input: Any, priority: Any = "normal", deadline: Any = None,
                  tokens: Any = None, meta: Any = None,
                  count: Callable[[Any], int | None] | None = None,
                  tenant: Any = DEFAULT_TENANT) -> "Request":
        """Build a request, raising InvalidRequest with the reason when a field is wrong.

        ``count`` prices the input in tokens when ``tokens`` is None (None: it cannot
        count exactly, so the request is priced by estimate until a worker counts it).
        """
        request_id, priority, deadline = check_id(id), check_priority(priority), check_deadline(deadline)
        tokens, meta, tenant = check_tokens(tokens), check_meta(meta), check_tenant(tenant)
        if tokens is None and count is not None:
            tokens = count(input)
        return cls(id=request_id, input=input, priority=priority, deadline=deadline,
                   tokens=tokens, meta=meta, tenant=tenant)

    def alike(self, id: str, input: Any, tokens: int | None) -> "Request":
        """A request of ``input`` with this checked one's priority, deadline and meta, under
        ``id`` (valid: one the client made): Client.map's, built without the frozen
        __init__."""
        return _frozen(Request, {"id": id, "input": input, "priority": self.priority,
                                 "deadline": self.deadline, "tokens": tokens, "meta": self.meta,
                                 "trace": None, "tenant": self.tenant})

    def payload(self) -> bytes:
        """The JSON stored in Redis for the worker: input, meta, and the trace context
        (W3C traceparent) only when the producer traces."""
        body = {"input": self.input} if self.meta is None else {"input": self.input, "meta": self.meta}
        if self.trace is not None:
            body["trace"] = self.trace
        try:
            return encode(body)
        except UnicodeEncodeError:
            raise InvalidRequest(f"request {self.id!r}: input holds text that is not valid "
                                 "Unicode (a lone surrogate); clean or re-encode it") from None
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"request {self.id!r}: input and meta must be JSON "
                                 f"(str, number, bool, null, list, object): {exc}") from None


def check_id(value: Any) -> str:
    return check_name(value, "request id")


def check_tenant(value: Any) -> str:
    return check_name(value, "tenant", MAX_TENANT_LENGTH)


def check_name(value: Any, what: str, most: int = MAX_ID_LENGTH) -> str:
    """The one rule for names a caller gives (request ids, a job line's custom_id): a
    string (or an integer, read as its digits) of 1 to ``most`` characters, valid UTF-8
    (no lone surrogates, which a non-UTF-8 file name or argv decodes to), no control
    characters. Redis keys are made of them and are never rewritten, so two names can
    never become one key."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidRequest(f"{what} must be a string, got {type(value).__name__}")
    text = str(value)
    if not text or len(text) > most:
        raise InvalidRequest(f"{what} must be 1-{most} characters, got {len(text)}")
    if _CONTROL.search(text):
        raise InvalidRequest(f"{what} {text[:40]!r} holds control characters; remove them")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{what} {text[:40]!r} is not valid Unicode (it holds a lone "
                             "surrogate, as a name decoded from bytes that are not UTF-8 "
                             "does); give it as UTF-8 text") from None
    return text


def check_priority(value: Any) -> str:
    if isinstance(value, bool):
        raise InvalidRequest("priority must be a class name (realtime, normal, batch) or an "
                             "integer delay in seconds, got a boolean")
    if isinstance(value, int):
        if not 0 <= value <= 7 * 86_400:
            raise InvalidRequest(f"integer priority is a delay in seconds, 0..604800; got {value}")
        return str(value)
    if isinstance(value, str) and CLASS_NAME.match(value):
        return value
    raise InvalidRequest(f"priority must be realtime, normal, batch (or a class configured "
                         f"on the queue: lowercase, not inf or nan) or an integer delay in "
                         f"seconds; got {value!r}")


def parse_priority(text: str) -> str | int:
    """A priority as typed on a command line: digits are a delay in seconds (a leading
    minus too, so that check_priority can say why it is refused), anything else a class."""
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else text


def unknown_class(priority: str, class_delays: Any) -> str | None:
    """Why a checked priority cannot run on a queue with these class delays, or None."""
    if priority.isdigit() or priority in class_delays:
        return None
    return (f"unknown priority class {priority!r}; use {', '.join(class_delays)}, a class set "
            "with `batchery queue config --class-delay`, or an integer delay in seconds")


def check_deadline(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"deadline must be a number of seconds from now, got {value!r}")
    if not 0 < value <= MAX_DEADLINE_S:
        raise InvalidRequest(f"deadline must be more than 0 and at most {MAX_DEADLINE_S} "
                             f"seconds, got {value}")
    return float(value)


def check_tokens(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        raise InvalidRequest(f"tokens must be an integer 1..{MAX_TOKENS}, got {value!r}")
    return value


def check_meta(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise InvalidRequest(f"meta must be a JSON object, got {type(value).__name__}")
    return value


def estimate_tokens(value: Any) -> int:
    """A tokenizer-free guess of a request's cost: about 4 characters per token.

    Counts the text inside the input (strings in lists and objects too), plus 2 for
    the special tokens a model adds. Such a request is marked as estimated in Redis; a
    worker that can count writes the exact count before any batch is chosen.
    """
    return 2 + _text_length(value) // 4


def _text_length(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_length(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_length(v) for v in value)
    return 1 if value is not None else 0


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
        return _frozen(Result, data) if isinstance(data["id"], str) and isinstance(
            data["status"], str) else None
    if not isinstance(data.get("id"), str) or not isinstance(data.get("status"), str):
        return None
    return Result(**{k: data.get(k) for k in _RESULT_FIELDS if k in data})


def _loads_or_none(raw: Any) -> Any:
    try:
        return loads(raw)
    except ValueError:
        return None


def _frozen(cls: type, fields: dict[str, Any]) -> Any:
    """An instance of the frozen dataclass ``cls`` holding ``fields`` (every field, no
    other name; a dict of the caller's own, which becomes the instance's), built without
    its __init__: for messages read by the thousand, where the frozen __init__'s
    object.__setattr__ per field was a third of the decoding. Taking the dict rather
    than copying it saves an allocation per message, and with it garbage collections."""
    made = object.__new__(cls)
    object.__setattr__(made, "__dict__", fields)
    return made


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
        try:
            tokens, expire, enqueued, rank, priority, client, *tenant = (sched or "").split(":", 6)
            body, invalid = stored_body(payload)
            meta = body.get("meta")
            if invalid is None and meta is not None and not isinstance(meta, dict):
                invalid = f"its stored meta is not a JSON object (a {type(meta).__name__})"
            return _frozen(cls, {
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
