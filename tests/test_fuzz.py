"""Arbitrary input never crashes anything: enqueue refuses it clearly or accepts it, and a
running worker (the real MiniLM model) answers each accepted request and keeps serving."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from batchery import Client, InvalidRequest
from batchery.batching.request import Request
from tests.conftest import RedisServer, examples, start_worker, stop_process, wait_for

pytestmark = pytest.mark.slow

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=300),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20)
awkward = st.sampled_from([
    "", " ", "x" * 2_000_000, "\x00\x01", "日本語のテキスト", "🙂" * 1000, float("inf"),
    {"text": None}, {"text": ["a"]}, {"text": "fine"}, [], {}, 10 ** 40, -0.0,
])
lone_surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                          max_size=3)
field_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 10 ** 9), st.floats(),
                         st.text(max_size=20), st.lists(st.integers(), max_size=2))


@pytest.fixture(scope="module")
def served(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """One MiniLM worker for the module (loading it takes seconds); each test submits and
    checks its own requests."""
    log = tmp_path_factory.mktemp("fuzz") / "worker.log"
    worker = start_worker(redis_server.url, "fuzz", "--task", "embed", "--model", "minilm",
                          "--device", "cpu", "--max-batch-size", "16", log=log)
    client = Client(redis_server.url, "fuzz")
    wait_for(lambda: client.queue.stats()["workers"] == 1, 120, message="the MiniLM worker")
    yield client, worker, log
    client.close()
    stop_process(worker)


def submit(client: Client, accepted: list, fields: dict[str, Any]) -> None:
    try:
        accepted.append(client.enqueue_many([fields])[0])
    except InvalidRequest as exc:  # RequestTooLarge is one too
        assert str(exc) and "Traceback" not in str(exc)


def answered(served: tuple, handles: list) -> list:
    """Every accepted request ends with a result that says what happened; the worker lives."""
    _, worker, log = served
    results = [h.result(timeout=120) for h in handles]
    for handle, result in zip(handles, results):
        assert result.id == handle.id  # never another request's result
        assert result.status in ("ok", "error", "expired"), result
        if result.status == "ok":
            assert len(result.output) == 384
        else:
            assert result.error["message"]
    assert worker.poll() is None
    assert "Traceback" not in Path(log).read_text()
    return results


def test_any_input_is_refused_clearly_or_answered(served: tuple) -> None:
    client, accepted = served[0], []

    @given(st.one_of(json_values, awkward, lone_surrogates))
    @settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def enqueue(value: Any) -> None:
        submit(client, accepted, {"input": value})
    enqueue()
    results = answered(served, accepted)
    assert len(results) >= 30, "too few inputs accepted to say the worker copes with them"
    assert {r.status for r in results} >= {"ok", "error"}  # texts embedded, others refused


def test_any_request_fields_are_refused_clearly_or_accepted(served: tuple) -> None:
    client, accepted = served[0], []

    # Drawn at random, about one in thirteen has every field valid (600 draws: 46), so a
    # run of 150 may accept fewer than ten: these are accepted whatever is drawn
    valid = [{"input": "text"}, {"input": "text", "priority": 0, "deadline": 30, "tokens": 3,
                                 "meta": None, "id": "fuzz-valid-1"},
             {"input": "text", "priority": "batch", "meta": {"k": [1]}, "id": "fuzz-valid-2"}]

    @given(st.fixed_dictionaries({"input": st.just("text")},
                                 optional={"priority": field_values, "deadline": field_values,
                                           "tokens": field_values, "meta": field_values,
                                           "id": field_values}))
    @settings(max_examples=examples(150), deadline=None)
    def enqueue(fields: dict) -> None:
        submit(client, accepted, fields)
    for fields in valid:
        enqueue = example(fields)(enqueue)
    enqueue()
    assert {"fuzz-valid-1", "fuzz-valid-2"} <= {h.id for h in accepted}
    results = answered(served, accepted)
    assert len(results) >= len(valid) and sum(r.ok for r in results) >= len(valid)


def test_bytes_that_are_not_json_fail_alone_and_the_worker_keeps_serving(served: tuple) -> None:
    client, worker, _ = served
    garbage = Request.validated(id=f"garbage-{uuid.uuid4().hex[:8]}", input="replaced below")
    worker.send_signal(signal.SIGSTOP)  # so it cannot claim the request before it is replaced
    try:
        client.queue.enqueue([garbage], client.client_id)
        client.queue.client.hset(client.queue.keys.requests, garbage.id, b"\xff\xfe{not json")
    finally:
        worker.send_signal(signal.SIGCONT)
    fine = client.enqueue("a fine one")
    broken, ok = answered(served, [client.handle(garbage.id), fine])
    assert broken.status == "error" and "not JSON" in broken.error["message"]
    assert ok.ok and len(ok.output) == 384
