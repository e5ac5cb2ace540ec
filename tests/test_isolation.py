"""One request's fault stays its own: whatever a request holds (planted in Redis, or given
through the client, the CLI or a job file), its batch-mates finish, it ends with its own
result, no waiter gets another id's result, and nothing is refused silently."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchery import AsyncClient, Client, InvalidRequest, Result
from batchery.batching.codec import loads
from batchery.batching.keys import check_queue_name
from batchery.batching.request import check_name, check_priority
from batchery.batching.settings import QueueSettings
from batchery.connection import RedisSettings
from batchery.errors import ConfigError
from batchery.workers.loop import Worker
from batchery.workers.options import WorkerOptions
from batchery.workers.runners.base import Prepared, Runner
from tests.conftest import ROOT, cli_env, examples, run_cli

DEEP = 100_000  # nesting far past the interpreter's recursion limit


class Picky(Runner):
    """Echoes each input; a batch holding "bad" raises (a shared step failing because of
    one request). Records the size of every model call."""

    warmup_inputs = ["warm up"]

    def __init__(self) -> None:
        self.runs: list[int] = []

    def prepare(self, inputs: list[Any]) -> Prepared:
        return Prepared(list(inputs), [1] * len(inputs), len(inputs))

    def run(self, data: Any) -> list[Any]:
        self.runs.append(len(data))
        if "bad" in data:
            raise RuntimeError("cannot process 'bad'")
        return [{"echo": v} for v in data]


def drain(redis_url: str, queue: str, runner: Runner | None = None, **options: Any) -> Runner:
    runner = runner or Picky()
    Worker(RedisSettings.from_url(redis_url), runner,
           WorkerOptions(queue=queue, max_wait_ms=0, **options)).run(burst=True,
                                                                     handle_signals=False)
    return runner


def deep_json(depth: int) -> str:
    return '{"input": ' + "[" * depth + "]" * depth + "}"


def test_a_stored_request_nested_too_deep_fails_alone_and_its_batch_runs(
        redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": f"text {i}"} for i in range(8)])
        victim = handles[3]
        client.queue.client.hset(client.queue.first.keys.requests, victim.id, deep_json(DEEP))
        drain(redis_url, queue_name)
        results = {h.id: h.result(timeout=30) for h in handles}
        assert client.queue.stats()["inflight"] == 0
    bad = results.pop(victim.id)
    assert bad.status == "error" and bad.attempts == 1
    assert bad.error["type"] == "InvalidRequest" and "nested too deeply" in bad.error["message"]
    assert all(r.ok and r.attempts == 1 for r in results.values())
    assert [r.output for r in results.values()] == [{"echo": f"text {i}"} for i in range(8) if i != 3]


def test_bisection_finds_one_bad_request_in_64_in_a_few_runs(redis_url: str,
                                                               queue_name: str) -> None:
    inputs = [f"text {i}" for i in range(64)]
    inputs[41] = "bad"
    with Client(redis_url, queue_name) as client:
        client.queue.update_settings(max_attempts=1)
        handles = client.enqueue_many([{"input": v} for v in inputs])
        runner = drain(redis_url, queue_name, max_batch_size=64)
        results = [h.result(timeout=30) for h in handles]
    real = runner.runs[1:]  # after the warm-up
    assert real[0] == 64  # one batch, then halves: 32, 16, 8, 4, 2, 1 on the bad side
    assert len(real) <= 1 + 2 * 6, real
    assert results[41].status == "dead" and "cannot process" in results[41].error["message"]
    assert all(r.ok for i, r in enumerate(results) if i != 41)
    # batch-mates ran in the halves that passed, not one at a time
    assert sum(r.batch_size == 1 for r in results) <= 2


def test_any_output_that_cannot_be_written_fails_its_request_alone(redis_url: str,
                                                                    queue_name: str) -> None:
    class DeepOutput(Picky):
        def run(self, data: Any) -> list[Any]:
            outputs: list[Any] = super().run(data)
            if "deep" in data:
                nested: Any = []
                for _ in range(DEEP):
                    nested = [nested]
                outputs[data.index("deep")] = nested
            return outputs
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": v} for v in ("a", "deep", "b")])
        drain(redis_url, queue_name, DeepOutput())
        a, deep, b = [h.result(timeout=30) for h in handles]
    assert a.ok and b.ok and a.output == {"echo": "a"}
    assert deep.status == "error" and deep.error["type"] == "OutputNotJSON"


# -- names ----------------------------------------------------------------------------------
names = st.one_of(
    st.text(max_size=30),
    st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
    .map(lambda s: "doc-" + s),
    st.text(st.characters(max_codepoint=0x1F), min_size=1, max_size=3),
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["x" * 10_000, "x" * 512, "doc-?", "doc-\udcff", "doc-\udcfe", ""]))


@given(names)
@settings(max_examples=examples(200))
def test_the_name_rule_accepts_only_utf8_text_without_control_characters(value: Any) -> None:
    text = str(value)
    valid = (0 < len(text) <= 512 and not any(ord(c) < 32 for c in text)
             and not any(0xD800 <= ord(c) <= 0xDFFF for c in text))
    if valid:
        assert check_name(value, "request id") == text
    else:
        with pytest.raises(InvalidRequest, match="request id"):
            check_name(value, "request id")


word_like = st.one_of(  # names of the rules' own alphabets, a control character or space in some
    st.text(alphabet="abz09_-.AZ\n\r\t ", max_size=70),
    st.text(alphabet="abz09_-", min_size=1, max_size=33).map(lambda s: s + "\n"),
    st.sampled_from(["inf", "nan", "infinity", "inf\n", "normal\n", "a" * 64, "a" * 65]))


@given(word_like)
@settings(max_examples=examples(200))
def test_queue_and_class_names_are_whole_words_of_their_alphabet(text: str) -> None:
    """The queue name and priority class rules (every place they are checked) accept a
    name exactly when all of it, to its last character, is of the rule's alphabet and
    length: nothing led or ended by a newline passes."""
    queue_ok = 1 <= len(text) <= 64 and all(c.isascii() and (c.isalnum() or c in "_.-")
                                             for c in text)
    class_ok = (1 <= len(text) <= 32 and "a" <= text[0] <= "z"
                and all(c.isascii() and (c.islower() or c.isdigit() or c in "_-") for c in text)
                and text not in ("inf", "infinity", "nan"))
    if queue_ok:
        assert check_queue_name(text) == text
    else:
        with pytest.raises(ConfigError, match="queue name"):
            check_queue_name(text)
    if class_ok:
        assert check_priority(text) == text
        assert QueueSettings().updated(class_delays={text: 1.0}).class_delays[text] == 1.0
    else:
        with pytest.raises(InvalidRequest, match="priority"):
            check_priority(text)
        with pytest.raises(ConfigError, match="priority class"):
            QueueSettings().updated(class_delays={text: 1.0})


def test_ids_never_merge_nor_get_anothers_result(redis_url: str, queue_name: str) -> None:
    """Each accepted id is its own key with its own result, through the sync client and the
    AsyncClient alike; ids that are not valid UTF-8 are refused, never rewritten."""
    accepted: dict[str, Any] = {}
    refused: list[Any] = []

    async def async_enqueue(ids: list[Any]) -> list[Any]:
        async with AsyncClient(redis_url, queue_name) as ac:
            out = []
            for i in ids:
                try:
                    out.append(await ac.enqueue({"id": i}, id=i))
                except InvalidRequest:
                    out.append(None)
            return out

    with Client(redis_url, queue_name) as client:
        @given(st.lists(names, min_size=1, max_size=4, unique_by=str))
        @settings(max_examples=examples(60), deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        def enqueue(ids: list[Any]) -> None:
            fresh = [i for i in ids if str(i) not in accepted]
            half = len(fresh) // 2
            for i in fresh[:half]:
                try:
                    client.enqueue({"id": i}, id=i)
                    accepted[str(i)] = i
                except InvalidRequest as exc:
                    assert str(exc) and "Traceback" not in str(exc)
                    refused.append(i)
            for i, handle in zip(fresh[half:], asyncio.run(async_enqueue(fresh[half:]))):
                if handle is None:
                    refused.append(i)
                else:
                    accepted[str(i)] = i
        enqueue()
        for doomed in ("doc-\udcff", "doc-\udcfe"):
            with pytest.raises(InvalidRequest, match="lone surrogate"):
                client.enqueue("x", id=doomed)
            with pytest.raises(InvalidRequest, match="lone surrogate"):
                asyncio.run(async_enqueue_one(redis_url, queue_name, doomed))
        assert refused and accepted
        drain(redis_url, queue_name)
        for text, given_id in accepted.items():
            result = client.handle(text).result(timeout=30)
            assert result.id == text and result.ok, result
            assert result.output == {"echo": {"id": given_id}}
        assert client.queue.stats()["pending"] == 0


async def async_enqueue_one(redis_url: str, queue: str, request_id: str) -> Any:
    async with AsyncClient(redis_url, queue) as ac:
        return await ac.enqueue("x", id=request_id)


# -- falsy values -----------------------------------------------------------------------------
def stored_class(client: Client, request_id: str) -> str:
    return client.queue.client.hget(client.queue.first.keys.sched, request_id).split(":")[4]


def test_priority_zero_is_the_most_urgent_delay_not_normal(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        client.enqueue("normal", id="n")
        client.enqueue("zero", id="z", priority=0)
        assert stored_class(client, "z") == "realtime"  # delay 0: reported as realtime
        for empty in ("", None):
            if empty is None:
                client.enqueue("default", id="d", priority=None)  # type: ignore[arg-type]
                assert stored_class(client, "d") == "normal"
            else:
                with pytest.raises(InvalidRequest, match="priority"):
                    client.enqueue("x", priority=empty)
        first = client.queue.claim("w#1", 1, 10_000, 0, 10).batch
        assert [r.id for r in first] == ["z"]  # enqueued after "n", ranked before it
    done = run_cli("enqueue", "--text", "cli", "--id", "c0", "-p", "0", "-q", queue_name,
                   redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    with Client(redis_url, queue_name) as client:
        assert stored_class(client, "c0") == "realtime"


def test_the_cli_checks_every_option_before_it_writes(redis_url: str, queue_name: str) -> None:
    done = run_cli("enqueue", "--wait", "--timeout", "-5", "--text", "hi", "-q", queue_name,
                   redis_url=redis_url)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--timeout" in done.stderr and "below 0" in done.stderr
    deep = "[" * 50_000 + "]" * 50_000  # one argument holds at most 128 KiB
    done = run_cli("enqueue", "--input", deep, "-q", queue_name, redis_url=redis_url)
    assert done.returncode == 2 and "nested too deeply" in done.stderr, done.stderr
    env = cli_env(redis_url)
    for args in (["enqueue", "--text", "x", "--id", b"doc-\xff"],
                 ["request", "get", b"doc-\xff"], ["request", "cancel", b"doc-\xfe"]):
        command = [sys.executable.encode(), b"-m", b"batchery",
                   *(a if isinstance(a, bytes) else a.encode() for a in args),
                   b"-q", queue_name.encode()]
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=60)
        stderr = proc.stderr.decode("utf-8", "replace")
        assert proc.returncode == 2, (args, stderr)
        assert "Traceback" not in stderr and "UTF-8" in stderr.replace("Unicode", "UTF-8")
    with Client(redis_url, queue_name) as client:
        assert client.queue.stats()["pending"] == 0  # nothing was written


# -- job lines ----------------------------------------------------------------------------------
def test_one_odd_line_never_fails_an_offline_job(redis_url: str, queue_name: str,
                                                 tmp_path: Path) -> None:
    from tests.jobs_helpers import read_jsonl, start_jobs_worker, submit, wait_state
    from tests.conftest import start_worker, stop_process
    source = tmp_path / "in.jsonl"
    with open(source, "w", encoding="utf-8") as f:
        f.write(json.dumps({"custom_id": "a", "input": "one"}) + "\n")
        f.write('{"custom_id": "deep", "input": ' + "[" * DEEP + "]" * DEEP + "}\n")
        f.write('{"custom_id": "doc-\\udcff", "input": "surrogate id"}\n')
        f.write(json.dumps({"custom_id": "b", "input": "two", "priority": None}) + "\n")
        f.write(json.dumps({"custom_id": "c", "input": "three", "priority": 0}) + "\n")
    jobs_queue = f"jobs-{queue_name}"
    jobs = start_jobs_worker(redis_url, jobs_queue)
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo")
    try:
        job = submit(redis_url, jobs_queue, queue_name, source, tmp_path / "out.jsonl",
                     "--priority", "batch")
        state = wait_state(redis_url, job, "finished", "failed", timeout=90)
    finally:
        stop_process(jobs)
        stop_process(worker)
    assert state["state"] == "finished", state
    out = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert sorted(out) == ["a", "b", "c"] and all(r["status"] == "ok" for r in out.values())
    raw_errors = (tmp_path / "out.errors.jsonl").read_bytes().decode("utf-8").splitlines()
    errors = {e["line"]: e for e in map(json.loads, raw_errors)}
    assert errors[2]["error"] == "not_json" and "nested too deeply" in errors[2]["reason"]
    assert errors[3]["error"] == "bad_id" and "lone surrogate" in errors[3]["reason"]
    assert errors[3]["custom_id"] == "doc-\udcff"  # written back as it was read


def test_a_job_lines_null_priority_is_the_jobs_and_zero_is_zero(redis_url: str,
                                                                queue_name: str) -> None:
    from batchery.batching.settings import QueueSettings
    from batchery.producer.jobs.files import Line, LineParser
    parser = LineParser("job1", "batch", QueueSettings(), lambda _: None)
    lines = [parser.parse(n, json.dumps(obj).encode()) for n, obj in enumerate((
        {"custom_id": "a", "input": 1, "priority": None},
        {"custom_id": "b", "input": 1, "priority": 0},
        {"custom_id": "c", "input": 1}), 1)]
    assert all(isinstance(line, Line) for line in lines)
    assert [line.request.priority for line in lines] == ["batch", "0", "batch"]
    assert parser.parse(4, b'{"custom_id": "d", "input": 1, "priority": ""}').code == "invalid"


# -- planted payloads, by property --------------------------------------------------------------
planted = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4),
                                                                              inner, max_size=3),
                 max_leaves=8).map(lambda v: json.dumps(v).encode()),
    st.sampled_from([deep_json(DEEP).encode(), b'{"input": 1, "meta": 5}', b"", b"null",
                     b'{"input": "bad"}', b'{"meta": {}}', b"\xff\xfe{}"]))


def plant_and_drain(client: Client, redis_url: str, queue_name: str, key: str,
                    planted_values: list[bytes]) -> tuple[list[Any], list[Any]]:
    """6 + n good requests; every other one from the second gets one of the n values planted
    as its field of the hash ``key``; a worker drains the queue (batches of 8). Returns
    (handles, the planted ones' handles)."""
    handles = client.enqueue_many([{"input": f"good {i}"} for i in range(6 + len(planted_values))])
    victims = handles[1::2][:len(planted_values)]
    for handle, value in zip(victims, planted_values):
        client.queue.client.hset(key, handle.id, value)
    drain(redis_url, queue_name, max_batch_size=8)
    return handles, victims


def test_any_planted_payload_changes_no_other_requests_outcome(redis_url: str,
                                                                queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        client.queue.update_settings(max_attempts=1)
        requests_key = client.queue.first.keys.requests

        @given(st.lists(planted, min_size=1, max_size=4))
        @settings(max_examples=examples(40), deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        def run(payloads: list[bytes]) -> None:
            handles, victims = plant_and_drain(client, redis_url, queue_name, requests_key, payloads)
            for i, handle in enumerate(handles):
                result = handle.result(timeout=30)
                assert result.id == handle.id
                if handle in victims:
                    assert result.status in ("ok", "error", "dead"), result
                    if result.ok:  # a payload that is a request after all runs as one
                        assert result.output == {"echo": loads(payloads[victims.index(handle)])["input"]}
                else:
                    assert result.ok and result.output == {"echo": f"good {i}"}, result
            assert client.queue.stats()["inflight"] == 0 and client.queue.stats()["pending"] == 0
        run()


def test_a_request_whose_schedule_entry_cannot_be_read_fails_alone(redis_url: str,
                                                                   queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": f"text {i}"} for i in range(4)])
        victim = handles[1]
        client.queue.client.hset(client.queue.first.keys.sched, victim.id, "1:0:0:x:normal:c")
        drain(redis_url, queue_name)
        bad = client.get(victim.id)
        assert bad is not None and bad.status == "error", bad
        assert "schedule entry" in bad.error["message"] and bad.attempts == 1
        assert all(h.result(timeout=30).ok for h in handles if h is not victim)
        assert client.queue.stats()["pending"] == 0 and client.queue.stats()["inflight"] == 0


planted_entries = st.one_of(
    st.text(max_size=48),
    st.from_regex(r"~?[0-9]{0,3}:[0-9x]{0,3}:[0-9]{0,4}:[0-9x-]{0,4}:[a-z]{0,6}(:[a-z]{0,3}){0,3}",
                  fullmatch=True),
    st.sampled_from(["", ":", "~", "12", "1:0:0:x:normal:c", "1:0:5:x:normal:c:t",
                     "~7:0:0:0::", "9" * 400 + ":0:0:0:normal:c"]))


def test_any_planted_schedule_entry_changes_no_other_requests_outcome(redis_url: str,
                                                                      queue_name: str) -> None:
    """A request's schedule entry (its tokens, deadline, times, class, client, tenant, as
    Redis holds it) damaged: the claim neither stops nor drops it; it ends with its own
    result and its batch-mates run."""
    with Client(redis_url, queue_name) as client:
        client.queue.update_settings(max_attempts=1)
        sched_key = client.queue.first.keys.sched

        @given(st.lists(planted_entries, min_size=1, max_size=4))
        @settings(max_examples=examples(40), deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        def run(entries: list[str]) -> None:
            handles, victims = plant_and_drain(client, redis_url, queue_name, sched_key,
                                               [e.encode("utf-8", "surrogatepass") for e in entries])
            for i, handle in enumerate(handles):
                if handle in victims:  # stored under its id (its client, in the entry, is lost:
                    result = client.get(handle.id)  # a waiter finds it by polling, not pushed)
                    assert result is not None and result.status in ("ok", "error", "dead", "expired")
                else:
                    result = handle.result(timeout=30)
                    assert result.ok and result.output == {"echo": f"good {i}"}, result
                assert result.id == handle.id
            assert client.queue.stats()["inflight"] == 0 and client.queue.stats()["pending"] == 0
        run()


def test_a_cancel_reaches_every_request_whatever_their_schedule_entries_hold(
        redis_url: str, queue_name: str) -> None:
    """Cancelling queued requests, some of whose schedule entries were damaged: the call
    answers for each (no traceback: the client field of an entry it cannot read is taken
    as none) and the undamaged ones end cancelled, their waiters told."""
    with Client(redis_url, queue_name) as client:
        sched_key = client.queue.first.keys.sched

        @given(st.lists(planted_entries, min_size=1, max_size=4))
        @settings(max_examples=examples(40), deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        def run(entries: list[str]) -> None:
            handles = client.enqueue_many([{"input": f"queued {i}"} for i in range(2 * len(entries) + 1)])
            victims = handles[1::2][:len(entries)]
            for handle, value in zip(victims, entries):
                client.queue.client.hset(sched_key, handle.id, value.encode("utf-8", "surrogatepass"))
            answers = client.queue.cancel([h.id for h in handles])
            assert len(answers) == len(handles)
            for handle, answer in zip(handles, answers):
                if handle not in victims:
                    assert answer == 1 and handle.result(timeout=30).status == "cancelled"
        run()


# -- results read back ------------------------------------------------------------------------
def test_garbage_on_a_reply_list_or_in_a_result_fails_no_other_waiter(redis_url: str,
                                                                       queue_name: str) -> None:
    import threading
    with Client(redis_url, queue_name) as client:
        first = client.enqueue("first")
        drain(redis_url, queue_name)
        assert first.result(timeout=30).ok  # the reply listener runs
        store, keys = client.queue.client, client.queue.first.keys
        store.rpush(keys.reply(client.client_id), b"\xff\xfe", "5", '{"id": 1}', deep_json(DEEP))
        handles = client.enqueue_many([{"input": f"text {i}"} for i in range(5)])
        drain(redis_url, queue_name)
        assert [h.result(timeout=30).output for h in handles] == [{"echo": f"text {i}"}
                                                                for i in range(5)]
        assert any(t.name == "batchery-replies" and t.is_alive() for t in threading.enumerate())
        assert store.llen(keys.reply(client.client_id)) == 0
        # a result key overwritten by something else: that request's own error
        store.set(keys.result(handles[2].id), "not a result")
        store.set(keys.result(handles[3].id), Result(handles[3].id, "ok", 3).to_json())
        found = client.queue.lookup([handles[2].id, handles[3].id])
        assert found[0].id == handles[2].id and found[0].error["type"] == "ResultUnreadable"
        assert found[1] == Result(handles[3].id, "ok", 3)
        assert client.get(handles[2].id).status == "error"


def test_a_damaged_attempt_count_fails_its_request_alone(redis_url: str, queue_name: str) -> None:
    """Whatever else Redis holds for one request that cannot be read (here its attempt
    count) fails that request alone at the claim's boundary, not the claim."""
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": f"text {i}"} for i in range(4)])
        client.queue.client.hset(client.queue.first.keys.attempts, handles[1].id, "not a count")
        drain(redis_url, queue_name)
        results = [h.result(timeout=30) for h in handles]
    assert results[1].status == "error" and "cannot be read" in results[1].error["message"]
    assert [r.ok for r in results] == [True, False, True, True]
