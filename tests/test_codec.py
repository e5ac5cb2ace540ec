"""batching/codec.py reads and writes what the json module would: orjson does the work,
and json decides wherever their rules differ (NaN, integers beyond 64 bits, keys that are
not strings, lone surrogates, text json reads and orjson refuses)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from batchery.batching import codec
from batchery.batching.messages import Claimed, Result
from batchery.workers import metrics

STRICT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8) | st.integers() | st.booleans() | st.none(), inner, max_size=4),
    max_leaves=15)


def json_verdict(value: Any) -> Any:
    """What the json module makes of ``value``: the value it reads back, or its error."""
    try:
        return json.loads(STRICT.encode(value).encode("utf-8"))
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


def codec_verdict(value: Any) -> Any:
    try:
        return codec.loads(codec.encode(value))
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


def same(a: Any, b: Any) -> bool:
    """Equal, NaN included, and of the same types (an int read back as a float is not)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@given(values)
def test_what_is_accepted_and_read_back_is_what_json_does(value: Any) -> None:
    assert same(codec_verdict(value), json_verdict(value))


@pytest.mark.parametrize("value", [
    float("nan"), [1.0, float("inf")], {"a": {"b": -math.inf}},  # orjson: null; json: ValueError
    2 ** 64, -2 ** 63 - 1, [10 ** 40], {1: "a", None: "b"},       # orjson refuses; json takes
    [[[[]]]] * 3, "\x00\x1f\u2028🙂", -0.0, 1e-05, 1e16, None, {"null": "null"},
])
def test_the_cases_where_the_two_differ(value: Any) -> None:
    assert same(codec_verdict(value), json_verdict(value))


def test_lone_surrogates_are_refused_or_replaced() -> None:
    with pytest.raises(UnicodeEncodeError):
        codec.encode({"input": "a\ud800b"})
    assert codec.encode({"input": "a\ud800b"}, errors="replace") == b'{"input":"a?b"}'


@pytest.mark.parametrize("text", ['123456789012345678901234567890', '[-9223372036854775809]',
                                  '{"a": 18446744073709551616}', 'NaN', '[1e400]', '"\\ud800"',
                                  '[' * 300 + ']' * 300, '{"a": 0.00012345678901234567}',
                                  '12345678901234567890', '[0.5,-12345678901234567890.5]',
                                  '[0.0012345678901234567, 1.5e-7, 12345678901234567890]'])
def test_text_is_read_as_json_reads_it(text: str) -> None:
    assert same(codec.loads(text), json.loads(text))
    assert same(codec.loads(text.encode()), json.loads(text))


LONG_AND_SHORT = ['12345678901234567890', '[1, 2]', '1234567890123456789', '{"a": 0.5}',
                  '"12345678901234567890"', 'NaN', '[1e400]', '"\\ud800"', '7']


@pytest.mark.parametrize("texts", [LONG_AND_SHORT, LONG_AND_SHORT[1:], LONG_AND_SHORT[3:4],
                                   ['1', '2345678901234567890123'], ['{"a": 1}', '"\ud800"']])
def test_texts_read_together_as_each_is_read(texts: list[str]) -> None:
    """A reply list's bulk read: one long-integer scan over them all (a long integer
    anywhere reads each alone), each text still read as json reads it."""
    assert same(codec.loads_many(texts), [json.loads(t) for t in texts])


def test_results_read_together_as_each_is_read() -> None:
    raws = [Result(id=f"r{i}", status="ok", output=i, attempts=1).to_json() for i in range(3)]
    raws.append('{"id": "r9", "status": "error", "error": {"type": "X", "message": "m"}}')
    assert Result.from_json_many(raws) == [Result.from_json(r) for r in raws]


@pytest.mark.parametrize("text", ['{"a": ', "{'a': 1}", "", "\xff"])
def test_text_that_is_not_json_gets_json_s_error(text: str) -> None:
    with pytest.raises(ValueError) as expected:
        json.loads(text)
    with pytest.raises(ValueError, match=str(expected.value).replace("(", r"\(").replace(")", r"\)")):
        codec.loads(text)


def test_a_message_checks_only_its_value() -> None:
    message = {"id": "r1", "output": None, "error": None, "run_ms": 0.5}
    assert codec.encode_message(message, "output") == STRICT.encode(message).encode()
    with pytest.raises(ValueError, match="Out of range float"):
        codec.encode_message({"id": "r1", "output": [math.nan]}, "output")
    assert codec.encode_message({"id": "r\ud800", "output": 1}, "output", errors="replace") \
        == b'{"id":"r?","output":1}'


def test_messages_read_back_equal_those_built_field_by_field() -> None:
    result = Result(id="r1", status="ok", output=[0.5, None], attempts=1, worker="w",
                    batch_size=3, queued_ms=4, run_ms=0.25)
    read = Result.from_json(result.to_json())
    assert read == result and read.ok
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.status = "error"  # type: ignore[misc]
    assert Result.from_json('{"id": "r2", "status": "dead"}') == Result(id="r2", status="dead")
    claimed = Claimed.decode("r3", '{"input": "hi", "meta": {"k": 1}}', "~7:0:100:200:batch:c9", "2", "w#1")
    assert claimed == Claimed(id="r3", input="hi", meta={"k": 1}, tokens=7, enqueued_ms=100,
                              expire_ms=0, priority="batch", attempt=3, lease_token="w#1",
                              rank=200, client="c9")
    broken = Claimed.decode("r4", "{not json", "1:0:1:1:normal:", None, "w#2")
    assert broken.input is None and broken.invalid.startswith("its stored request is not JSON (")


def test_observe_all_adds_what_observe_adds_one_by_one() -> None:
    registry = CollectorRegistry()
    one, bulk = (Histogram(name, "", buckets=metrics.SECONDS_BUCKETS, registry=registry)
                 for name in ("one", "bulk"))
    waits = [0, 0.001, 0.0011, 0.5, 2.5, 600, 601, 0.25, 0.001, 1e9]
    for wait in waits:
        one.observe(wait)
    metrics.observe_all(bulk, waits)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}
    by_one = {key: v for key, v in samples.items() if key[0].startswith("one")}
    in_bulk = {(name.replace("bulk", "one", 1), labels): v
               for (name, labels), v in samples.items() if name.startswith("bulk")}
    assert in_bulk == by_one and by_one[("one_count", ())] == len(waits)
