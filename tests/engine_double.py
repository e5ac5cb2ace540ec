"""An engine with vLLM's ``LLMEngine`` interface over the tests' tiny GPT-2, to hold the
``--engine vllm`` contract at its boundary where vLLM cannot run (no GPU).

It runs a real model: each step gives every running request its next token (greedy, or
drawn from the request's seeded generator), recomputing the whole context (no cache: the
model is tiny). At most ``max_running`` requests run, the most urgent by priority then
arrival, as vLLM's priority scheduler runs them: a more urgent arrival preempts, and the
preempted request resumes from what it generated. It records what it was asked
(``added``, ``aborted``) for the tests to read.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchery.workers.generation.engine import EngineRunner

CONTEXT = 512  # the tiny GPT-2's positions


@dataclass
class SamplingParams:
    """vLLM's SamplingParams, the fields batchery sets."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None


@dataclass
class Running:
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    generated: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    generator: torch.Generator | None = None


class TinyEngine:
    def __init__(self, model_dir: str, max_running: int = 4) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.max_running = max_running
        self.requests: dict[str, Running] = {}
        self.added: list[tuple[str, int]] = []  # (request id, priority), in order
        self.aborted: list[str] = []
        self.arrivals = itertools.count()

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                    priority: int = 0) -> None:
        ids = list(prompt["prompt_token_ids"])
        if len(ids) + params.max_tokens > CONTEXT:
            raise ValueError(f"this prompt of {len(ids)} tokens and max_tokens "
                             f"{params.max_tokens} exceed the model's {CONTEXT} positions")
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        self.requests[request_id] = Running(ids, params, priority, next(self.arrivals),
                                            generator=generator)
        self.added.append((request_id, priority))

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @torch.inference_mode()
    def step(self) -> list[Any]:
        ranked = sorted(self.requests.items(), key=lambda kv: (kv[1].priority, kv[1].arrival))
        outputs = []
        for rid, r in ranked[:self.max_running]:
            logits = self.model(torch.tensor([r.prompt_ids + r.generated])).logits[0, -1].float()
            if r.params.temperature > 0:
                probs = torch.softmax(logits / r.params.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=r.generator))
            else:
                token = int(torch.argmax(logits))
            r.generated.append(token)
            if r.params.logprobs is not None:
                logprobs = torch.log_softmax(logits, dim=-1)
                top = torch.topk(logprobs, r.params.logprobs or 1).indices.tolist()
                r.logprobs.append({t: SimpleNamespace(logprob=float(logprobs[t]))
                                   for t in {token, *top}})
            text = self.tokenizer.decode(r.generated, skip_special_tokens=True)
            reason = None
            cuts = [i for i in (text.find(s) for s in r.params.stop) if i >= 0]
            if cuts:
                text, reason = text[:min(cuts)], "stop"
            elif len(r.generated) >= r.params.max_tokens:
                reason = "length"
            if reason:
                del self.requests[rid]
            out = SimpleNamespace(text=text, token_ids=list(r.generated), finish_reason=reason,
                                  logprobs=list(r.logprobs) or None)
            outputs.append(SimpleNamespace(request_id=rid, finished=reason is not None,
                                           outputs=[out]))
        return outputs


def runner(model_dir: str | None = None, max_running: int = 4,
           context: int = CONTEXT) -> EngineRunner:
    """The factory ``batchery worker --runner tests.engine_double:runner`` calls: the model
    directory from BATCHERY_TEST_ENGINE_MODEL. ``context``: the context the runner cuts
    prompts to (more than the engine's: the engine refuses what does not fit)."""
    model_dir = model_dir or os.environ["BATCHERY_TEST_ENGINE_MODEL"]
    engine = TinyEngine(model_dir, max_running)
    return EngineRunner(engine, engine.tokenizer, SamplingParams, context, model_dir)
