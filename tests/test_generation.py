"""Continuous batching for --task generate, on a tiny random GPT-2 against a real Redis:
exact lengths, stop strings, seeded sampling, streams, cancellation, deadlines, and
newcomers joining a running batch."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from batchery import AsyncClient, Client
from batchery.batching.request import Request
from batchery.batching.queue import RequestQueue
from batchery.connection import RedisSettings
from batchery.workers.generation.worker import GenerateWorker, generate_defaults
from batchery.workers.options import WorkerOptions
from batchery.workers.runners import load_runner
from batchery.workers.runners.base import InputError
from batchery.workers.generation.sampling import parse_params
from tests.conftest import run_cli, start_worker, stop_process, wait_for
from tests.generation_helpers import build_gpt2, generate_worker

LONG = 400  # new tokens of a sequence that runs for a couple of seconds here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> Any:
    return load_runner("generate", str(model_dir), None, "cpu")


@pytest.fixture
def worker(redis_url: str, queue_name: str, runner: Any) -> Iterator[GenerateWorker]:
    with generate_worker(redis_url, queue_name, runner) as w:
        yield w


@pytest.fixture
def client(redis_url: str, queue_name: str) -> Iterator[Client]:
    with Client(redis_url, queue_name) as c:
        yield c


def generate(client: Client, **fields: Any) -> Any:
    return client.enqueue({"prompt": "The history of the city", **fields}).result(timeout=60)


def test_lengths_are_exact_and_greedy_text_matches_a_static_batch(worker, client, runner,
                                                                  recwarn) -> None:
    """(And the engine hands the model its KV cache under the name the model takes: no
    deprecation notice from transformers, whose 5.40 drops ``past_key_values``.)"""
    handles = [client.enqueue({"prompt": p, "max_new_tokens": n})
               for p, n in (("a short one", 1), ("somewhat longer prompt here", 7),
                            ("x " * 40, 33), ("the end", 120))]
    results = [h.result(timeout=60) for h in handles]
    assert [r.output["tokens"] for r in results] == [1, 7, 33, 120]
    assert {r.output["finish_reason"] for r in results} == {"length"}
    static = runner.run(runner.prepare([{"prompt": "x " * 40, "max_new_tokens": 33}]).data)[0]
    assert results[2].output["text"] == static["text"]
    assert [str(w.message) for w in recwarn if "past_key_values" in str(w.message)] == []


def test_chat_messages_render_through_the_template_or_a_plain_transcript(worker, client,
                                                                          runner, monkeypatch) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = client.enqueue({"messages": messages, "max_new_tokens": 5}).result(timeout=60)
    plain = client.enqueue({"prompt": "system: be brief\nuser: hi\nassistant:",
                            "max_new_tokens": 5}).result(timeout=60)
    assert chat.ok and chat.output["text"] == plain.output["text"]  # no template: a transcript
    assert chat.output["prompt_tokens"] == plain.output["prompt_tokens"] > 0
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    monkeypatch.setattr(runner._tokenizer, "chat_template", template, raising=False)
    params = parse_params({"messages": messages})
    assert runner.prompt(params) == "<system>be brief<user>hi<assistant>"
    with pytest.raises(InputError, match="messages"):
        parse_params({"messages": [{"role": "user"}]})


def test_eos_ends_a_sequence(worker, client, runner, monkeypatch) -> None:
    prompt = {"prompt": "a b c d", "max_new_tokens": 12}
    batch = runner.new_batch()
    seq = runner.sequence(None, prompt)
    tokens = batch.add([seq]) + [batch.step()[0] for _ in range(11)]
    k = next((i for i in range(1, 12) if tokens[i] not in tokens[:i]), 0)
    monkeypatch.setattr(runner, "eos_ids", frozenset({tokens[k]}))
    result = client.enqueue(prompt).result(timeout=60)
    assert result.output["tokens"] == k and result.output["finish_reason"] == "stop"
    assert result.output["text"] == runner.text(tokens[:k])


def test_stop_strings_cut_the_text_before_them(worker, client) -> None:
    text = generate(client, max_new_tokens=40).output["text"]
    stop = text[len(text) // 2:len(text) // 2 + 4]
    result = generate(client, max_new_tokens=40, stop=["never-seen-stop", stop])
    assert result.output["finish_reason"] == "stop"
    assert result.output["text"] == text[:text.find(stop)]
    assert result.output["tokens"] < 40


def test_seeded_sampling_gives_the_same_text_for_the_same_seed(worker, client) -> None:
    sampling = {"max_new_tokens": 30, "temperature": 1.0, "top_k": 40, "top_p": 0.95}
    alone = generate(client, seed=7, **sampling).output["text"]
    together = [client.enqueue({"prompt": "The history of the city", "seed": seed, **sampling})
                for seed in (7, 8)]
    same, other = (h.result(timeout=60).output["text"] for h in together)
    assert same == alone
    assert other != alone
    assert generate(client, max_new_tokens=30).output["text"] != alone  # greedy is not that


@pytest.mark.parametrize("fields, message", [
    ({"temperature": -1}, "temperature must be a number at least 0.0"),
    ({"top_p": 0}, "top_p must be a number more than 0.0"),
    ({"top_k": 1.5}, "top_k must be an integer"),
    ({"stop": 5}, "stop must be a string or a list"),
    ({"seed": "x"}, "seed must be an integer"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer 1..1024"),
    ({"max_new_tokens": 600}, "leaves no room for the prompt"),
    ({"max_tokens": 5}, "unknown generation field(s) ['max_tokens']"),
    ({"stream": "yes"}, "stream must be true or false"),
])
def test_invalid_parameters_fail_that_request_alone(worker, client, fields, message) -> None:
    bad = client.enqueue({"prompt": "hi", **fields})
    good = client.enqueue({"prompt": "hi", "max_new_tokens": 3})
    failed = bad.result(timeout=60)
    assert failed.status == "error" and failed.error["type"] == "InputError"
    assert message in failed.error["message"] and failed.attempts == 1
    assert good.result(timeout=60).output["tokens"] == 3


def test_a_stream_delivers_every_piece_in_order_then_the_result(worker, client) -> None:
    handle = client.enqueue({"prompt": "Once upon a time", "max_new_tokens": 60, "stream": True,
                             "stop": "never-seen-stop"})
    events = list(handle.stream(timeout=30))
    pieces = [e for e in events[:-1] if e.kind == "text"]
    assert len(pieces) == len(events) - 1 > 5
    assert [e.tokens for e in pieces] == sorted(e.tokens for e in pieces)
    final = events[-1]
    assert final.kind == "result" and final.result.output["tokens"] == 60
    assert "".join(e.text for e in pieces) == final.result.output["text"]


def test_the_async_client_streams_too(worker, redis_url, queue_name) -> None:
    async def scenario() -> list[Any]:
        async with AsyncClient(redis_url, queue_name) as ac:
            handle = await ac.enqueue({"prompt": "Once upon a time", "max_new_tokens": 20,
                                       "stream": True})
            return [e async for e in handle.stream(timeout=30)]
    events = asyncio.run(scenario())
    assert events[-1].kind == "result" and events[-1].result.output["tokens"] == 20
    assert "".join(e.text for e in events[:-1]) == events[-1].result.output["text"]


def test_the_async_client_gets_a_cancelled_generation_s_text(worker, redis_url, queue_name) -> None:
    async def scenario() -> list[Any]:
        async with AsyncClient(redis_url, queue_name) as ac:
            handle = await ac.enqueue({"prompt": "go on", "max_new_tokens": LONG, "stream": True})
            events = []
            async for event in handle.stream(timeout=30):
                events.append(event)
                if len(events) == 1:
                    assert await handle.cancel()
            return events
    events = asyncio.run(scenario())
    assert events[-1].result.status == "cancelled"
    assert events[-1].result.output["text"] == "".join(e.text for e in events[:-1])
    assert events[-1].result.output["finish_reason"] == "cancelled"


def test_a_request_without_stream_yields_its_result_alone(worker, client) -> None:
    handle = client.enqueue({"prompt": "hi", "max_new_tokens": 4})
    events = list(handle.stream(timeout=30))
    assert [e.kind for e in events] == ["result"] and events[0].result.output["tokens"] == 4


def test_cancel_stops_a_running_sequence_and_frees_its_room(worker, client) -> None:
    handle = client.enqueue({"prompt": "go on", "max_new_tokens": LONG, "stream": True})
    stream = handle.stream(timeout=30)
    first = next(stream)
    assert first.kind == "text"
    assert handle.cancel()
    events = [first, *stream]
    result = events[-1].result
    assert result.status == "cancelled"
    streamed = "".join(e.text for e in events[:-1])
    tokens = max(e.tokens for e in events[:-1])
    assert result.output == {"text": streamed, "tokens": tokens, "finish_reason": "cancelled",
                             "prompt_tokens": result.output["prompt_tokens"]}
    assert result.output["prompt_tokens"] > 0
    assert 0 < tokens < LONG
    wait_for(lambda: not worker.loop.batch.rows, timeout=30, message="the sequence to leave")


def test_only_the_lease_held_at_the_cancel_attaches_output_once(rconn, queue_name) -> None:
    queue = RequestQueue(rconn, queue_name)
    handle_ids = ["first", "second"]
    queue.enqueue([Request(i, {"prompt": "hi"}) for i in handle_ids])
    [running] = queue.claim("w#1", 1, 1000, 0, 10).batch
    queued = next(i for i in handle_ids if i != running.id)
    assert queue.cancel(handle_ids) == [2 if i == running.id else 1 for i in handle_ids]
    output = {"text": "so far", "tokens": 2, "finish_reason": "cancelled"}
    assert not queue.attach_output(running.id, "w#2", output)  # another claim's token
    assert queue.result(running.id).output is None
    assert queue.attach_output(running.id, running.lease_token, output)
    assert queue.result(running.id).output == output and queue.result(running.id).status == "cancelled"
    assert not queue.attach_output(running.id, running.lease_token, {"text": "again"})  # once
    assert not queue.attach_output(queued, "w#1", output)  # cancelled while queued: no lease
    assert queue.result(queued).output is None


def test_stop_hands_back_claimed_requests_not_started(redis_url, queue_name, runner,
                                                      client) -> None:
    """At SIGTERM (the worker's stop event) a request claimed but not started (no room
    for it yet) goes back to the queue, unrun and with no attempt spent; the running
    sequence finishes and commits."""
    with generate_worker(redis_url, queue_name, runner, max_batch_size=2,
                         max_batch_tokens=LONG + 50) as w:
        running = client.enqueue({"prompt": "go on", "max_new_tokens": LONG, "stream": True})
        stream = running.stream(timeout=30)
        assert next(stream).kind == "text"  # it decodes, holding all but 50 tokens of room
        waiting = client.enqueue({"prompt": "and on", "max_new_tokens": 100})
        # claimed (the claim takes the head whatever its size), and waiting for room
        wait_for(lambda: any(s.key.request.id == waiting.id for s in w.loop.waiting), 30,
                 0.01, "the second request claimed, waiting for room")
        assert client.queue.stats()["inflight"] == 2
    assert running.result(timeout=30).output["tokens"] == LONG
    assert client.get(waiting.id) is None  # not run
    stats = client.queue.stats()
    assert (stats["pending"], stats["inflight"]) == (1, 0)  # back in the queue, unleased
    with generate_worker(redis_url, queue_name, runner):
        again = waiting.result(timeout=60)
    assert again.status == "ok" and again.attempts == 1 and again.output["tokens"] == 100


def test_a_newcomer_joins_the_running_batch_without_waiting_for_it(worker, client) -> None:
    long = client.enqueue({"prompt": "go on", "max_new_tokens": LONG, "stream": True},
                          priority="batch")
    stream = long.stream(timeout=30)
    assert next(stream).kind == "text"  # the long one is decoding
    steps_before = worker.loop.batch.steps
    short = client.enqueue({"prompt": "quick", "max_new_tokens": 3}, priority="realtime")
    assert short.result(timeout=30).output["tokens"] == 3
    assert client.get(long.id) is None  # still generating
    assert worker.loop.batch.steps - steps_before < LONG / 2
    done = [e for e in stream if e.kind == "result"]
    assert done[0].result.output["tokens"] == LONG


def test_a_deadline_stops_generation_with_the_text_so_far(worker, client) -> None:
    # a deadline at half of what the whole generation took on this machine just now: the
    # sequence starts well within it (a claim) and cannot finish unless the machine got
    # faster meanwhile (a neighbour's load ended); then at a quarter, an eighth ...
    started = time.monotonic()
    assert generate(client, prompt="go on", max_new_tokens=LONG).output["tokens"] == LONG
    whole_s = time.monotonic() - started
    for fraction in (2, 4, 8, 16):
        result = client.enqueue({"prompt": "go on", "max_new_tokens": LONG},
                                deadline=whole_s / fraction).result(timeout=30)
        if result.status != "ok":
            break
    assert result.status == "expired" and result.output["finish_reason"] == "deadline"
    assert 0 < result.output["tokens"] < LONG and result.output["text"]


def test_enqueue_stream_prints_the_text_then_the_result(worker, redis_url, queue_name) -> None:
    done = run_cli("enqueue", "--queue", queue_name, "--stream", "--input",
                   json.dumps({"prompt": "hi", "max_new_tokens": 15}), redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stderr.strip().splitlines()[-1])
    assert result["output"]["tokens"] == 15
    assert done.stdout == result["output"]["text"] + "\n"
    bad = run_cli("enqueue", "--queue", queue_name, "--stream", "--text", "a", "--text", "b",
                  redis_url=redis_url)
    assert bad.returncode == 2 and "--stream follows one generation" in bad.stderr


def test_a_crash_reruns_from_the_start_and_sigterm_finishes_what_runs(redis_url, queue_name,
                                                                      model_dir, tmp_path) -> None:
    """SIGKILL: the lease lapses, the next worker runs the sequence again from the start
    and its stream says so. SIGTERM: every running sequence finishes and commits."""
    RequestQueue(RedisSettings.from_url(redis_url).client(), queue_name).update_settings(
        lease_seconds=1)
    args = ("--task", "generate", "--model", str(model_dir), "--max-wait-ms", "0")
    with Client(redis_url, queue_name) as client:
        first = start_worker(redis_url, queue_name, *args, log=tmp_path / "first.log")
        crashed = client.enqueue({"prompt": "go on", "max_new_tokens": 200, "stream": True})
        stream = crashed.stream(timeout=60)
        assert next(stream).kind == "text"
        stop_process(first, signal.SIGKILL)
        second = start_worker(redis_url, queue_name, *args, log=tmp_path / "second.log")
        try:
            events = []
            for event in stream:  # SIGTERM once the rerun is under way, and a second one joined
                events.append(event)
                if event.kind == "restarted":
                    running = client.enqueue({"prompt": "and on", "max_new_tokens": 50,
                                              "stream": True})
                    assert next(running.stream(timeout=30)).kind == "text"
                    second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
        finally:
            stop_process(second, signal.SIGKILL)
        restarts = [e for e in events if e.kind == "restarted"]
        assert len(restarts) == 1 and restarts[0].attempt == 2
        after = events[events.index(restarts[0]) + 1:-1]
        result = events[-1].result
        assert result.status == "ok" and result.attempts == 2 and result.output["tokens"] == 200
        assert "".join(e.text for e in after) == result.output["text"]
        assert running.result(timeout=30).output["tokens"] == 50


def stream_entries(client: Client, request_id: str) -> list[tuple[int, dict[str, str]]]:
    """A request's stream entries: (Redis ms, fields)."""
    return [(int(i.split("-")[0]), f)
            for i, f in client.queue.client.xrange(client.queue.keys.stream(request_id))]


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_steps(redis_url, queue_name,
                                                                        runner) -> None:
    with generate_worker(redis_url, queue_name, runner, prefill_chunk_tokens=16) as worker, \
            Client(redis_url, queue_name) as client:
        running = client.enqueue({"prompt": "go on", "max_new_tokens": LONG, "stream": True})
        assert next(running.stream(timeout=30)).kind == "text"
        long_prompt = client.enqueue({"prompt": "word " * 400, "max_new_tokens": 4,
                                      "stream": True})
        assert long_prompt.result(timeout=30).output["tokens"] == 4
        assert client.get(running.id) is None  # still generating
        newcomer = stream_entries(client, long_prompt.id)
        claimed = next(ms for ms, f in newcomer if f["e"] == "start")
        first = next(ms for ms, f in newcomer if f["e"] in ("text", "end"))  # (text may be empty)
        decoded = [int(f["tokens"]) for ms, f in stream_entries(client, running.id)
                   if f["e"] == "text" and claimed < ms < first]
        # 400 tokens in chunks of 16: 25 chunks, a decode step of the running row after each
        assert len(decoded) >= 12 and decoded[-1] - decoded[0] >= 12
        assert worker.loop.batch.steps > 0


def test_a_prompt_more_urgent_than_every_running_row_is_prefilled_whole(redis_url, queue_name,
                                                                        runner) -> None:
    with generate_worker(redis_url, queue_name, runner, prefill_chunk_tokens=16) as worker, \
            Client(redis_url, queue_name) as client:
        running = client.enqueue({"prompt": "go on", "max_new_tokens": LONG, "stream": True},
                                 priority="batch")
        assert next(running.stream(timeout=30)).kind == "text"
        urgent = client.enqueue({"prompt": "word " * 400, "max_new_tokens": 4, "stream": True},
                                priority="realtime")
        assert urgent.result(timeout=30).output["tokens"] == 4
        newcomer = stream_entries(client, urgent.id)
        claimed = next(ms for ms, f in newcomer if f["e"] == "start")
        first = next(ms for ms, f in newcomer if f["e"] in ("text", "end"))
        decoded = [ms for ms, f in stream_entries(client, running.id)
                   if f["e"] == "text" and claimed < ms < first]
        assert len(decoded) <= 1  # one prefill, not 25 chunks with a decode step after each
        assert client.get(running.id) is None and worker.loop.batch.steps > 0


def test_a_realtime_arrival_preempts_a_batch_sequence_that_resumes_where_it_was(
        redis_url, queue_name, runner) -> None:
    with generate_worker(redis_url, queue_name, runner, max_batch_size=2) as worker, \
            Client(redis_url, queue_name) as client:
        longs = [client.enqueue({"prompt": p, "max_new_tokens": LONG, "stream": True},
                                priority="batch") for p in ("go on", "and on")]
        streams = [h.stream(timeout=60) for h in longs]
        firsts = [next(s) for s in streams]
        assert [e.kind for e in firsts] == ["text", "text"]  # both decoding: the worker is full
        steps_before = worker.loop.batch.steps
        urgent = client.enqueue({"prompt": "quick", "max_new_tokens": 3}, priority="realtime")
        assert urgent.result(timeout=30).output["tokens"] == 3
        assert worker.loop.batch.steps - steps_before < 30  # not after the 400-token ones
        assert [client.get(h.id) for h in longs] == [None, None]
        assert worker.loop.preempted == 1
        for first, stream in zip(firsts, streams):
            events = [first, *stream]
            assert "restarted" not in [e.kind for e in events]  # recomputed, not rerun
            result = events[-1].result
            assert result.status == "ok" and result.attempts == 1
            assert result.output["tokens"] == LONG and result.output["finish_reason"] == "length"
            assert "".join(e.text for e in events[:-1]) == result.output["text"]


def test_a_generate_worker_reports_its_model_device_and_counts(redis_url, queue_name,
                                                             runner) -> None:
    RequestQueue(RedisSettings.from_url(redis_url).client(), queue_name).update_settings(
        lease_seconds=1)
    with generate_worker(redis_url, queue_name, runner, model="generate tiny-gpt2") as worker, \
            Client(redis_url, queue_name) as client:
        handles = [client.enqueue({"prompt": "hello", "max_new_tokens": n}) for n in (5, 9)]
        assert [h.result(timeout=30).output["tokens"] for h in handles] == [5, 9]

        def report() -> dict[str, Any] | None:
            _, workers = client.queue.worker_reports()
            mine = [w for w in workers if w["id"] == worker.id]
            return mine[0] if mine and int(mine[0].get("requests", 0)) == 2 else None
        info = wait_for(report, timeout=30, message="the worker's report after two requests")
        assert info["model"] == "generate tiny-gpt2" and info["device"] == "cpu"
        prompt = len(runner.sequence(None, "hello").prompt_ids)
        # through the model: both prompts, then each token but the last fed back
        assert int(info["tokens"]) == 2 * prompt + (5 - 1) + (9 - 1) and int(info["runs"]) >= 9
        assert int(info["last_claim_ms"]) > 0 and info["live"] and info["preempted"] == "0"


def test_generate_chooses_its_own_defaults_and_keeps_the_flags_given(runner) -> None:
    options, threads = generate_defaults(runner, WorkerOptions(), set(), None, cores=4)
    assert (options.max_batch_size, options.max_wait_ms, options.lookahead, threads) == (32, 0, 128, 3)
    # the tiny model's KV cache is small: 32 sequences of its whole context fit in memory
    assert options.max_batch_tokens == 32 * runner.max_input_tokens
    given = WorkerOptions(max_batch_size=4, max_wait_ms=7, max_batch_tokens=999)
    options, threads = generate_defaults(runner, given, {"max_batch_size", "max_wait_ms",
                                                         "max_batch_tokens"}, 2, cores=4)
    assert (options.max_batch_size, options.max_wait_ms, options.max_batch_tokens, threads) == \
        (4, 7, 999, 2)
