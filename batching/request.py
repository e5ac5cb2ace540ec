"""What a valid request is: its fields, their defaults and checks, its id and priority.

The one owner of these rules. The Client and the AsyncClient (producer/), offline jobs
(producer/jobs/files.py), the gateway and the CLI build requests through
``make_request`` / ``Request.validated`` and check single fields with the ``check_*``
functions, so a request refused in one place is refused, with the same reason, in all.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import secrets
from collections import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from batchery.batching.codec import encode, frozen
from batchery.batching.settings import CLASS_NAME, MAX_CLASS_DELAY_S
from batchery.errors import InvalidRequest

REQUEST_FIELDS = ("id", "input", "priority", "deadline", "tokens", "meta", "tenant")
_FIELD_SET = frozenset(REQUEST_FIELDS)
DEFAULT_PRIORITY = "normal"  # interactive-but-not-urgent: realtime overtakes it, batch waits
MAX_ID_LENGTH = 512          # a key name, stored in several keys and entries: a path or a URL fits
MAX_DEADLINE_S = 30 * 86_400  # a month: the longest offline job's window, with room
MAX_TOKENS = 10_000_000      # above any model's context: a price beyond it is a mistake
DEFAULT_TENANT = "default"  # whose share a request is served from when it names none
MAX_TENANT_LENGTH = 128     # a job id as tenant fits; stored in every request's sched entry

_CONTROL = re.compile(r"[\x00-\x1f]")


@dataclass(frozen=True)
class Request:
    """A request as a producer submits it, checked by :meth:`validated`."""

    id: str
    input: Any
    priority: str = DEFAULT_PRIORITY  # class name, or an integer: its delay in seconds
    deadline: float | None = None  # seconds from now; past it the request is expired
    tokens: int | None = None  # cost in tokens; None: estimated, and workers count it exactly
    meta: dict[str, Any] | None = None
    trace: str | None = None  # W3C traceparent of the producer's span (batchery/tracing.py)
    tenant: str = DEFAULT_TENANT  # who it is served for: fair share between tenants of a class
    # its id was made by the client that built it, and it has been in no enqueue call yet
    # (first_send): no such id can be known to the queue
    unsent_own_id: bool = field(default=False, init=False, repr=False, compare=False)

    @classmethod
    def validated(cls, id: Any, input: Any, priority: Any = DEFAULT_PRIORITY, deadline: Any = None,
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
        return frozen(Request, {"id": id, "input": input, "priority": self.priority,
                                 "deadline": self.deadline, "tokens": tokens, "meta": self.meta,
                                 "trace": None, "tenant": self.tenant, "unsent_own_id": True})

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
        if not 0 <= value <= MAX_CLASS_DELAY_S:
            raise InvalidRequest(f"integer priority is a delay in seconds, 0..{MAX_CLASS_DELAY_S}; "
                                 f"got {value}")
        return str(value)
    if isinstance(value, str) and CLASS_NAME.fullmatch(value):
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


# forks of this process so far, as a forked child counts them: a client made before a fork
# (a server's workers preloaded, a pool of forked processes) is in each child
_FORKS = [0]
os.register_at_fork(after_in_child=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


class RequestIds:
    """Unique request ids without a uuid per request: a random prefix and a counter, the
    prefix drawn again in a forked child (two children never make the same id: an id the
    client made skips the enqueue's duplicate check, first_send)."""

    def __init__(self) -> None:
        self._fork = -1

    def __call__(self) -> str:
        if self._fork != _FORKS[0]:
            self._fork, self._prefix, self._counter = _FORKS[0], secrets.token_hex(8), itertools.count()
        return f"{self._prefix}-{next(self._counter)}"


def make_request(fields: Mapping[str, Any], new_id: Callable[[], str],
                 count: Callable[[Any], int | None], tenant: str = DEFAULT_TENANT) -> Request:
    """A validated Request from a dict of REQUEST_FIELDS; raises InvalidRequest.
    ``tenant``: where the dict names none (or null)."""
    if not isinstance(fields, abc.Mapping):  # collections.abc: typing's isinstance is slow
        raise InvalidRequest(f"a request must be an object, got {type(fields).__name__}")
    if not fields.keys() <= _FIELD_SET:
        unknown = set(fields) - _FIELD_SET
        raise InvalidRequest(f"unknown request field(s) {sorted(map(str, unknown))}; "
                             f"allowed: {', '.join(REQUEST_FIELDS)}")
    if "input" not in fields:
        raise InvalidRequest("request has no 'input'")
    request_id = fields.get("id")
    made = Request.validated(id=new_id() if request_id is None else request_id,
                             input=fields["input"], priority=_given(fields, "priority", DEFAULT_PRIORITY),
                             deadline=fields.get("deadline"), tokens=fields.get("tokens"),
                             meta=fields.get("meta"), count=count,
                             tenant=_given(fields, "tenant", tenant))
    if request_id is None:
        object.__setattr__(made, "unsent_own_id", True)
    return made


def first_send(requests: Sequence[Request]) -> bool:
    """Whether every request's id was made by this client for it and none has been in an
    enqueue call before: then no such id can be known to the queue, and the enqueue skips
    its duplicate check (lua/enqueue.lua). Each is marked sent either way, so a request
    sent again (a refused group sent caller by caller, a call whose reply was lost, a
    sharded call another shard accepted a part of) is checked as any other. Called where
    every enqueue call is built (calls.enqueue_call)."""
    own = all(r.unsent_own_id for r in requests)
    for r in requests:
        if r.unsent_own_id:
            object.__setattr__(r, "unsent_own_id", False)
    return own


def _given(fields: Mapping[str, Any], name: str, default: Any) -> Any:
    """A field's value; ``default`` only where it is absent or null (0 and "" are values:
    the check says whether they are valid)."""
    value = fields.get(name)
    return default if value is None else value


def map_requests(values: Iterable[Any], priority: str | int, deadline: float | None,
                 new_id: Callable[[], str], count: Callable[[Any], int | None],
                 tenant: str = DEFAULT_TENANT) -> Iterator[Request]:
    """``map``'s requests, drawn lazily: the first checked whole (make_request), the others
    sharing its priority, deadline and meta, built without the frozen __init__ under ids
    of ours (valid as made), ``count`` read at each draw (the queue's tokenizer may change)."""
    first: Request | None = None
    for value in values:
        if first is None:
            yield (first := make_request({"input": value, "priority": priority, "deadline": deadline},
                                         new_id, count, tenant))
        else:
            yield first.alike(new_id(), value, count(value))


