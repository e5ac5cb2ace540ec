"""``--engine vllm``: the queue contract over an engine with vLLM's interface, held at the
engine's boundary (tests/engine_double.py runs the tiny GPT-2 behind that interface;
vLLM itself needs a GPU). Real Redis, the real generate worker: what goes into the
engine (prompt tokens, parameters, the rank as priority), and what comes back out as
results and streams; cancels, deadlines and refused inputs abort or fail alone."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from batchery import Client
from batchery.workers.generation.engine import EngineRunner
from tests import engine_double
from tests.conftest import run_cli, start_worker, stop_process, wait_for
from tests.generation_helpers import build_gpt2, generate_worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture
def runner(model_dir: Path) -> EngineRunner:
    # prompts cut to twice the engine's context: the engine itself refuses the longest
    return engine_double.runner(str(model_dir), max_running=2, context=2 * engine_double.CONTEXT)


@pytest.fixture
def client(redis_url: str, queue_name: str, runner: EngineRunner) -> Iterator[Client]:
    with generate_worker(redis_url, queue_name, runner), Client(redis_url, queue_name) as c:
        yield c


def greedy(runner: EngineRunner, prompt: str, new_tokens: int) -> str:
    """What the model itself generates greedily from the prompt the worker sends."""
    engine = runner.engine
    ids = runner.sequence(None, {"prompt": prompt}).prompt_ids
    with torch.inference_mode():
        out = engine.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=new_tokens, do_sample=False,
                                    pad_token_id=engine.tokenizer.pad_token_id)
    return engine.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def test_the_engine_s_greedy_text_comes_back_as_the_result(client, runner) -> None:
    asks = [("The history of the city", 12), ("a short one", 1), ("x " * 30, 25)]
    handles = [client.enqueue({"prompt": p, "max_new_tokens": n}) for p, n in asks]
    for (prompt, n), handle in zip(asks, handles):
        result = handle.result(timeout=60)
        assert result.ok and result.output["tokens"] == n
        assert result.output["finish_reason"] == "length"
        assert result.output["text"] == greedy(runner, prompt, n)
        assert result.output["prompt_tokens"] == len(runner.sequence(None, prompt).prompt_ids)


def test_the_rank_is_the_priority_and_a_realtime_request_runs_first(client, runner) -> None:
    engine = runner.engine
    flood = [client.enqueue({"prompt": f"batch {i}", "max_new_tokens": 40}, priority="batch")
             for i in range(6)]
    wait_for(lambda: engine.added, 30, message="the flood in the engine")
    urgent = client.enqueue({"prompt": "now", "max_new_tokens": 3}, priority="realtime")
    assert urgent.result(timeout=60).ok
    done_before = sum(client.get(h.id) is not None for h in flood)
    assert done_before <= 2  # at most the two running when it came in
    priorities = dict(engine.added)
    mine = next(p for rid, p in priorities.items() if rid.startswith(f"{urgent.id}@"))
    assert all(mine < p for rid, p in priorities.items() if not rid.startswith(f"{urgent.id}@"))
    assert all(h.result(timeout=120).output["tokens"] == 40 for h in flood)


def test_a_stream_carries_the_engine_s_text_then_the_result(client) -> None:
    handle = client.enqueue({"prompt": "Once upon a time", "max_new_tokens": 30, "stream": True})
    events = list(handle.stream(timeout=60))
    final = events[-1]
    assert final.kind == "result" and final.result.output["tokens"] == 30
    assert "".join(e.text for e in events[:-1]) == final.result.output["text"]


def test_cancel_aborts_it_in_the_engine_with_the_text_so_far(client, runner) -> None:
    handle = client.enqueue({"prompt": "go on", "max_new_tokens": 400, "stream": True})
    stream = handle.stream(timeout=60)
    first = next(stream)
    assert first.kind == "text" and handle.cancel()
    events = [first, *stream]
    result = events[-1].result
    assert result.status == "cancelled" and result.output["finish_reason"] == "cancelled"
    assert result.output["text"] == "".join(e.text for e in events[:-1])
    assert 0 < result.output["tokens"] < 400
    wait_for(lambda: any(r.startswith(f"{handle.id}@") for r in runner.engine.aborted), 30,
             message="the abort in the engine")
    assert not runner.engine.has_unfinished_requests()


def test_a_deadline_aborts_it_with_the_text_so_far(client, runner) -> None:
    result = client.enqueue({"prompt": "go on", "max_new_tokens": 400}, deadline=1.0).result(timeout=60)
    assert result.status == "expired" and result.output["finish_reason"] == "deadline"
    assert 0 < result.output["tokens"] < 400 and result.output["text"]
    assert not runner.engine.has_unfinished_requests()


def test_what_the_engine_or_the_parameters_refuse_fails_alone(client) -> None:
    too_long = client.enqueue({"prompt": "word " * 600, "max_new_tokens": 500})
    unknown = client.enqueue({"prompt": "hi", "max_new_tokens": 2, "beam_width": 3})
    good = client.enqueue({"prompt": "hi", "max_new_tokens": 2})
    for handle, words in ((too_long, "positions"), (unknown, "beam_width")):
        failed = handle.result(timeout=60)
        assert failed.status == "error" and failed.error["type"] == "InputError"
        assert words in failed.error["message"] and failed.attempts == 1
    assert good.result(timeout=60).output["tokens"] == 2


def test_seeds_and_logprobs_go_through(client) -> None:
    ask = {"prompt": "The river", "max_new_tokens": 8, "temperature": 1.0, "seed": 7}
    first, second = (client.enqueue(ask).result(timeout=60) for _ in range(2))
    assert first.output["text"] == second.output["text"]
    scored = client.enqueue({"prompt": "The river", "max_new_tokens": 5, "logprobs": 2}).result(timeout=60)
    entries = scored.output["logprobs"]
    assert len(entries) == 5 and all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in entries)


def test_the_worker_command_runs_an_engine_runner(redis_url, queue_name, model_dir, tmp_path) -> None:
    proc = start_worker(redis_url, queue_name, "--runner", "tests.engine_double:runner",
                        log=tmp_path / "worker.log", BATCHERY_TEST_ENGINE_MODEL=str(model_dir))
    try:
        with Client(redis_url, queue_name) as c:
            result = c.enqueue({"prompt": "hello there", "max_new_tokens": 6}).result(timeout=120)
            assert result.ok and result.output["tokens"] == 6, (tmp_path / "worker.log").read_text()
            assert result.output["finish_reason"] == "length"
    finally:
        assert stop_process(proc) == 0


def test_engine_vllm_without_vllm_says_what_to_install(redis_url, model_dir, tmp_path) -> None:
    # a vllm that cannot be imported, ahead of any installed one: the test holds on every machine
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('no vllm here')\n")
    done = run_cli("worker", "--engine", "vllm", "--task", "generate", "--model", str(model_dir),
                   redis_url=redis_url, PYTHONPATH=str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pip install vllm" in done.stderr
    wrong = run_cli("worker", "--engine", "vllm", "--task", "embed", "--model", "minilm",
                    redis_url=redis_url)
    assert wrong.returncode == 2 and "--task generate" in wrong.stderr
