"""``--engine vllm``: vLLM's engine under the generate worker's queue contract.

The worker claims, leases, prioritizes, streams, cancels and commits as with batchery's
own decode loop (generation/engine_loop.py); the engine schedules, caches and samples.
Any object with vLLM's ``LLMEngine`` interface serves: ``add_request(request_id, prompt,
params, priority=)``, ``abort_request(ids)``, ``step() -> [RequestOutput]`` and
``has_unfinished_requests()``, with cumulative outputs (vLLM's default): each output
holds ``request_id``, ``finished`` and ``outputs[0]`` with ``text``, ``token_ids``,
``finish_reason`` and, when asked, ``logprobs`` (one ``{token_id: Logprob}`` per token).

vLLM itself is imported only by ``load_vllm``: a worker without it, or without a GPU,
says so and exits 2. tests/test_engine.py runs the contract over an engine of the same
interface built on the tests' tiny GPT-2.
"""

from __future__ import annotations

from typing import Any, Callable

from batchery.errors import ConfigError
from batchery.workers.generation.batch import Sequence
from batchery.workers.generation.runner import params_or_none, render_prompt, templated
from batchery.workers.generation.sampling import GenParams, parse_params
from batchery.workers.runners.base import InputError, Runner
from batchery.workers.runners.hf import count_texts


class EngineRunner(Runner):
    """A generation engine with vLLM's interface, its tokenizer, and its parameters'
    type (vLLM's ``SamplingParams``): what the engine loop needs of them."""

    warmup_inputs = None  # the engine warms itself up (vLLM profiles memory at start)

    def __init__(self, engine: Any, tokenizer: Any, sampling_params: Callable[..., Any],
                 max_input_tokens: int, model: str = "") -> None:
        self.engine, self._tokenizer, self._sampling_params = engine, tokenizer, sampling_params
        self.max_input_tokens = max_input_tokens
        self.tokenizer = model  # announced, so that producers count exactly when they can

    def sequence(self, key: Any, value: Any) -> Sequence:
        """A request's parameters and prompt tokens; raises InputError for bad ones."""
        params = parse_params(value)
        room = self.max_input_tokens - params.max_new_tokens
        if room < 1:
            raise InputError(f"max_new_tokens {params.max_new_tokens} leaves no room for the "
                             f"prompt in this model's context of {self.max_input_tokens} tokens")
        ids = self._tokenizer(render_prompt(self._tokenizer, params), truncation=True,
                              max_length=room,
                              add_special_tokens=not templated(self._tokenizer, params))["input_ids"]
        return Sequence(key, params, list(ids))

    def engine_params(self, p: GenParams) -> Any:
        """The request's parameters as the engine takes them (vLLM's names)."""
        return self._sampling_params(
            max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
            top_k=p.top_k or -1, min_p=p.min_p, repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            seed=p.seed, stop=list(p.stop), logprobs=p.logprobs)

    def text(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def count_tokens(self, inputs: list[Any]) -> list[int | None] | None:
        """Prompt (cut to the room its new tokens leave) plus its new tokens."""
        params = [params_or_none(v) for v in inputs]
        counts = count_texts(self._tokenizer, [p and render_prompt(self._tokenizer, p)
                                               for p in params], self.max_input_tokens)
        return [None if c is None or p is None else
                min(c, max(1, self.max_input_tokens - p.max_new_tokens)) + p.max_new_tokens
                for c, p in zip(counts, params)]


def load_vllm(model: str, dtype: str = "auto", max_sequences: int | None = None) -> EngineRunner:
    """vLLM's engine over ``model``, scheduling by priority (a request's rank in the queue:
    lower runs first, and a more urgent arrival preempts, as in batchery's own loop)."""
    try:
        from vllm import EngineArgs, LLMEngine, SamplingParams
    except ImportError:
        raise ConfigError("--engine vllm needs vLLM, on a machine with a supported GPU: "
                          "pip install vllm (or leave --engine out: batchery's own engine)") from None
    args = EngineArgs(model=model, dtype=dtype, scheduling_policy="priority",
                      **({"max_num_seqs": max_sequences} if max_sequences else {}))
    engine = LLMEngine.from_engine_args(args)
    return EngineRunner(engine, engine.get_tokenizer(), SamplingParams,
                        engine.model_config.max_model_len, model)
