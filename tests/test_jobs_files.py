"""An offline job's file handling, without Redis: reading, validating, resuming."""

from __future__ import annotations

import io
import json
from pathlib import Path

from hypothesis import given, settings, strategies as st

from batchery.batching.messages import Result
from batchery.batching.settings import QueueSettings
from batchery.producer.jobs.files import (IdSet, Invalid, JobFiles, Line, LineParser, LineSet,
                                       errors_path, read_lines, recover)

SETTINGS = QueueSettings(max_request_bytes=100)


def parser() -> LineParser:
    return LineParser("job1", "batch", SETTINGS, count=lambda value: 3)


def verdict(raw: str | bytes | None, p: LineParser | None = None):
    data = raw.encode() if isinstance(raw, str) else raw
    return (p or parser()).parse(7, data)


def test_valid_lines_become_namespaced_requests() -> None:
    line = verdict('{"custom_id": "a", "input": {"text": "hi"}, "priority": "normal"}')
    assert isinstance(line, Line)
    assert (line.number, line.id_field, line.custom_id) == (7, "custom_id", "a")
    assert (line.request.id, line.request.priority, line.request.tokens) == ("job1:a", "normal", 3)
    by_id = verdict('{"id": 12, "input": "x", "deadline": 30}')
    assert (by_id.id_field, by_id.custom_id, by_id.request.id) == ("id", 12, "job1:12")
    assert by_id.request.priority == "batch" and by_id.request.deadline == 30.0
    anonymous = verdict('{"input": "x"}')
    assert anonymous.custom_id is None and anonymous.request.id == "job1#7"


def test_each_invalid_line_says_what_is_wrong() -> None:
    cases = {
        None: ("too_large", "over"),
        b"\xff\xfe{}": ("not_json", "UTF-8"),
        "{'single': 'quotes'}": ("not_json", "not JSON"),
        '{"input": NaN}': ("not_json", "NaN"),
        '"just a string"': ("not_object", "a string"),
        '{"custom_id": "a", "id": "b", "input": 1}': ("bad_id", "not both"),
        '{"custom_id": [1], "input": 1}': ("bad_id", "string or an integer"),
        '{"custom_id": "", "input": 1}': ("bad_id", "characters"),
        '{"custom_id": "a"}': ("no_input", "no \"input\""),
        '{"custom_id": "a", "input": 1, "extra": 2}': ("invalid", "'extra'"),
        '{"custom_id": "a", "input": 1, "deadline": -1}': ("invalid", "deadline"),
        '{"custom_id": "a", "input": 1, "priority": "later"}': ("invalid", "'later'"),
        '{"custom_id": "a", "input": "' + "x" * 200 + '"}': ("too_large", "max_request_bytes of 100"),
    }
    for raw, (code, words) in cases.items():
        found = verdict(raw)
        assert isinstance(found, Invalid) and found.number == 7, raw
        assert found.code == code and words in found.reason, (raw, found)
        assert "job1" not in found.reason  # the namespace is ours, not the user's


def test_first_line_with_an_id_wins_and_written_lines_still_count() -> None:
    p = parser()
    assert isinstance(p.parse(1, b'{"custom_id": "a"}'), Invalid)  # no input, yet it claims "a"
    dup = p.parse(2, b'{"custom_id": "a", "input": 1}')
    assert isinstance(dup, Invalid) and dup.code == "duplicate_id"
    assert p.parse(3, b'{"custom_id": "b", "input": 1}', written=True) is None
    assert p.parse(4, b'{"custom_id": "b", "input": 1}').code == "duplicate_id"
    assert p.parse(5, b'{"custom_id": 1, "input": 1}').request.id == "job1:1"
    assert p.parse(6, b'{"custom_id": "1", "input": 1}').code == "duplicate_id"


def test_read_lines_numbers_every_line_and_skips_overlong_ones_unread() -> None:
    data = b'{"a": 1}\n\n   \n' + b"x" * 5000 + b"\n" + b'{"b": 2}' 
    assert list(read_lines(io.BytesIO(data), limit=100)) == [
        (1, b'{"a": 1}\n'), (4, None), (5, b'{"b": 2}')]


def test_errors_path() -> None:
    assert errors_path(Path("/d/results.jsonl")) == Path("/d/results.errors.jsonl")
    assert errors_path(Path("/d/out.txt")) == Path("/d/out.txt.errors.jsonl")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), max_size=3000))
def test_id_set_behaves_like_a_set(values: list[str]) -> None:
    ids, reference = IdSet(capacity=8), set()
    for value in values:
        assert ids.add(value) == (value not in reference)
        reference.add(value)
    assert len(ids) == len(reference)


@given(st.sets(st.integers(min_value=1, max_value=100_000), max_size=300))
def test_line_set(numbers: set[int]) -> None:
    lines = LineSet()
    for n in numbers:
        lines.add(n)
    assert all(n in lines for n in numbers)
    assert not any(n in lines for n in range(0, 2000) if n not in numbers)


def test_recover_counts_what_was_written_and_cuts_a_torn_line(tmp_path: Path) -> None:
    out, err = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    p = parser()
    with JobFiles(out, err) as files:
        for n, status in ((1, "ok"), (2, "error"), (4, "ok")):
            files.result(p.parse(n, f'{{"custom_id": "c{n}", "input": 1}}'.encode()),
                         Result(id=f"job1:c{n}", status=status, output=n))
        files.invalid(p.parse(3, b"oops"))
    intact = out.read_bytes()
    with open(out, "ab") as f:
        f.write(b'{"custom_id": "c5", "li')
    written = recover(out, err)
    assert out.read_bytes() == intact
    assert (written.ok, written.failed, written.invalid) == (2, 1, 1)
    assert [n for n in range(1, 6) if n in written.lines] == [1, 2, 3, 4]
    first = json.loads(intact.splitlines()[0])
    assert first == {"custom_id": "c1", "line": 1, "status": "ok", "output": 1, "attempts": 0,
                     "queued_ms": None}
