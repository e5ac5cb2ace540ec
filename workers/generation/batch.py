"""Iteration-level batching: sequences join and leave between decode steps.

The running sequences share one left-padded KV cache, written in place (generation/kv_slab.py:
a step writes one column per row, a newcomer's prefill cache is copied into a free row, a
row that leaves is replaced by the last one), with an attention mask marking each row's
real tokens; each row keeps its own position counter, so padding never shifts a position.
Newcomers are prefilled together in a cache of their own (a chunk of columns at a time if
the worker asks: a long prompt then does not stall the running rows for its whole
prefill). Compute and memory follow the rows times the longest row, not a paged cache:
what a CPU or one GPU running a small model needs.

Why not transformers' ``ContinuousBatchingManager`` (5.x): it runs on the CPU with a small
GPT-2 here, but one ``GenerationConfig`` serves all its requests (no per-request
temperature, top_p, top_k or seed), it has no stop strings, and it schedules in a
background thread of its own, so nothing could claim from Redis between two of its steps,
stop a sequence whose lease was lost, or count steps. The scheduling is the product here.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from batchery.workers.generation.kv_slab import Slab
from batchery.workers.generation.prefix_cache import BLOCK_TOKENS, PrefixCache
from batchery.workers.generation.sampling import GenParams, Rows, choose, new_generator


@dataclass(eq=False)
class Sequence:
    """One request in flight: its tokens so far and how it may end."""

    key: Any                         # the caller's handle on it (the claimed request)
    params: GenParams
    prompt_ids: list[int]
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # a seeded row's own, on the model's device
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | cancelled | deadline, once it ended
    text: str = ""                   # the decoded text, cut before a stop string
    sent: str = ""                   # the text already written to its stream
    decoded_from: int = 0            # incremental decoding: the window's first token,
    decoded_to: int = 0              # and the end of what ``text`` holds of it

    @property
    def reserved(self) -> int:
        """Tokens of KV cache it may come to hold: what the worker's budget counts."""
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def context(self) -> list[int]:
        """What a prefill feeds: the prompt, and what it generated before it was preempted
        (its next token comes out of that prefill, as out of a decode step)."""
        return self.prompt_ids + self.generated


@dataclass(eq=False)
class Prefill:
    """Newcomers being prefilled together, a chunk of columns at a time, in a cache of
    their own until they join the running rows. Each row is its context, left-padded after
    the first ``shared`` columns: a prefix all rows have (generation/prefix_cache.py), taken
    from the prefix cache where it is there (``done`` starts past it) and prefilled for one
    row where it is not, the cache widened to every row once it is in."""

    seqs: list[Sequence]
    ids: torch.Tensor        # [rows, width]: the contexts, left-padded (after the shared prefix)
    mask: torch.Tensor       # [rows, width]: 1 on real tokens
    cache: DynamicCache
    done: int = 0            # columns prefilled (or taken from the prefix cache) so far
    chunks: int = 0          # forward passes it took, for logs and tests
    shared: int = 0          # the first columns, the same in every row
    single: bool = False     # the cache holds one row yet: the shared prefix is being prefilled
    names: list[list[bytes]] = field(default_factory=list)  # each row's block names, to store
    fed: int = 0             # real tokens through the model so far,
    padded: int = 0          # and positions (real and padding)


def cache_keyword(model: Any) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` from transformers 5.x
    on (where ``past_key_values`` is deprecated, to go in 5.40), ``past_key_values`` before;
    a wrapper whose forward names neither (``**kwargs``) gets the library's own name."""
    forward = getattr(model, "_orig_mod", model).forward  # (torch.compile's wrapper: its model)
    named = inspect.signature(forward).parameters
    library = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return next((name for name in ("cache", "past_key_values") if name in named), library)


def cache_out(out: Any) -> Any:
    """The KV cache a forward pass returned, under either name (cache_keyword)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


class DecodeBatch:
    """The sequences in flight and their shared cache; one forward pass per step."""

    def __init__(self, model: Any, device: torch.device, pad_id: int, prefix_tokens: int = 0) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self._cache_kw = cache_keyword(model)
        # prompt prefixes' KV kept for reuse, up to ``prefix_tokens`` tokens (0: none)
        self.prefixes = PrefixCache(prefix_tokens) if prefix_tokens > 0 else None
        self.rows: list[Sequence] = []
        self.steps = 0          # decode steps run, for logs and tests
        self.seconds = {"model": 0.0, "sampling": 0.0}  # spent in forward passes, in choosing tokens
        self.slab = Slab(model.config, device)  # the running rows' KV cache, written in place
        self._pos = torch.zeros(0, dtype=torch.long, device=device)  # next position per row
        self._last = torch.zeros(0, dtype=torch.long, device=device)  # last token per row
        self._params: Rows | None = None    # the rows' parameters as tensors, for these rows:
        self._params_of: list[Sequence] = []  # rebuilt when they change
        self.errors: list[Exception] = []  # what the last step's forward passes raised (bisected)

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def add(self, seqs: list[Sequence]) -> list[Any]:
        """Prefill newcomers at once and stack them under the running rows; their first tokens."""
        tokens_of = {}
        for prefill in self.prefills(seqs):
            tokens = self.advance(prefill, 0)
            assert tokens is not None
            self.join(prefill, tokens)
            tokens_of.update((id(s), t) for s, t in zip(prefill.seqs, tokens))
        return [tokens_of[id(s)] for s in seqs]

    def prefills(self, seqs: list[Sequence]) -> list[Prefill]:
        """Newcomers to prefill: one prefill per prefix they share (the prefix cache's
        plan), or all in one when there is no prefix cache."""
        if self.prefixes is None:
            return [self.start(seqs)]
        names, groups = self.prefixes.plan([s.context for s in seqs])
        return [self.start([seqs[i] for i in g.rows], g.shared * BLOCK_TOKENS,
                           [names[i] for i in g.rows], g.cached) for g in groups]

    def start(self, seqs: list[Sequence], shared: int = 0, names: list[list[bytes]] | None = None,
              cached: int = 0) -> Prefill:
        """Newcomers to prefill (their contexts left-padded to the longest, after the first
        ``shared`` tokens, which they all have; the first ``cached`` blocks of those come
        from the prefix cache)."""
        contexts = [s.context for s in seqs]
        width = shared + max(len(c) - shared for c in contexts)
        ids = torch.tensor([c[:shared] + [self.pad_id] * (width - len(c)) + c[shared:]
                            for c in contexts], device=self.device)
        mask = torch.tensor([[1] * shared + [0] * (width - len(c)) + [1] * (len(c) - shared)
                             for c in contexts], device=self.device)
        p = Prefill(seqs, ids, mask, DynamicCache(config=self.model.config), shared=shared,
                    single=shared > 0, names=names or [])
        if cached and self.prefixes is not None:
            for i, (k, v) in enumerate(self.prefixes.load(p.names[0][:cached])):
                p.cache.update(k, v, i)
            p.done = cached * BLOCK_TOKENS
        if p.single and p.done >= shared:
            self._widen(p)
        return p

    @torch.inference_mode()
    def advance(self, p: Prefill, max_tokens: int) -> list[Any] | None:
        """Prefill the next chunks of ``p``: as many columns as keep it within ``max_tokens``
        tokens (at least one; 0: all the rest). The newcomers' first tokens once their
        contexts are all in (or a row's own error), else None."""
        rows, width = p.ids.shape
        left = max_tokens
        while True:
            stage = 1 if p.single else rows  # a shared prefix is prefilled for one row
            limit = p.shared if p.single else width
            columns = limit - p.done if max_tokens <= 0 else max(1, left // stage)
            end = min(limit, p.done + columns)
            positions = (p.mask[:stage, :end].cumsum(dim=-1) - 1).clamp(min=0)[:, p.done:end]
            started = time.perf_counter()
            out = self.model(input_ids=p.ids[:stage, p.done:end], attention_mask=p.mask[:stage, :end],
                             position_ids=positions, use_cache=True, logits_to_keep=1,
                             **{self._cache_kw: p.cache})
            self.seconds["model"] += time.perf_counter() - started
            p.fed += int(p.mask[:stage, p.done:end].sum())
            p.padded, left = p.padded + stage * (end - p.done), left - stage * (end - p.done)
            p.cache, p.done, p.chunks = cache_out(out), end, p.chunks + 1
            if p.single and end >= p.shared:
                self._widen(p)
            if end >= width:
                break
            if max_tokens > 0 and left < (1 if p.single else rows):
                return None
        self._remember(p)
        for s in p.seqs:
            s.generator = s.generator or new_generator(s.params, self.device)
        return self._choose(out.logits[:, -1, :], p.seqs, self._rows_of(p.seqs))

    def _widen(self, p: Prefill) -> None:
        """The shared prefix is in (one row): keep its blocks, and give every row its KV."""
        blocks = p.shared // BLOCK_TOKENS
        if self.prefixes is not None and p.names:
            self.prefixes.store(p.names[0][:blocks], self._kv(p), 0,
                                [b * BLOCK_TOKENS for b in range(blocks)])
        for layer in self._layers(p.cache):
            layer.keys = layer.keys.expand(len(p.seqs), -1, -1, -1)
            layer.values = layer.values.expand(len(p.seqs), -1, -1, -1)
        p.single = False

    def _remember(self, p: Prefill) -> None:
        """Keep the full blocks of each row's context past the shared prefix (prefix cache)."""
        if self.prefixes is None or not p.names:
            return
        width, first = p.ids.shape[1], p.shared // BLOCK_TOKENS
        layers = self._kv(p)
        for i, (s, names) in enumerate(zip(p.seqs, p.names)):
            pad = width - len(s.context)  # a block's column: its position, after the padding
            self.prefixes.store(names[first:], layers, i,
                                [pad + b * BLOCK_TOKENS for b in range(first, len(names))])

    def _kv(self, p: Prefill) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self._layers(p.cache)]

    @torch.inference_mode()
    def join(self, p: Prefill, tokens: list[Any]) -> None:
        """Copy a finished prefill's cache into the running rows' free rows, each row with
        ``tokens``, its next token, to feed."""
        pos, last = torch.cat([self._pos, p.mask.sum(dim=-1)]), torch.cat([self._last, self._feed(tokens)])
        self.slab.add([(layer.keys, layer.values) for layer in p.cache.layers], p.mask)
        self.rows, self._pos, self._last = self.rows + p.seqs, pos, last

    @torch.inference_mode()
    def step(self) -> list[Any]:
        """One decode step of every row: each row's next token, or its own error. A step
        that raises is bisected: each half of the rows steps apart, down to the row that
        raises alone, which gets the error; the others have their token as usual."""
        self.slab.open_column()
        self.errors = []
        if self._params is None or self._params_of != self.rows:  # (by identity: eq=False)
            self._params, self._params_of = self._rows_of(self.rows), list(self.rows)
        tokens = self._step(0, len(self.rows))
        self.slab.close_column()
        self._pos = self._pos + 1
        self._last = self._feed(tokens)
        self.steps += 1
        return tokens

    def _step(self, a: int, b: int) -> list[Any]:
        """Rows [a, b) through the model and the sampler; halves apart if that raises."""
        try:
            started = time.perf_counter()
            out = self.model(input_ids=self._last[a:b, None],
                             attention_mask=self.slab.window(a, b, extra=1),
                             position_ids=self._pos[a:b, None],
                             use_cache=True, **{self._cache_kw: self.slab.use(a, b)})
            self.seconds["model"] += time.perf_counter() - started
            rows = self._params if (a, b) == (0, len(self.rows)) else self._rows_of(self.rows[a:b])
            return self._choose(out.logits[:, -1, :], self.rows[a:b], rows)
        except Exception as exc:  # the model raised for some row(s): its columns are rewritten
            self.errors.append(exc)
            if b - a == 1:
                return [exc]
            middle = (a + b) // 2
            return self._step(a, middle) + self._step(middle, b)

    def _rows_of(self, seqs: list[Sequence]) -> Rows:
        return Rows.of([s.params for s in seqs], [s.generator for s in seqs],
                       self.model.config.vocab_size, self.device)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], rows: Rows) -> list[Any]:
        """Every row's next token (or its own error) in one call on the device; the
        log-probabilities asked for go to their sequences."""
        started = time.perf_counter()
        penalized = rows.any_penalized
        chosen = choose(logits, rows, [s.context for s in seqs] if penalized else None,
                        [s.generated for s in seqs] if penalized else None)
        for i, (mine, top) in chosen.logprobs.items():
            if isinstance(chosen.tokens[i], int):
                seqs[i].logprobs.append((chosen.tokens[i], mine, top))
        self.seconds["sampling"] += time.perf_counter() - started
        return chosen.tokens

    def _feed(self, tokens: list[Any]) -> torch.Tensor:
        """The tokens to feed next (padding for a row that failed: it leaves the batch)."""
        return torch.tensor([t if isinstance(t, int) else self.pad_id for t in tokens],
                            dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def drop(self, leaving: list[Sequence]) -> None:
        """Take rows out of the batch (the last rows move into their places)."""
        ids = {id(s) for s in leaving}
        gone = {i for i, s in enumerate(self.rows) if id(s) in ids}
        if not gone:
            return
        order = self.slab.remove(gone)
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        self.rows = [self.rows[i] for i in order]
        self._pos, self._last = self._pos[index], self._last[index]

    @torch.inference_mode()
    def shrink(self, p: Prefill, leaving: list[Sequence]) -> None:
        """Cut rows out of a prefill under way."""
        gone = {id(s) for s in leaving}
        keep = [i for i, s in enumerate(p.seqs) if id(s) not in gone]
        if len(keep) == len(p.seqs):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        p.seqs, p.ids, p.mask = [p.seqs[i] for i in keep], p.ids[index], p.mask[index]
        p.names = [p.names[i] for i in keep] if p.names else []
        for layer in [] if p.single else self._layers(p.cache):  # (one row: the shared prefix's)
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys[index], layer.values[index]

    @staticmethod
    def _layers(cache: DynamicCache | None) -> list[Any]:
        return list(cache.layers) if cache is not None else []
