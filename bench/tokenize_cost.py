"""Tokenize cost: what a counting MiniLM worker spends per request before the model.

A worker whose producer could not count tokens (no transformers there) prices each
estimated request with its tokenizer, then prepares the batch (padding, tensors). The
preparing used to tokenize the texts again; now it pads the tokens kept from the count.
Timed on the real MiniLM runner (``load_runner("embed", "minilm")``, CPU, one thread, as a
worker tokenizes),
for both corpora of bench/corpus.py in batches of 16 and 64: the count, preparing from
the count's tokens, and preparing from the text (what a worker does for a request a
producer counted exactly, and what it did before for all). Each figure is the best of 3.

``python -m bench.tokenize_cost [--quick]``
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from bench import common, corpus

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as a worker: one thread tokenizes

COLUMNS = [("corpus", "corpus", ""), ("batch", "batch", "d"), ("count", "count us/text", ".0f"),
           ("kept", "prepare from the count", ".0f"), ("fresh", "prepare from the text", ".0f"),
           ("ratio", "count + kept / count + fresh", ".2f")]


def best_us(work: Callable[[], Any], texts: int) -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return 1e6 * min(times) / texts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from batchery.workers.runners import load_runner
    from batchery.workers.runners.hf import tokenize
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    runner = load_runner("embed", "minilm", None, "cpu")
    tokenizer, limit = runner._tokenizer, runner.max_input_tokens
    n = 256 if args.quick else 2048
    rows = []
    for name, texts in (("paragraphs", corpus.paragraphs(n)), ("passages", corpus.passages(n))):
        for size in (16, 64):
            batches = [texts[i:i + size] for i in range(0, n, size)]
            row = {"corpus": name, "batch": size,
                   "count": best_us(lambda: [runner.count_tokens(b) for b in batches], n),
                   "kept": best_us(lambda: [runner.prepare(b) for b in batches], n),
                   "fresh": best_us(lambda: [tokenize(tokenizer, b, limit) for b in batches], n)}
            row["ratio"] = (row["count"] + row["kept"]) / (row["count"] + row["fresh"])
            rows.append(row)
    text = common.table(rows, COLUMNS)
    print(f"\n## Tokenize cost: MiniLM, CPU us per text ({common.machine()})\n\n{text}\n")
    common.save("tokenize_cost", {"machine": common.machine(), "rows": rows})
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()
