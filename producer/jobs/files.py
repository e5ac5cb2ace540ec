"""An offline job's files: the JSONL input read line by line, validated into requests;
the result and error lines written as they come; what an earlier run already wrote.

Memory does not grow with the file: lines are read one at a time (a line over the limit
is skipped in slices, never held whole). Per line the job keeps one bit (written or not)
and about 16 bytes (its id's digest, to find duplicate ids).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from array import array
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from batchery.batching.messages import Result, dumps
from batchery.batching.request import (MAX_ID_LENGTH, REQUEST_FIELDS, Request, check_name,
                                      make_request, unknown_class)
from batchery.batching.settings import QueueSettings
from batchery.errors import InvalidRequest
from batchery.producer import openai_api

ERRORS_SUFFIX = ".errors.jsonl"
OPENAI = "openai"    # output format: OpenAI's batch output and error lines (else batchery's)
ID_FIELDS = ("custom_id", "id")
# A raw line may be longer than the request it holds (whitespace, \u escapes): up to this
# many times the queue's max_request_bytes is read; longer lines are refused unread.
LINE_SLACK = 8
SKIP_SLICE = 1 << 20  # a line over the limit is skipped in slices of this many bytes


def errors_path(output: Path) -> Path:
    """results.jsonl -> results.errors.jsonl (other names get the suffix appended)."""
    name = output.name[:-len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(name + ERRORS_SUFFIX)


def line_limit(settings: QueueSettings) -> int:
    return settings.max_request_bytes * LINE_SLACK + 4096


def read_lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number from 1, bytes) per non-blank line; bytes is None for a line over limit."""
    number = 0
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        number += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            while (rest := f.readline(SKIP_SLICE)) and not rest.endswith(b"\n"):
                pass
            yield number, None
        elif raw.strip():
            yield number, raw


def count_lines(path: Path, limit: int) -> int:
    """How many request lines (non-blank) the file holds."""
    with open(path, "rb") as f:
        return sum(1 for _ in read_lines(f, limit))


@dataclass(frozen=True)
class Line:
    """A valid input line, ready to enqueue."""

    number: int
    id_field: str            # the field the caller's id came in: custom_id or id
    custom_id: Any           # the caller's id as written (None: the line had none)
    request: Request         # its id carries the job's namespace
    call: Any = None         # an OpenAI batch line's Call (producer/openai_api.py)


@dataclass(frozen=True)
class Invalid:
    """An input line that cannot run; it goes to the errors file."""

    number: int
    custom_id: Any
    code: str                # not_json | not_object | bad_id | duplicate_id | no_input | too_large | invalid
    reason: str

    def record(self) -> dict[str, Any]:
        return {"line": self.number, "custom_id": self.custom_id, "error": self.code,
                "reason": self.reason}


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class LineParser:
    """Turns input lines into Lines (with namespaced request ids) or Invalids."""

    def __init__(self, job_id: str, priority: str | int, settings: QueueSettings,
                 count: Callable[[Any], int | None], expires_at: float | None = None,
                 tenant: str | None = None) -> None:
        self.job_id, self.priority, self.settings, self.count = job_id, priority, settings, count
        self.expires_at = expires_at  # epoch seconds: each request's deadline (a batch's window)
        self.tenant = job_id if tenant is None else tenant  # for lines that name none
        self.max_id = MAX_ID_LENGTH - len(job_id) - 1
        self.seen = IdSet()

    def parse(self, number: int, raw: bytes | None, written: bool = False) -> Line | Invalid | None:
        """The line's verdict; None for a line an earlier run wrote (its id still counts).
        Never raises: whatever one line holds makes that line Invalid, not the job fail."""
        try:
            verdict = self._identify(number, raw)
            if written:
                return None
            if isinstance(verdict, Invalid):
                return verdict
            return self._request(number, *verdict)
        except Exception as exc:  # the per-line boundary
            return Invalid(number, None, "invalid", f"line cannot be read ({type(exc).__name__}: "
                           f"{str(exc)[:200]})")

    def _identify(self, number: int, raw: bytes | None) -> tuple[dict[str, Any], str, Any] | Invalid:
        """The line's object and id (registered, so that a later line with it is a duplicate)."""
        obj = self._object(number, raw)
        if isinstance(obj, Invalid):
            return obj
        given = [f for f in ID_FIELDS if f in obj]
        if len(given) > 1:
            return Invalid(number, obj["custom_id"], "bad_id", "give custom_id or id, not both")
        field = given[0] if given else "custom_id"
        value = obj.get(field)
        if value is None:
            return obj, field, None
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return Invalid(number, None, "bad_id", f"{field} must be a string or an integer, "
                           f"got {_kind(value)}")
        try:
            text = check_name(value, field, self.max_id)
        except InvalidRequest as exc:
            return Invalid(number, value, "bad_id", str(exc))
        if not self.seen.add(text):
            return Invalid(number, value, "duplicate_id", f"duplicate {field} {text[:80]!r}: an "
                           "earlier line has it; ids must be unique within a file")
        return obj, field, value

    def _object(self, number: int, raw: bytes | None) -> dict[str, Any] | Invalid:
        if raw is None:
            return Invalid(number, None, "too_large", f"line is over {line_limit(self.settings)} "
                           "bytes; split the input or raise the queue's max_request_bytes")
        try:  # UTF-8 (a byte-order mark is allowed): json's own guess would take UTF-16 too
            obj = json.loads(raw.decode("utf-8-sig"), parse_constant=_no_constants)
        except UnicodeDecodeError:
            return Invalid(number, None, "not_json", "line is not UTF-8 text")
        except json.JSONDecodeError as exc:
            return Invalid(number, None, "not_json", f"line is not JSON ({exc.msg} at column "
                           f"{exc.colno})")
        except ValueError as exc:
            return Invalid(number, None, "not_json", f"line is not JSON ({exc})")
        except RecursionError:
            return Invalid(number, None, "not_json", "line is JSON nested too deeply to read; "
                           "flatten it")
        if not isinstance(obj, dict):
            return Invalid(number, None, "not_object", "line must be a JSON object like "
                           f'{{"custom_id": "a1", "input": ...}}, got {_kind(obj)}')
        return obj

    def _request(self, number: int, obj: dict[str, Any], field: str, value: Any) -> Line | Invalid:
        call = None
        if openai_api.is_batch_line(obj):  # {custom_id, method, url, body}: as OpenAI takes it
            try:
                call = openai_api.batch_call({k: v for k, v in obj.items() if k != field})
            except InvalidRequest as exc:
                return Invalid(number, value, "invalid", str(exc))
            obj = {field: value, "input": call.inputs[0]}
        unknown = set(obj) - {*ID_FIELDS, *REQUEST_FIELDS}
        if unknown:
            return Invalid(number, value, "invalid", f"unknown field(s) {sorted(unknown)}; allowed: "
                           "custom_id (or id), input, priority, deadline, tokens, meta, tenant")
        if "input" not in obj:
            return Invalid(number, value, "no_input", 'line has no "input"')
        request_id = f"{self.job_id}:{value}" if value is not None else f"{self.job_id}#{number}"
        fields = {k: v for k, v in obj.items() if k != field}
        fields["id"] = request_id
        if fields.get("priority") is None:  # absent or null: the job's priority
            fields["priority"] = self.priority
        if self.expires_at is not None:
            fields.setdefault("deadline", max(self.expires_at - time.time(), 0.001))
        try:
            request = make_request(fields, _no_new_ids, self.count, self.tenant)
            size = len(request.payload())
        except InvalidRequest as exc:  # its message names the namespaced id: drop that
            return Invalid(number, value, "invalid", str(exc).replace(f"request {request_id!r}: ", ""))
        why = unknown_class(request.priority, self.settings.class_delays)
        if why:
            return Invalid(number, value, "invalid", why)
        if size > self.settings.max_request_bytes:
            return Invalid(number, value, "too_large", f"input is {size} bytes, over the queue's "
                           f"max_request_bytes of {self.settings.max_request_bytes}; shorten it or "
                           "raise the limit with `batchery queue config QUEUE --max-request-bytes N`")
        return Line(number, field, value, request, call)


def jsonl(record: dict[str, Any]) -> bytes:
    """One output line: UTF-8 JSON; a string that is not valid Unicode (a refused line's
    custom_id holding a lone surrogate) is written as its \\u escape, as it was read, so
    every line can be written."""
    try:
        return dumps(record).encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(record, separators=(",", ":")).encode("ascii") + b"\n"


def _no_new_ids() -> str:
    raise AssertionError("job lines always carry an id")


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", dict: "an object", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


class IdSet:
    """A set of strings kept as 8-byte digests in one flat array (about 16 bytes an id).

    Two different ids share a digest with odds of about n**2 / 2**65 (1 in 370,000 for
    ten million ids); the later one would then be reported as a duplicate.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._slots = array("Q", [0]) * capacity
        self._used = 0

    def add(self, value: str) -> bool:
        """Add ``value``; False if it was there already."""
        digest = int.from_bytes(blake2b(value.encode("utf-8", "surrogatepass"),
                                        digest_size=8).digest(), "little") or 1
        if not self._insert(self._slots, digest):
            return False
        self._used += 1
        if 2 * self._used > len(self._slots):
            bigger = array("Q", [0]) * (2 * len(self._slots))
            for old in self._slots:
                if old:
                    self._insert(bigger, old)
            self._slots = bigger
        return True

    def __len__(self) -> int:
        return self._used

    @staticmethod
    def _insert(slots: array, digest: int) -> bool:
        mask = len(slots) - 1
        i = digest & mask
        while (held := slots[i]) != 0:
            if held == digest:
                return False
            i = (i + 1) & mask
        slots[i] = digest
        return True


class LineSet:
    """Line numbers, one bit each."""

    def __init__(self) -> None:
        self._bits = bytearray()

    def add(self, number: int) -> None:
        byte = number >> 3
        if byte >= len(self._bits):
            self._bits.extend(bytes(byte + 1 - len(self._bits) + len(self._bits) // 2))
        self._bits[byte] |= 1 << (number & 7)

    def __contains__(self, number: int) -> bool:
        byte = number >> 3
        return byte < len(self._bits) and bool(self._bits[byte] & (1 << (number & 7)))


@dataclass
class Written:
    """What earlier runs of a job wrote: the lines done and their outcome counts."""

    lines: LineSet
    ok: int = 0
    failed: int = 0    # result lines whose status is not ok
    invalid: int = 0   # lines in the errors file


def recover(output: Path, errors: Path) -> Written:
    """Read what earlier runs wrote; cut off a torn last line (a run killed mid-write)."""
    written = Written(LineSet())
    for path, is_output in ((output, True), (errors, False)):
        for record in _complete_records(path):
            number = record.get("line")
            if not isinstance(number, int):
                number = openai_api.line_of_record(record)
            if number is None or number in written.lines:
                continue
            written.lines.add(number)
            if not is_output:
                written.invalid += 1
            elif record.get("status") == "ok" or openai_api.batch_ok(record):
                written.ok += 1
            else:
                written.failed += 1
    return written


def _complete_records(path: Path) -> Iterator[dict[str, Any]]:
    """The file's JSON object lines, up to the first torn one, which is truncated away."""
    if not path.exists():
        return
    with open(path, "r+b") as f:
        good = 0
        for raw in iter(f.readline, b""):
            try:
                record = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:
                record = None
            if not isinstance(record, dict):
                f.truncate(good)
                return
            good += len(raw)
            yield record


def _append(path: Path) -> BinaryIO:
    try:
        return open(path, "ab")
    except OSError as exc:
        raise RuntimeError(f"cannot write {path}: {exc.strerror or exc}; fix the path, then "
                           "re-run the job (`rq requeue`): it resumes") from None


class JobFiles:
    """The output and errors files of one run, open for appending, locked against a twin run."""

    def __init__(self, output: Path, errors: Path, output_format: str = "batchery") -> None:
        self.openai = output_format == OPENAI
        self._out = _append(output)
        try:
            fcntl.flock(self._out, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._err = _append(errors)
        except BaseException as exc:
            self._out.close()
            if isinstance(exc, BlockingIOError):
                raise RuntimeError(f"{output} is being written by another run of this job") from None
            raise

    def __enter__(self) -> "JobFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def result(self, line: Line, result: Result) -> None:
        if self.openai:  # ok lines to the output, the others to the errors file
            ok, line_ = openai_api.batch_result_line(line.number, line.custom_id, line.call,
                                                     result, line.request.tokens)
            (self._out if ok else self._err).write(jsonl(line_))
            return
        record: dict[str, Any] = {line.id_field: line.custom_id, "line": line.number,
                                  "status": result.status, "output": result.output}
        if result.error:
            record["error"] = result.error
        record["attempts"] = result.attempts
        record["queued_ms"] = result.queued_ms
        self._out.write(jsonl(record))

    def invalid(self, line: Invalid) -> None:
        record = openai_api.batch_invalid_line(line.number, line.custom_id, line.reason) \
            if self.openai else line.record()
        self._err.write(jsonl(record))

    def flush(self) -> None:
        self._out.flush()
        self._err.flush()

    def sync(self) -> None:
        """Flush to the OS and to the disk (the finalizing step)."""
        self.flush()
        os.fsync(self._out.fileno())
        os.fsync(self._err.fileno())

    def close(self) -> None:
        self.flush()
        self._err.close()
        self._out.close()
