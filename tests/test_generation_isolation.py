"""One request's fault stays its own in generation, on a tiny random GPT-2 against a real
Redis: parameters that make a row's logits or probabilities non-finite fail that row alone,
and a shared prefill, decode step or join that raises is bisected down to the request that
caused it while its batch-mates finish as if it had never been there."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchery import Client
from batchery.batching.queue import RequestQueue
from batchery.connection import RedisSettings
from batchery.workers.runners import load_runner
from batchery.workers.generation.batch import DecodeBatch
from batchery.workers.generation.sampling import (Rows, SamplingError, choose, new_generator,
                                                parse_params)
from tests.conftest import wait_for
from tests.generation_helpers import build_gpt2, generate_worker

GOOD = [{"prompt": p, "max_new_tokens": n}
        for p, n in (("a short one", 5), ("the history of the city", 8), ("once upon", 3),
                     ("some more words here", 6), ("hello", 7), ("a b c d e", 4), ("go on", 8))]


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_runner("generate", str(build_gpt2(tmp_path_factory.mktemp("gpt2"))), None, "cpu")


@pytest.fixture(scope="module")
def expected(runner: Any) -> list[str]:
    """Each good request's greedy text, generated alone."""
    return [runner.run(runner.prepare([r]).data)[0]["text"] for r in GOOD]


@pytest.fixture
def client(redis_url: str, queue_name: str) -> Iterator[Client]:
    RequestQueue(RedisSettings.from_url(redis_url).client(), queue_name).update_settings(
        max_attempts=1)  # a failure is final: the test sees each request's first outcome
    with Client(redis_url, queue_name) as c:
        yield c


def run_together(client: Client, planted: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    """The good requests and the planted ones in one enqueue (so in one claim, one prefill
    and the same decode steps): (good results, planted results)."""
    handles = client.enqueue_many([{"input": r} for r in GOOD] + [{"input": r} for r in planted])
    results = [h.result(timeout=60) for h in handles]
    assert [r.id for r in results] == [h.id for h in handles]  # each its own result
    return results[:len(GOOD)], results[len(GOOD):]


def assert_untouched(good: list[Any], expected: list[str]) -> None:
    """The good requests finished as they do alone: first attempt, whole, same text."""
    assert [(r.status, r.attempts) for r in good] == [("ok", 1)] * len(GOOD)
    assert [r.output["tokens"] for r in good] == [r["max_new_tokens"] for r in GOOD]
    assert [r.output["text"] for r in good] == expected


@pytest.mark.parametrize("params", [
    {"temperature": 1e-50},                       # the logits overflow float32: inf - inf
    {"temperature": 5e-324, "top_k": 1_000_000},  # the smallest double; top_k past the vocab
    {"temperature": 1e-40, "top_p": 1e-300},      # float32's subnormals; a nucleus of one token
])
def test_parameters_that_overflow_fail_their_row_alone(runner, expected, redis_url, queue_name,
                                                       client, params) -> None:
    with generate_worker(redis_url, queue_name, runner):
        good, [bad] = run_together(client, [{"prompt": "go on", "max_new_tokens": 6, **params}])
    assert_untouched(good, expected)
    assert bad.status == "error" and bad.attempts == 1 and bad.error["type"] == "SamplingError"
    assert "not finite" in bad.error["message"] and "temperature" in bad.error["message"]


class Poison:
    """Makes the real model raise on one request's rows: a prefill holding the token
    ``token``, or a decode step feeding position ``position``. Counts the calls it failed."""

    def __init__(self, model: Any, token: int = -1, position: int = -1) -> None:
        self.token, self.position, self.raised = token, position, 0
        self.hook = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids, positions = kwargs["input_ids"], kwargs["position_ids"]
        if ids.shape[1] > 1 and bool((ids == self.token).any()) \
                or ids.shape[1] == 1 and bool((positions == self.position).any()):
            self.raised += 1
            raise RuntimeError("poisoned rows in this call")


@pytest.fixture
def poisoned(runner: Any) -> Iterator[Any]:
    """A poison on the runner's model, removed after the test."""
    made: list[Poison] = []

    def make(**where: int) -> Poison:
        made.append(Poison(runner._model, **where))
        return made[-1]
    yield make
    for p in made:
        p.hook.remove()


def test_a_prefill_that_raises_is_bisected_to_its_one_bad_request(
        runner, expected, redis_url, queue_name, client, poisoned) -> None:
    token = runner._tokenizer.convert_tokens_to_ids("zebra")
    with generate_worker(redis_url, queue_name, runner):  # (its warm-up unpoisoned)
        poison = poisoned(token=token)
        good, [bad] = run_together(client, [{"prompt": "a zebra runs", "max_new_tokens": 4}])
    assert_untouched(good, expected)
    assert bad.status in ("error", "dead") and "poisoned" in bad.error["message"]
    assert poison.raised == 4  # 8 rows, then 4, 2 and itself: not each of the 8 alone


def test_a_decode_step_that_raises_is_bisected_to_its_one_bad_request(
        runner, expected, redis_url, queue_name, client, poisoned) -> None:
    prompt = " ".join(["word"] * 30)
    with generate_worker(redis_url, queue_name, runner):  # (its warm-up unpoisoned)
        poison = poisoned(position=len(runner.sequence(None, prompt).prompt_ids) + 2)
        good, [bad] = run_together(client, [{"prompt": prompt, "max_new_tokens": 10}])
    assert_untouched(good, expected)
    assert bad.status in ("error", "dead") and "poisoned" in bad.error["message"]
    assert poison.raised == 4  # its third step over 8 rows, then 4, 2 and itself


def test_a_join_that_raises_is_bisected_to_its_one_bad_request(
        runner, expected, redis_url, queue_name, client, monkeypatch) -> None:
    join = DecodeBatch.join
    raised = []

    def poisoned_join(self: DecodeBatch, p: Any, tokens: list[int]) -> None:
        if any("zebra" in s.params.prompt for s in p.seqs):
            raised.append(len(p.seqs))
            raise RuntimeError("poisoned rows in this join")
        join(self, p, tokens)
    monkeypatch.setattr(DecodeBatch, "join", poisoned_join)
    with generate_worker(redis_url, queue_name, runner):
        good, [bad] = run_together(client, [{"prompt": "a zebra runs", "max_new_tokens": 10}])
    assert_untouched(good, expected)
    assert bad.status in ("error", "dead") and "poisoned" in bad.error["message"]
    assert raised == [8, 4, 2, 1]  # (each half prefilled again from what it generated)


numbers = st.one_of(st.floats(allow_nan=False, allow_infinity=False),  # (JSON has neither)
                     st.sampled_from([1e-50, 5e-324, 1e-300, 1e-8, 0.0]),
                    st.integers(-5, 10 ** 7))
params = st.fixed_dictionaries({}, optional={
    "temperature": numbers, "top_p": numbers, "top_k": numbers, "seed": numbers,
    "max_new_tokens": st.integers(1, 6) | numbers, "stop": st.sampled_from(["a", ["x", "the"], 3]),
    "stream": st.booleans(),
})


@pytest.fixture(scope="module")
def served(runner: Any, redis_server: Any) -> Iterator[Client]:
    """One worker for every example of the property test."""
    RequestQueue(RedisSettings.from_url(redis_server.url).client(), "planted").update_settings(
        max_attempts=1)
    with generate_worker(redis_server.url, "planted", runner), \
            Client(redis_server.url, "planted") as client:
        yield client


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(planted=st.lists(params, min_size=1, max_size=4))
def test_planted_parameters_never_touch_another_request(served, expected, planted) -> None:
    good, mine = run_together(served, [{"prompt": "go on", **p} for p in planted])
    assert_untouched(good, expected)
    for result, p in zip(mine, planted):
        assert result.attempts == 1 and result.status in ("ok", "error")
        if result.status == "ok":
            assert result.output["finish_reason"] in ("length", "stop")
            assert result.output["tokens"] <= p.get("max_new_tokens", 32)
        else:  # refused with a message naming what to change, never the worker's bug
            assert result.error["type"] in ("InputError", "SamplingError"), result.error
            assert result.error["message"] and "Traceback" not in result.error["message"]


def test_a_non_finite_row_fails_alone_in_the_batch_itself() -> None:
    """Below the worker: a NaN in one row's logits fails that row, the others choose."""
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    params = [parse_params({"prompt": "x", "temperature": t, "seed": 1}) for t in (0.0, 0.0, 0.7)]
    rows = Rows.of(params, [new_generator(p) for p in params], 50, torch.device("cpu"))
    chosen = choose(logits, rows).tokens
    assert chosen[0] == int(logits[0].argmax()) and isinstance(chosen[2], int)
    assert isinstance(chosen[1], SamplingError)


def test_out_of_memory_in_a_step_halves_the_batch_and_loses_nothing(
        runner, expected, redis_url, queue_name, client) -> None:
    """The model runs out of memory on decode steps of more than 4 rows: the step gets
    through in halves, the worker then keeps at most 4 in flight, pausing the least
    urgent; every request finishes whole on its first attempt."""
    def oom_over_4(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs["input_ids"].shape == (kwargs["input_ids"].shape[0], 1) \
                and kwargs["input_ids"].shape[0] > 4:
            raise MemoryError("cannot allocate a decode step of more than 4 rows")
    with generate_worker(redis_url, queue_name, runner) as worker:
        hook = runner._model.register_forward_pre_hook(oom_over_4, with_kwargs=True)
        try:
            good, more = run_together(client, [{"prompt": "go on", "max_new_tokens": 12}])
        finally:
            hook.remove()
        assert worker.loop.preempted >= 4 and worker.loop.cap.apply(64) == 4
    assert_untouched(good, expected)
    assert more[0].status == "ok" and more[0].output["tokens"] == 12


@pytest.mark.parametrize("where", ["prefill", "join"])
def test_out_of_memory_for_a_newcomer_beside_running_rows_pauses_it(
        runner, redis_url, queue_name, client, where) -> None:
    """A newcomer's prefill (or its join) runs out of memory while two rows decode: it is
    not failed but waits, leased, with fewer sequences in flight for a while, and runs
    once there is room; every request finishes whole on its first attempt."""
    with generate_worker(redis_url, queue_name, runner) as worker:
        def crowded() -> bool:
            return len(worker.loop.batch.rows) >= 2

        def oom_prefill(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            if kwargs["input_ids"].shape[1] > 1 and crowded():
                raise MemoryError("cannot allocate a prefill beside two decoding rows")
        hook = runner._model.register_forward_pre_hook(oom_prefill, with_kwargs=True) \
            if where == "prefill" else None
        try:
            running = client.enqueue_many([{"input": {"prompt": "go on", "max_new_tokens": 60}}] * 2)
            loop = wait_for(lambda: getattr(worker, "loop", None) and crowded() and worker.loop, 30,
                            message="two rows decoding")
            if where == "join":
                join = loop.batch.join

                def oom_join(p: Any, tokens: Any) -> None:
                    if crowded():
                        raise MemoryError("cannot allocate a join beside two decoding rows")
                    join(p, tokens)
                loop.batch.join = oom_join
            newcomer = client.enqueue({"prompt": "the history of the city", "max_new_tokens": 5})
            results = [h.result(timeout=60) for h in [*running, newcomer]]
        finally:
            if hook is not None:
                hook.remove()
        assert [(r.status, r.attempts) for r in results] == [("ok", 1)] * 3
        assert [r.output["tokens"] for r in results] == [60, 60, 5]
        assert loop.preempted >= 1 and loop.cap.apply(64) == 1
