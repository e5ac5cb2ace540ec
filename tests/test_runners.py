"""Model runners: real MiniLM against sentence-transformers; small random models from configs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import (AutoTokenizer, BertConfig, BertForSequenceClassification, GPT2Config,
                          GPT2LMHeadModel)

from batchery.errors import ConfigError
from batchery.workers.runners import InputError, load_runner
from batchery.workers.calibrate import pick_batch_size, smallest_within_tolerance
from batchery.workers.runners.hf import (CountedTexts, count_texts, encode_tensors,
                                        resolve_model, tokenize)
from bench.corpus import paragraphs
from tests.conftest import examples

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minilm():
    return load_runner("embed", "minilm", None, "cpu")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small classification and generation models with random weights (no download)."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("minilm"))
    torch.manual_seed(0)
    small = dict(vocab_size=tokenizer.vocab_size, num_hidden_layers=2, num_attention_heads=2)
    classify = BertForSequenceClassification(BertConfig(
        hidden_size=32, intermediate_size=64, max_position_embeddings=128, num_labels=3,
        id2label={0: "negative", 1: "neutral", 2: "positive"},
        label2id={"negative": 0, "neutral": 1, "positive": 2}, **small))
    generate = GPT2LMHeadModel(GPT2Config(
        vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128,
        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id))
    paths = {}
    for name, model in (("classify", classify), ("generate", generate)):
        paths[name] = root / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def test_embeddings_match_sentence_transformers(minilm) -> None:
    from sentence_transformers import SentenceTransformer
    texts = paragraphs(200)[::4] + ["", "a", " ".join(paragraphs(30))]  # empty, tiny, > 256 tokens
    ours = []
    for i in range(0, len(texts), 16):
        prepared = minilm.prepare(texts[i:i + 16])
        ours += minilm.run(prepared.data)
    reference = SentenceTransformer(minilm.tokenizer, device="cpu").encode(
        texts, normalize_embeddings=True, batch_size=32)
    assert np.abs(np.array(ours) - reference).max() < 1e-5
    assert minilm.max_input_tokens == 256  # sentence_bert_config.json, not the tokenizer's 512


def test_half_precision_embeddings_stay_within_the_stated_tolerance(minilm) -> None:
    """float16 (what --dtype auto picks on CUDA), run here on the CPU: within 1e-3 of the
    float32 embeddings (measured over 600 texts: 3.3e-4; bfloat16 2.9e-3)."""
    texts = paragraphs(120)[::4]
    half = load_runner("embed", "minilm", None, "cpu", dtype="float16")
    assert next(half._model.parameters()).dtype == torch.float16
    full = np.array(minilm.run(minilm.prepare(texts).data))
    assert np.abs(np.array(half.run(half.prepare(texts).data)) - full).max() < 1e-3


def test_counts_match_what_a_batch_runs(minilm, tiny_models) -> None:
    texts = ["short", " ".join(paragraphs(30)), {"text": "hello"}]
    assert minilm.count_tokens([*texts, 42]) == [*minilm.prepare(texts).lengths, None]
    generate = load_runner("generate", str(tiny_models["generate"]), None, "cpu")
    prompts = [{"prompt": "Once upon a time", "max_new_tokens": 5}, "x", {"prompt": 1}]
    counted = generate.count_tokens(prompts)
    assert counted[:2] == [generate.prepare([p]).lengths[0] for p in prompts[:2]]
    assert counted[2] is None


def test_a_batch_counted_to_price_it_is_prepared_as_tokenizing_it_would(minilm, tiny_models) -> None:
    """A counting worker keeps the tokens it priced estimated requests with, and pads
    them into the batch instead of tokenizing again: the same tensors, the same outputs."""
    texts = paragraphs(120)[1::4] + ["", "a", " ".join(paragraphs(30))]  # empty, tiny, cut
    classify = load_runner("classify", str(tiny_models["classify"]), None, "cpu")
    for runner in (minilm, classify):
        tokenizer, limit = runner._tokenizer, runner.max_input_tokens
        counted = CountedTexts(len(texts))
        assert count_texts(tokenizer, texts, limit, counted) == runner.count_tokens(texts)
        reference = tokenize(tokenizer, texts, limit)
        kept = counted.prepare(tokenizer, texts)
        assert kept is not None and (kept.lengths, kept.padded) == (reference.lengths, reference.padded)
        assert kept.data.keys() == reference.data.keys()
        assert all(torch.equal(kept.data[k], reference.data[k]) for k in reference.data.keys())
        runner.count_tokens(texts[:-1])  # through the runner: the same outputs either way
        assert runner.run(runner.prepare(texts[:-1]).data) == runner.run(
            tokenize(tokenizer, texts[:-1], limit).data)
        # a text it did not count: the whole batch is tokenized, as before
        assert counted.prepare(tokenizer, [*texts[:2], "never counted"]) is None
    bounded = CountedTexts(2)
    count_texts(minilm._tokenizer, ["one", "two", "three"], 256, bounded)
    assert bounded.prepare(minilm._tokenizer, ["one"]) is None  # the oldest went first
    assert bounded.prepare(minilm._tokenizer, ["two", "three"]) is not None
    by_size = CountedTexts(100, max_chars=10)
    count_texts(minilm._tokenizer, ["long text", "more"], 256, by_size)  # 9 + 4 chars > 10
    assert by_size.prepare(minilm._tokenizer, ["long text"]) is None
    assert by_size.prepare(minilm._tokenizer, ["more"]) is not None


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(max_size=400), min_size=1, max_size=8), st.integers(2, 80),
       st.sampled_from(["right", "left"]), st.booleans())
def test_tensors_from_numpy_equal_the_tokenizers_own(minilm, texts: list[str], max_length: int,
                                                     side: str, token_types: bool) -> None:
    """Every batch the runners tokenize (embed, classify: padded right; generate's static
    batch: padded left, no token types) gets the tensors the tokenizer would build itself,
    the same values and dtypes, whatever the texts, lengths and truncation."""
    tokenizer = minilm._tokenizer
    tokenizer.padding_side = side
    try:
        options = dict(padding=True, truncation=True, max_length=max_length,
                       return_token_type_ids=token_types)
        ours, theirs = (encode_tensors(tokenizer, texts, **options),
                        tokenizer(texts, return_tensors="pt", **options))
    finally:
        tokenizer.padding_side = "right"
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name])


def test_embed_accepts_text_objects_and_rejects_other_inputs(minilm) -> None:
    assert minilm.prepare([{"text": "hello"}, "hello"]).lengths == [3, 3]
    for bad in (42, None, ["a"], {"txt": "x"}):
        with pytest.raises(InputError, match="must be a string or an object"):
            minilm.prepare([bad])


def test_padding_is_to_the_longest_in_the_batch(minilm) -> None:
    prepared = minilm.prepare(["short", "a somewhat longer sentence than the first one"])
    assert prepared.padded == 2 * max(prepared.lengths)
    assert 0 < prepared.efficiency < 1


def test_classify_gives_labels_and_scores_independent_of_batching(tiny_models) -> None:
    runner = load_runner("classify", str(tiny_models["classify"]), None, "cpu")
    texts = paragraphs(6)
    batched = runner.run(runner.prepare(texts).data)
    alone = [runner.run(runner.prepare([t]).data)[0] for t in texts]
    for b, a in zip(batched, alone):
        assert b["label"] in ("negative", "neutral", "positive")
        assert sum(b["scores"].values()) == pytest.approx(1, abs=1e-4)
        assert b["scores"] == pytest.approx(a["scores"], abs=1e-4)
        assert b["label"] == max(b["scores"], key=b["scores"].get)


def test_generate_honours_max_new_tokens_with_left_padding(tiny_models, tmp_path: Path) -> None:
    # the same weights without an EOS token: nothing ends a text early, so each gets
    # exactly its max_new_tokens (32 by default)
    no_eos = GPT2LMHeadModel.from_pretrained(tiny_models["generate"])
    no_eos.config.eos_token_id = no_eos.generation_config.eos_token_id = None
    no_eos.save_pretrained(tmp_path / "no-eos")
    AutoTokenizer.from_pretrained(tiny_models["generate"]).save_pretrained(tmp_path / "no-eos")
    runner = load_runner("generate", str(tmp_path / "no-eos"), None, "cpu")
    inputs = ["Once upon a time", {"prompt": "The standard library", "max_new_tokens": 5},
              {"text": "x", "max_new_tokens": 12}]
    prepared = runner.prepare(inputs)
    outputs = runner.run(prepared.data)
    assert [o["tokens"] for o in outputs] == [32, 5, 12]
    # with its EOS the model ends some at once (these random weights): never longer
    with_eos = load_runner("generate", str(tiny_models["generate"]), None, "cpu")
    ended = with_eos.run(with_eos.prepare(inputs).data)
    assert [o["tokens"] <= n for o, n in zip(ended, [32, 5, 12])] == [True] * 3
    assert all(isinstance(o["text"], str) for o in outputs)
    assert runner.run(prepared.data) == outputs  # greedy: deterministic
    assert runner.run(runner.prepare([inputs[1]]).data)[0]["text"] == outputs[1]["text"]
    with pytest.raises(InputError, match="max_new_tokens must be an integer"):
        runner.prepare([{"prompt": "x", "max_new_tokens": 0}])


def test_runner_and_model_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected module:factory"):
        load_runner(None, None, "no_colon", "cpu")
    with pytest.raises(ConfigError, match="cannot load it"):
        load_runner(None, None, "tests.runners:missing", "cpu")
    with pytest.raises(ConfigError, match="--task must be one of"):
        load_runner("translate", "minilm", None, "cpu")
    with pytest.raises(ConfigError, match="needs --model"):
        load_runner("embed", None, None, "cpu")
    with pytest.raises(ConfigError, match="--allow-download"):
        load_runner("embed", "no-such-org/no-such-model", None, "cpu")
    runner = load_runner(None, None, "tests.runners:echo", "cpu")
    assert runner.run(runner.prepare(["a", 1]).data) == [{"echo": "a", "n": 2}, {"echo": 1, "n": 2}]


def test_calibration_keeps_the_smallest_batch_within_five_percent_of_the_best(tiny_models) -> None:
    runner = load_runner("classify", str(tiny_models["classify"]), None, "cpu")
    size, rates = pick_batch_size(runner, max_batch_tokens=8192)
    assert rates and size in rates and list(rates) == sorted(rates)
    best = max(rates.values())
    assert rates[size] >= 0.95 * best
    assert all(rate < 0.95 * best for s, rate in rates.items() if s < size)
    assert max(rates) * min(runner.max_input_tokens, 32) <= 8192 or len(rates) == 1
    # a custom runner has no sample input to time: the fixed default
    assert pick_batch_size(load_runner(None, None, "tests.runners:echo"), 8192) == (64, {})
    # the token budget bounds the sizes timed: 2 of a typical length fit, never 4
    length = min(64, runner.max_input_tokens)
    size, rates = pick_batch_size(runner, max_batch_tokens=2 * length)
    assert list(rates) == [1, 2] and size in rates


def test_calibration_chooses_the_smallest_size_within_five_percent() -> None:
    # past 4 a bigger batch buys under 5%: 4 it is, not the fastest 16
    assert smallest_within_tolerance({1: 100, 2: 190, 4: 300, 8: 310, 16: 312}) == 4
    assert smallest_within_tolerance({1: 100, 2: 94.9, 4: 80}) == 1
    assert smallest_within_tolerance({1: 50, 2: 96, 4: 100}) == 2  # within 5%: not the fastest


def test_cudnn_attention_is_off_on_cuda_and_untouched_elsewhere() -> None:
    """SDPA's cuDNN backend plans each new shape anew (11 ms of CPU a call, every decode
    step a new shape): a runner on CUDA turns it off for the process, one elsewhere leaves
    the setting as it was."""
    from batchery.workers.runners.hf import settle_attention
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        settle_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        settle_attention(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("task", ["embed", "classify", "generate"])
def test_every_task_settles_attention_on_its_device(task: str, tiny_models,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from batchery.workers.runners import hf
    settled: list[torch.device] = []
    monkeypatch.setattr(hf, "settle_attention", settled.append)
    load_runner(task, "minilm" if task == "embed" else str(tiny_models[task]), None, "cpu")
    assert settled == [torch.device("cpu")]
