"""Sampling for the whole batch at once, on a tiny random GPT-2: per-row parameters,
seeds that do not depend on batch-mates, penalties, min-p, log-probabilities; and the
worker's results carrying them, against a real Redis."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from batchery import Client
from batchery.workers.runners import load_runner
from batchery.workers.generation.sampling import (Rows, nucleus_floor, choose, new_generator,
                                                parse_params)
from tests.generation_helpers import build_gpt2, generate_worker

PROMPT = "The history of the city"


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_runner("generate", str(build_gpt2(tmp_path_factory.mktemp("gpt2"))), None, "cpu")


def decode(runner: Any, requests: list[dict[str, Any]], steps: int) -> list[list[int]]:
    """Each request's first ``steps`` + 1 tokens, all of them decoding in one batch."""
    batch = runner.new_batch()
    seqs = [runner.sequence(None, {"prompt": PROMPT, **r}) for r in requests]
    for s, t in zip(seqs, batch.add(seqs)):
        s.generated.append(t)  # (what the decode loop does: penalties read it)
    for _ in range(steps):
        for s, t in zip(seqs, batch.step()):
            s.generated.append(t)
    return [s.generated for s in seqs]


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 7}


@pytest.mark.parametrize("mates", [
    [],
    [{"temperature": 0.7, "seed": 8}, {}],
    [{}, {"temperature": 1.3, "top_k": 5}, {"repetition_penalty": 1.5}, {"temperature": 0.9}],
])
def test_a_seed_gives_the_same_tokens_whatever_its_batch_mates(runner, mates) -> None:
    alone = decode(runner, [SEEDED], 20)[0]
    assert decode(runner, [*mates, SEEDED], 20)[len(mates)] == alone
    assert decode(runner, [{**SEEDED, "seed": 9}], 20)[0] != alone


def test_top_k_1_and_min_p_1_sample_the_greedy_token(runner) -> None:
    greedy, top1, min_p1 = decode(runner, [{}, {"temperature": 1.5, "top_k": 1},
                                           {"temperature": 1.5, "min_p": 1.0}], 15)
    assert top1 == greedy and min_p1 == greedy
    free = decode(runner, [{"temperature": 1.5, "seed": 3}], 15)[0]
    assert free != greedy  # sampling at that temperature does wander


def test_penalties_make_greedy_decoding_repeat_less(runner) -> None:
    plain, repetition, presence, frequency = decode(
        runner, [{}, {"repetition_penalty": 5.0}, {"presence_penalty": 2.0},
                 {"frequency_penalty": 2.0}], 30)
    assert repeats(plain) > 10  # a random model loops on a few tokens
    assert repeats(repetition) < repeats(plain) and repeats(presence) < repeats(plain)
    assert repeats(frequency) < repeats(plain)


def test_one_call_chooses_every_row_with_its_own_parameters() -> None:
    """Below the model: rows of one logits tensor, each with its own parameters."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4)
    params = [parse_params({"prompt": "x", **p}) for p in (
        {}, {"temperature": 1.0, "top_k": 1, "seed": 1}, {"temperature": 5.0, "top_p": 0.01},
        {"repetition_penalty": 10.0})]
    rows = Rows.of(params, [new_generator(p) for p in params], 4, torch.device("cpu"))
    history = [[], [], [], [1]]  # row 3 has seen token 1: 3.0 / 10 falls below 2.0
    chosen = choose(logits, rows, history, [[], [], [], []])
    assert chosen.tokens == [1, 1, 1, 3]


@pytest.fixture
def client(redis_url: str, queue_name: str, runner: Any) -> Iterator[Client]:
    with generate_worker(redis_url, queue_name, runner), Client(redis_url, queue_name) as c:
        yield c


def test_results_carry_the_log_probabilities_asked_for(client) -> None:
    top = client.enqueue({"prompt": PROMPT, "max_new_tokens": 6, "logprobs": 3})
    plain = client.enqueue({"prompt": PROMPT, "max_new_tokens": 6, "min_p": 0.1,
                            "temperature": 0.8, "presence_penalty": 0.5})
    result = top.result(timeout=60).output
    assert len(result["logprobs"]) == 6 and "logprobs" not in plain.result(timeout=60).output
    for entry in result["logprobs"]:
        assert len(entry["top"]) == 3 and entry["logprob"] <= 0
        assert entry["top"][0]["id"] == entry["id"]  # greedy: the likeliest token
        assert entry["top"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert [e["logprob"] for e in entry["top"]] == sorted((e["logprob"] for e in entry["top"]),
                                                               reverse=True)
    assert "".join(e["token"] for e in result["logprobs"]).replace(" ", "") == \
        result["text"].replace(" ", "")


@pytest.mark.parametrize("fields, message", [
    ({"min_p": 2}, "min_p must be a number at least 0.0 and at most 1.0"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number more than 0.0"),
    ({"presence_penalty": -3}, "presence_penalty must be a number at least -2.0"),
    ({"frequency_penalty": "x"}, "frequency_penalty must be a number"),
    ({"logprobs": 21}, "logprobs must be true, false or an integer 0..20"),
])
def test_invalid_sampling_parameters_are_refused_by_name(client, fields, message) -> None:
    failed = client.enqueue({"prompt": "hi", **fields}).result(timeout=60)
    assert failed.status == "error" and failed.error["type"] == "InputError"
    assert message in failed.error["message"]


def test_rows_join_and_leave_the_cache_in_place_and_decode_as_alone(runner) -> None:
    """Greedy tokens of sequences that join a running batch (wider prompts than the
    running rows, and narrower), while others leave, are those each gets alone; the
    cache buffers were copied whole only when they grew."""
    prompts = ["a b", "The history of the city of Rome " * 4, "hello", "one two three four five"]

    def alone(prompt: str) -> list[int]:
        batch = runner.new_batch()
        seq = runner.sequence(None, {"prompt": prompt, "max_new_tokens": 40})
        return batch.add([seq]) + [batch.step()[0] for _ in range(25)]
    expected = [alone(p) for p in prompts]
    batch = runner.new_batch()
    seqs = [runner.sequence(None, {"prompt": p, "max_new_tokens": 40}) for p in prompts]
    got: dict[int, list[int]] = {}

    def join(i: int) -> None:
        got[i] = batch.add([seqs[i]])

    def step() -> None:
        for s, t in zip(list(batch.rows), batch.step()):
            got[seqs.index(s)].append(t)
    join(0)
    for _ in range(5):
        step()
    join(1)  # wider: the window grows on the left
    step()
    join(2)
    join(3)
    for n in range(25):
        step()
        if n == 3:
            batch.drop([seqs[0]])  # the last row moves into its place
    assert [got[i][:len(expected[i])] for i in (1, 2, 3)] == expected[1:]
    assert got[0] == expected[0][:len(got[0])]
    assert batch.slab.copies <= 3


@pytest.mark.parametrize("spread", [0.1, 1.0, 4.0])  # flat (a random model), middling, peaked
def test_top_p_finds_the_same_cut_as_sorting_the_vocabulary(spread) -> None:
    torch.manual_seed(0)
    probs = (torch.randn(6, 30522) * spread).softmax(dim=-1)
    top_p = torch.tensor([[0.95], [0.5], [0.99], [0.1], [1.0], [0.9]])
    floor = nucleus_floor(probs, top_p)
    ordered = probs.sort(dim=-1, descending=True).values
    crossing = ((ordered.cumsum(dim=-1) - ordered) < top_p).sum(dim=-1, keepdim=True)
    exact = torch.where(top_p < 1, ordered.gather(1, crossing - 1), torch.zeros_like(top_p))
    assert torch.equal(floor, exact)


def test_incremental_text_is_the_whole_decode_from_short_windows(runner, monkeypatch) -> None:
    seq = runner.sequence(None, {"prompt": PROMPT, "max_new_tokens": 60, "stream": True})
    tokens = decode(runner, [{"temperature": 1.0, "seed": 5}], 59)[0]
    widths = []
    text = runner.text
    monkeypatch.setattr(runner, "text", lambda ids: widths.append(len(ids)) or text(ids))
    pieces = []
    for i, token in enumerate(tokens):
        seq.generated.append(token)
        pieces.append(runner.text_delta(seq, final=i == len(tokens) - 1))
    assert "".join(pieces) == text(tokens)
    assert max(widths) <= 4  # never the whole text again
