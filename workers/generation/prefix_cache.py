"""Prefix caching: the KV of prompt prefixes that requests share (a system prompt, a
few-shot block) is kept and reused instead of being prefilled again (vLLM's automatic
prefix caching, simplified to the slab: generation/batch.py copies a cached prefix into a
newcomer's prefill cache and prefills only the rest).

A context is cut into blocks of ``BLOCK_TOKENS`` tokens; each full block is named by a
chained digest (the digest of the previous block's name and the block's token ids), so
one name stands for the whole prefix up to that block. The cache maps names to one
row's keys and values for the block, per layer, and holds at most ``max_tokens`` tokens
of them: least recently used blocks go first, the deepest of a prefix before its root
(a prefix is touched from its last block back to its first), so a prefix wears down from
its end, never losing its beginning while its tail is still kept.

``plan`` groups newcomers prefilled together by the prefix they share: each group's
rows take the same cached blocks, and blocks not cached yet that two or more of them
share are prefilled once, for one row, before the group's rows go on apart.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from batchery.workers import metrics

# Tokens per block: a hit is a whole number of blocks. vLLM's default is 16; shorter
# blocks find longer hits but cost a digest and a dictionary entry each (a 512-token
# system prompt is 32 blocks; the digests of a 1,000-token context take ~0.1 ms).
BLOCK_TOKENS = 16
# The prefix cache's default size, as a share of the worker's KV budget
# (--max-batch-tokens): a quarter keeps a few long system prompts and few-shot blocks with
# room to spare, and adds at most a quarter to the memory the running rows' cache takes.
CACHE_SHARE = 0.25

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, [1, heads, n, dim]


def chain(ids: list[int], blocks: int | None = None) -> list[bytes]:
    """The chained digests of the full blocks of ``ids`` (the first ``blocks`` of them)."""
    count = len(ids) // BLOCK_TOKENS if blocks is None else min(blocks, len(ids) // BLOCK_TOKENS)
    names, previous = [], b""
    for b in range(count):
        block = array("q", ids[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        names.append(previous)
    return names


@dataclass
class Group:
    """Newcomers to prefill together: ``rows`` (indices into the newcomers) share their
    first ``shared`` blocks, of which the first ``cached`` are in the cache."""

    rows: list[int]
    shared: int
    cached: int


class PrefixCache:
    """Blocks of prefix KV, least recently used out first (see the module's docstring)."""

    def __init__(self, max_tokens: int) -> None:
        self.capacity = max(0, max_tokens) // BLOCK_TOKENS  # blocks
        self.blocks: OrderedDict[bytes, Layers] = OrderedDict()
        self.prompt_tokens = 0   # context tokens of the prefills planned
        self.reused_tokens = 0   # of those, taken from the cache or prefilled once for a group

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def cached(self, names: list[bytes]) -> int:
        """How many of ``names``' first blocks are in the cache."""
        n = 0
        while n < len(names) and names[n] in self.blocks:
            n += 1
        return n

    def plan(self, contexts: list[list[int]]) -> tuple[list[list[bytes]], list[Group]]:
        """Each context's block names, and the newcomers grouped by the prefix they share.
        A row may take at most its context less one token from a prefix (its next token
        comes out of the prefill). A prefix counts for a row if it is cached or if another
        newcomer shares it; a row alone with a prefix keeps only its cached part."""
        names = [chain(c) for c in contexts]
        usable = [n[:(len(c) - 1) // BLOCK_TOKENS] for n, c in zip(names, contexts)]
        sharing: dict[bytes, int] = {}
        for u in usable:
            for name in u:
                sharing[name] = sharing.get(name, 0) + 1
        depth = [max(self.cached(u), max((k + 1 for k, name in enumerate(u) if sharing[name] > 1),
                                         default=0)) for u in usable]
        keys = [u[d - 1] if d else None for u, d in zip(usable, depth)]
        members: dict[Any, list[int]] = {}
        for i, key in enumerate(keys):
            members.setdefault(key, []).append(i)
        for key, rows in list(members.items()):  # alone: no one to share the uncached part with
            if key is not None and len(rows) == 1 and self.cached(usable[rows[0]]) < depth[rows[0]]:
                i = rows[0]
                depth[i] = self.cached(usable[i])
                keys[i] = usable[i][depth[i] - 1] if depth[i] else None
        groups: dict[Any, Group] = {}
        for i, key in enumerate(keys):
            if key not in groups:
                groups[key] = Group([], depth[i], self.cached(usable[i][:depth[i]]))
            groups[key].rows.append(i)
        plans = list(groups.values())
        for g in plans:
            shared = g.shared * BLOCK_TOKENS
            self.count(sum(len(contexts[i]) for i in g.rows),
                       len(g.rows) * shared - (shared - g.cached * BLOCK_TOKENS) if shared else 0)
        return names, plans

    def count(self, prompt: int, reused: int) -> None:
        self.prompt_tokens += prompt
        self.reused_tokens += reused
        metrics.PREFIX_PROMPT_TOKENS.inc(prompt)
        metrics.PREFIX_REUSED_TOKENS.inc(reused)
        metrics.PREFIX_HIT_RATE.set(self.hit_rate)

    def load(self, names: list[bytes]) -> Layers:
        """The cached KV of the prefix ``names`` (every block cached), one row, per layer."""
        blocks = [self.blocks[name] for name in names]
        self._touch(names)
        return [(torch.cat([b[layer][0] for b in blocks], dim=-2),
                 torch.cat([b[layer][1] for b in blocks], dim=-2)) for layer in range(len(blocks[0]))]

    def store(self, names: list[bytes], layers: Layers, row: int, columns: list[int]) -> None:
        """Keep blocks ``names`` of row ``row`` of a prefill's cache (``layers``: keys and
        values per layer, [rows, heads, width, dim]), block k starting at column
        ``columns[k]``; blocks already cached are only touched."""
        names = names[:self.capacity]  # a prefix longer than the cache: its beginning
        self._touch(names)               # (kept from eviction below)
        for name, column in zip(names, columns):
            if name in self.blocks:
                continue
            while len(self.blocks) >= self.capacity:
                self.blocks.popitem(last=False)
            end = column + BLOCK_TOKENS
            self.blocks[name] = [(k[row:row + 1, :, column:end].clone(),
                                  v[row:row + 1, :, column:end].clone()) for k, v in layers]
        self._touch(names)

    def _touch(self, names: list[bytes]) -> None:
        """Most recently used: the prefix's first block, then the next... (its last block
        goes first when room is needed)."""
        for name in reversed(names):
            if name in self.blocks:
                self.blocks.move_to_end(name)
