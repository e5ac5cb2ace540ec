"""``--task generate``: causal LM text generation.

The worker runs it with continuous batching (workers/generation/worker.py over
generation/batch.py): ``sequence`` and ``new_batch`` are what that loop uses. ``prepare``
and ``run`` are the static batch (greedy, left padding, the whole batch for its longest
generation) that other callers and the benchmark's baseline use.

An input is a prompt string or an object (generation/sampling.py lists its fields). A
request costs its prompt plus its new tokens, which is what the budget counts.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from batchery.workers.runners.base import InputError, Prepared
from batchery.workers.generation.batch import DecodeBatch, Sequence
from batchery.workers.runners.hf import HFRunner, count_texts, encode_tensors, to_device
from batchery.workers.generation.sampling import GenParams, parse_params


class GenerateRunner(HFRunner):
    model_class = AutoModelForCausalLM
    padding_side = "left"  # new tokens follow each prompt directly
    sample_input = None    # decoding time depends on the outputs: no batch-size calibration

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model_dir, device, dtype)
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token or self._tokenizer.unk_token
        self._eos = self._model.generation_config.eos_token_id
        eos = self._eos if isinstance(self._eos, list) else [self._eos]
        self.eos_ids = frozenset(i for i in eos if isinstance(i, int) and i >= 0)

    def sequence(self, key: Any, value: Any) -> Sequence:
        """A request ready to join a DecodeBatch; raises InputError for bad parameters."""
        params = parse_params(value)
        room = self.max_input_tokens - params.max_new_tokens
        if room < 1:
            raise InputError(f"max_new_tokens {params.max_new_tokens} leaves no room for the "
                             f"prompt in this model's context of {self.max_input_tokens} "
                             "tokens; ask for fewer new tokens")
        ids = self._tokenizer(self.prompt(params), truncation=True, max_length=room,
                              add_special_tokens=not self._templated(params))["input_ids"]
        return Sequence(key, params, list(ids))

    def prompt(self, params: GenParams) -> str:
        return render_prompt(self._tokenizer, params)

    def _templated(self, params: GenParams) -> bool:
        return templated(self._tokenizer, params)

    def new_batch(self, prefix_tokens: int = 0) -> DecodeBatch:
        """An empty batch, with a prefix cache of ``prefix_tokens`` tokens (0: none)."""
        return DecodeBatch(self._model, self.device, self._tokenizer.pad_token_id, prefix_tokens)

    def text(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def text_delta(self, s: Sequence, final: bool = False) -> str:
        """The text ``s``'s newest tokens add to what it has (incremental detokenization,
        as TGI and vLLM do it): two short windows decoded instead of the whole text. The
        window starts at the token before the last ones emitted, so that spacing and
        merges between tokens come out as a whole decode gives them; a window that ends
        inside a character (a byte-level token) waits for the next token, unless
        ``final``."""
        ids = s.generated
        before = self.text(ids[s.decoded_from:s.decoded_to])
        after = self.text(ids[s.decoded_from:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            s.decoded_from, s.decoded_to = s.decoded_to, len(ids)
            return after[len(before):]
        return ""

    def prepare(self, inputs: list[Any]) -> Prepared:
        params = [parse_params(v) for v in inputs]
        prompts, new_tokens = [self.prompt(p) for p in params], [p.max_new_tokens for p in params]
        room = max(1, self.max_input_tokens - max(new_tokens))
        # no token_type_ids: a BERT-style tokenizer returns them, and GPT-2 would add them
        # to its inputs as token embeddings (of id 0), changing what it generates
        encoded = encode_tensors(self._tokenizer, prompts, padding=True, truncation=True,
                                 max_length=room, return_token_type_ids=False)
        mask = encoded["attention_mask"]
        lengths = [int(n) + m for n, m in zip(mask.sum(dim=1).tolist(), new_tokens)]
        padded = (mask.shape[1] + max(new_tokens)) * len(prompts)
        return Prepared(data=(encoded, new_tokens), lengths=lengths, padded=padded)

    def count_tokens(self, inputs: list[Any]) -> list[int | None] | None:
        """Prompt (cut to the room its new tokens leave) plus its new tokens."""
        params = [params_or_none(v) for v in inputs]
        counts = count_texts(self._tokenizer, [p and self.prompt(p) for p in params],
                             self.max_input_tokens)
        return [None if c is None or p is None else
                min(c, max(1, self.max_input_tokens - p.max_new_tokens)) + p.max_new_tokens
                for c, p in zip(counts, params)]

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


def render_prompt(tokenizer: Any, params: GenParams) -> str:
    """The text the model continues: the prompt, or the chat messages rendered by the
    tokenizer's chat template (a plain "role: content" transcript when it has none)."""
    if not params.messages:
        return params.prompt
    messages = [{"role": r, "content": c} for r, c in params.messages]
    if templated(tokenizer, params):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{r}: {c}\n" for r, c in params.messages) + "assistant:"


def templated(tokenizer: Any, params: GenParams) -> bool:
    """A chat rendered by the template, which writes its special tokens itself."""
    return bool(params.messages) and bool(getattr(tokenizer, "chat_template", None))


def params_or_none(value: Any) -> GenParams | None:
    try:
        return parse_params(value)
    except InputError:  # it fails alone when it runs
        return None
