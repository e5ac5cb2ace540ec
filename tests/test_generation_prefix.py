"""Prefix caching (workers/generation/prefix_cache.py): the same tokens with the cache as
without it, token for token, on a tiny random GPT-2 (in-process, then through a real
worker and Redis); block names, grouping, the bound and eviction over plain lists."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from batchery import Client
from batchery.errors import ConfigError
from batchery.workers.generation.batch import DecodeBatch, Sequence
from batchery.workers.generation.prefix_cache import BLOCK_TOKENS, PrefixCache, chain
from batchery.workers.generation.sampling import parse_params
from batchery.workers.options import WorkerOptions
from batchery.workers.runners import load_runner
from tests.conftest import wait_for
from tests.generation_helpers import build_gpt2, generate_worker

B = BLOCK_TOKENS
rng = random.Random(0)
SYSTEM = [rng.randrange(1000, 20000) for _ in range(2 * B)]  # two whole blocks
TAILS = {"a hit up to the last token": SYSTEM + [7],
         "a whole block after the hit": SYSTEM + list(range(3000, 3000 + B)),
         "a partial block after the hit": SYSTEM + [11, 12, 13, 14, 15],
         "the prefix alone (one block taken)": list(SYSTEM),
         "one block shared": SYSTEM[:B + 4] + [21, 22, 23],
         "nothing shared": [5, 6, 7, 8]}
PROMPTS = list(TAILS.values())


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_runner("generate", str(build_gpt2(tmp_path_factory.mktemp("gpt2"))), None, "cpu")


def seqs(prompts: list[list[int]], n: int = 12, **params: Any) -> list[Sequence]:
    return [Sequence(i, parse_params({"prompt": "x", "max_new_tokens": n, **params}), list(p))
            for i, p in enumerate(prompts)]


def decode(batch: DecodeBatch, group: list[Sequence], steps: int) -> None:
    """Prefill ``group`` into ``batch`` and step every row ``steps`` times."""
    for s, t in zip(group, batch.add(group)):
        s.generated.append(t)
    for _ in range(steps):
        for s, t in zip(list(batch.rows), batch.step()):
            s.generated.append(t)


def row_kv(batch: DecodeBatch, s: Sequence) -> torch.Tensor:
    """A running row's keys and values over its real tokens, every layer: [2 x layers,
    heads, tokens, dim], whatever the padding around them."""
    slab, row = batch.slab, batch.rows.index(s)
    real = slab.mask[row, slab.start:slab.end].bool()
    return torch.stack([b[row, :, slab.start:slab.end][:, real] for b in (*slab.keys, *slab.values)])


def assert_same_kv(on: dict[int, torch.Tensor], off: dict[int, torch.Tensor]) -> None:
    """The cache holds what a prefill without it computes (to float rounding)."""
    assert on.keys() == off.keys()
    for key in on:
        assert torch.allclose(on[key], off[key], atol=1e-5), f"row {key}'s KV differs"


def rounds(runner: Any, prefix_tokens: int, kv: dict[Any, torch.Tensor] | None = None,
           **params: Any) -> list[list[list[int]]]:
    """Every prompt together, then one at a time, then in chunks of 9 tokens: the tokens
    each generated, round by round, on one batch (and one prefix cache); ``kv``: each
    row's KV at the end of its round."""
    batch = runner.new_batch(prefix_tokens)
    kv = {} if kv is None else kv
    out = []
    together = seqs(PROMPTS, **params)
    decode(batch, together, 11)
    kv.update({(0, s.key): row_kv(batch, s) for s in together})
    batch.drop(list(batch.rows))
    out.append([s.generated for s in together])
    alone = seqs(PROMPTS, **params)
    for s in alone:
        decode(batch, [s], 11)
        kv[1, s.key] = row_kv(batch, s)
        batch.drop([s])
    out.append([s.generated for s in alone])
    chunked = seqs(PROMPTS, **params)
    for p in batch.prefills(chunked):
        tokens = None
        while tokens is None:
            tokens = batch.advance(p, 9)
        batch.join(p, tokens)
        for s, t in zip(p.seqs, tokens):
            s.generated.append(t)
    for _ in range(11):
        for s, t in zip(list(batch.rows), batch.step()):
            s.generated.append(t)
    out.append([s.generated for s in chunked])
    kv.update({(2, s.key): row_kv(batch, s) for s in chunked})
    return out


def test_greedy_tokens_are_the_same_with_the_prefix_cache_as_without(runner) -> None:
    kv_off: dict[Any, torch.Tensor] = {}
    kv_on: dict[Any, torch.Tensor] = {}
    off, on = rounds(runner, 0, kv_off), rounds(runner, 4096, kv_on)
    assert_same_kv(kv_on, kv_off)
    for name, i in zip(TAILS, range(len(PROMPTS))):
        assert [r[i] for r in on] == [r[i] for r in off], name
    assert off[0] == off[1] == off[2]  # (the rounds agree among themselves too)


def test_a_seeded_sampled_request_draws_the_same_tokens_with_the_cache(runner) -> None:
    params = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
    assert rounds(runner, 4096, **params) == rounds(runner, 0, **params)


def test_a_preempted_sequence_is_prefilled_again_from_the_cache_and_goes_on_the_same(runner) -> None:
    whole = runner.new_batch(0)
    alone = seqs([TAILS["a partial block after the hit"]], n=20)
    decode(whole, alone, 19)
    batch = runner.new_batch(4096)
    others, (paused,) = seqs(PROMPTS[:2], n=20), seqs([TAILS["a partial block after the hit"]], n=20)
    decode(batch, others + [paused], 6)
    batch.drop([paused])  # preempted: its cache freed, its tokens kept
    for s, t in zip(batch.rows, batch.step()):
        s.generated.append(t)
    reused = batch.prefixes.reused_tokens
    decode(batch, [paused], 12)  # prefilled again from its prompt and what it generated
    assert batch.prefixes.reused_tokens - reused >= len(SYSTEM)  # its prompt's blocks, at least
    assert paused.generated == alone[0].generated
    assert_same_kv({0: row_kv(batch, paused)}, {0: row_kv(whole, alone[0])})


def test_blocks_kept_from_a_padded_row_are_reused_as_prefilled(runner) -> None:
    """A short row's blocks, kept after a prefill where it was left-padded beside a longer
    one, give the same tokens to a later prompt that extends it."""
    question = [rng.randrange(1000, 20000) for _ in range(2 * B + 3)]
    later = question + [41, 42, 43, 44, 45, 46, 47]

    def run(prefix_tokens: int) -> tuple[list[int], torch.Tensor, DecodeBatch]:
        batch = runner.new_batch(prefix_tokens)
        decode(batch, seqs([list(range(2000, 2000 + 4 * B)), question]), 3)
        batch.drop(list(batch.rows))
        (s,) = seqs([later])
        decode(batch, [s], 11)
        return s.generated, row_kv(batch, s), batch
    (off, kv_off, _), (on, kv_on, batch) = run(0), run(4096)
    assert on == off and batch.prefixes.reused_tokens == 2 * B
    assert_same_kv({0: kv_on}, {0: kv_off})


def test_newcomers_sharing_an_uncached_prefix_prefill_it_once(runner) -> None:
    batch = runner.new_batch(4096)
    group = seqs([SYSTEM + [1, 2], SYSTEM + [3], SYSTEM + [4, 5, 6]])
    (p,) = batch.prefills(group)
    assert p.shared == len(SYSTEM) and p.done == 0
    tokens = batch.advance(p, 0)
    # the prefix once (one row), then each row's own tail: 32 + 3 x 3 positions
    assert tokens is not None and p.padded == len(SYSTEM) + 3 * 3 and p.fed == len(SYSTEM) + 6
    assert batch.prefixes.cached(chain(SYSTEM)) == 2
    (again,) = batch.prefills(seqs([SYSTEM + [9]]))
    assert again.done == len(SYSTEM)  # taken from the cache: only the last token is prefilled
    assert batch.prefixes.hit_rate == (2 * len(SYSTEM) + len(SYSTEM)) / (3 * len(SYSTEM) + 6 + len(SYSTEM) + 1)


def test_block_names_chain_the_whole_prefix() -> None:
    a, b = list(range(40)), list(range(40))
    b[3] = 99  # differs in the first block: every later name differs too
    assert len(chain(a)) == 40 // B and chain(a)[:1] == chain(list(range(B)))
    assert not set(chain(a)) & set(chain(b))
    assert chain(a + [1, 2]) == chain(a) + [] and chain(a, blocks=1) == chain(a)[:1]


def test_newcomers_group_by_the_prefix_they_share() -> None:
    cache = PrefixCache(1024)
    x, y = list(range(100, 100 + 3 * B)), list(range(500, 500 + 2 * B))
    contexts = [x + [1], x + [2], x[:B] + [3] * B, y + [4], [5, 6]]
    _, groups = cache.plan(contexts)
    plans = sorted((g.rows, g.shared, g.cached) for g in groups)
    # x's three blocks shared by two; the third row shares one block with them, but alone at
    # that depth it takes nothing (nothing is cached): it is prefilled with the rows that
    # share nothing, in one prefill
    assert plans == [([0, 1], 3, 0), ([2, 3, 4], 0, 0)]
    assert cache.reused_tokens == 3 * B and cache.prompt_tokens == sum(map(len, contexts))


def fake_layers(rows: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(rows, 2, width, 4), torch.randn(rows, 2, width, 4)) for _ in range(2)]


def test_the_cache_is_bounded_and_a_prefix_wears_down_from_its_end() -> None:
    cache = PrefixCache(4 * B + 3)  # room for 4 blocks
    x, y = chain(list(range(3 * B))), chain(list(range(1000, 1000 + 3 * B)))
    cache.store(x, fake_layers(1, 3 * B), 0, [0, B, 2 * B])
    cache.store(y, fake_layers(1, 3 * B), 0, [0, B, 2 * B])
    assert len(cache) == 4
    assert cache.cached(y) == 3 and cache.cached(x) == 1  # x's last blocks went first
    layers = fake_layers(2, 3 * B)
    cache.store(chain(list(range(2000, 2000 + 5 * B))), fake_layers(1, 5 * B), 0,
                [k * B for k in range(5)])
    assert len(cache) == 4  # a prefix longer than the cache keeps its beginning
    PrefixCache(0).store(x, layers, 1, [0, B, 2 * B])  # no room: nothing kept, no error
    kept = PrefixCache(4 * B)
    kept.store(x[:2], layers, 1, [B, 2 * B])
    loaded = kept.load(x[:2])
    assert torch.equal(loaded[0][0], layers[0][0][1:2, :, B:3 * B])


SYSTEM_TEXT = ("You are a helpful assistant for a public library. Answer questions about "
               "opening hours, borrowing rules, fines, events and the catalogue. Be brief, be "
               "polite, and when you do not know, say so and point to the front desk. ") * 3
QUESTIONS = ["When do you open on Sunday?", "How many books can I borrow?", "Is there a fee?",
             "Do you have a reading group?", "Where is the history section?"]


def served_texts(redis_url: str, queue_name: str, runner: Any, **options: Any) -> tuple[list[str], Any]:
    """Each question after the system text, through a worker: their texts and its report."""
    with generate_worker(redis_url, queue_name, runner, max_batch_size=2, **options) as worker, \
            Client(redis_url, queue_name) as client:
        first = [client.enqueue({"prompt": SYSTEM_TEXT + q, "max_new_tokens": 60}, priority="batch")
                 for q in QUESTIONS[:2]]
        wait_for(lambda: len(worker.loop.batch.rows) == 2, 30, message="two rows decoding")
        urgent = client.enqueue({"prompt": SYSTEM_TEXT + QUESTIONS[2], "max_new_tokens": 5},
                                priority="realtime")  # preempts one: prefilled again later
        rest = [client.enqueue({"prompt": SYSTEM_TEXT + q, "max_new_tokens": 9}) for q in QUESTIONS[3:]]
        texts = [h.result(timeout=60).output["text"] for h in [*first, urgent, *rest]]
        assert worker.loop.preempted >= 1
        return texts, worker.info()


def test_a_worker_gives_the_same_texts_with_the_cache_and_reports_its_hit_rate(
        redis_url, queue_name, runner) -> None:
    off, off_info = served_texts(redis_url, queue_name + "-off", runner, prefix_cache_tokens=0)
    on, on_info = served_texts(redis_url, queue_name, runner)  # the default: on
    assert on == off
    assert off_info["prefix_hit_rate"] == 0 and 0.5 < on_info["prefix_hit_rate"] < 1
    reused = REGISTRY.get_sample_value("batchery_prefix_reused_tokens_total", {"queue": queue_name})
    prompt = REGISTRY.get_sample_value("batchery_prefix_prompt_tokens_total", {"queue": queue_name})
    assert reused == on_info["prefix_reused_tokens"] and reused / prompt == pytest.approx(
        on_info["prefix_hit_rate"], abs=1e-3)


def test_the_prefix_cache_option_is_checked_and_sized_from_the_kv_budget(redis_url, queue_name,
                                                                           runner) -> None:
    with pytest.raises(ConfigError, match="--prefix-cache-tokens must be 0 or more"):
        WorkerOptions(prefix_cache_tokens=-1)
    with generate_worker(redis_url, queue_name, runner, max_batch_tokens=1000) as worker:
        loop = wait_for(lambda: getattr(worker, "loop", None), 30, message="the decode loop")
        assert loop.batch.prefixes.capacity == 250 // B  # a quarter of the budget
    with generate_worker(redis_url, queue_name, runner, prefix_cache_tokens=0) as worker:
        loop = wait_for(lambda: getattr(worker, "loop", None), 30, message="the decode loop")
        assert loop.batch.prefixes is None
