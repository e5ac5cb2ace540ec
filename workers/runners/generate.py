"""``--task generate``: causal LM text generation, greedy, batched with left padding.

An input is a prompt string or ``{"prompt": str, "max_new_tokens": int}``. A request
costs its prompt plus its new tokens, which is what the batch budget counts.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from batchery.workers.runners.base import InputError, Prepared, text_of
from batchery.workers.runners.hf import HFRunner, text_or_none, count_texts, to_device

DEFAULT_NEW_TOKENS = 32
MAX_NEW_TOKENS = 1024


class GenerateRunner(HFRunner):
    model_class = AutoModelForCausalLM
    padding_side = "left"  # new tokens follow each prompt directly
    sample_input = None    # decoding time depends on the outputs: no batch-size calibration

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model_dir, device, dtype)
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token or self._tokenizer.unk_token
        self._eos = self._model.generation_config.eos_token_id

    def prepare(self, inputs: list[Any]) -> Prepared:
        prompts = [text_of(v, ("prompt", "text")) for v in inputs]
        new_tokens = [_new_tokens(v) for v in inputs]
        room = max(1, self.max_input_tokens - max(new_tokens))
        encoded = self._tokenizer(prompts, padding=True, truncation=True, max_length=room,
                                  return_tensors="pt")
        mask = encoded["attention_mask"]
        lengths = [int(n) + m for n, m in zip(mask.sum(dim=1).tolist(), new_tokens)]
        padded = (mask.shape[1] + max(new_tokens)) * len(prompts)
        return Prepared(data=(encoded, new_tokens), lengths=lengths, padded=padded)

    def count_tokens(self, inputs: list[Any]) -> list[int | None] | None:
        """Prompt (cut to the room its new tokens leave) plus its new tokens."""
        news = [_new_tokens_or_none(v) for v in inputs]
        prompts = [text_or_none(v, ("prompt", "text")) if n else None for v, n in zip(inputs, news)]
        counts = count_texts(self._tokenizer, prompts, self.max_input_tokens)
        return [None if c is None or n is None else min(c, max(1, self.max_input_tokens - n)) + n
                for c, n in zip(counts, news)]

    @torch.inference_mode()
    def run(self, data: Any) -> list[Any]:
        encoded, new_tokens = data
        prompt_len = encoded["input_ids"].shape[1]
        out = self._model.generate(**to_device(encoded, self.device), max_new_tokens=max(new_tokens),
                                   do_sample=False, pad_token_id=self._tokenizer.pad_token_id)
        results = []
        for row, limit in zip(out[:, prompt_len:].cpu().tolist(), new_tokens):
            ids = row[:limit]
            if self._eos in ids:  # what follows the end of a sequence is padding
                ids = ids[:ids.index(self._eos)]
            results.append({"text": self._tokenizer.decode(ids, skip_special_tokens=True),
                            "tokens": len(ids)})
        return results


def _new_tokens_or_none(value: Any) -> int | None:
    try:
        return _new_tokens(value)
    except InputError:
        return None


def _new_tokens(value: Any) -> int:
    if not isinstance(value, dict) or "max_new_tokens" not in value:
        return DEFAULT_NEW_TOKENS
    n = value["max_new_tokens"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS:
        raise InputError(f"max_new_tokens must be an integer 1..{MAX_NEW_TOKENS}, got {n!r}")
    return n
