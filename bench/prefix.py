"""Generation with a shared prompt prefix: prefix caching off against on, in one run.

The workload of issue 32: 500 requests with one system prompt of 512 tokens (passages of
the Python language reference, real English) and a short question each (the opening words
of a standard-library paragraph), outputs long-tailed as in bench/generate.py (4 to 256
tokens, median 24), EOS off, sampling with temperature 0.8 and top_p 0.95 (``--greedy``:
greedy). The model is bench/generate.py's random GPT-2 with a context of 1,024 positions
(the prompt alone is over 512).

Two real ``batchery worker --task generate`` processes, one after the other on fresh
queues of one private Redis, with the worker's defaults but for the prefix cache:
(a) ``--prefix-cache-tokens 0`` (off), (b) its default (on). Every request is queued at
once; tokens/s is from then to the last result. The hit rate is the worker's
``batchery_prefix_reused_tokens_total`` over ``batchery_prefix_prompt_tokens_total``.

``python -m bench.prefix [--quick] [--greedy]``
"""

from __future__ import annotations

import math
import os
import random
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402

from batchery.workers.runners.hf import resolve_model  # noqa: E402
from bench import common  # noqa: E402
from bench.corpus import paragraphs, passages  # noqa: E402
from bench.generate import MODEL, SAMPLING, drain, serving_worker  # noqa: E402

SYSTEM_TOKENS = 512   # the system prompt
QUESTION_WORDS = 12   # a short question: a paragraph's opening words


def build_model(folder: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("minilm"))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tokenizer.vocab_size, bos_token_id=None, eos_token_id=None,
                        **{**MODEL, "n_positions": 1024})
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.model_max_length = config.n_positions  # (MiniLM's own is 512)
    tokenizer.save_pretrained(folder)
    return folder


def system_prompt(tokenizer: Any) -> str:
    """Passages of the language reference, cut to SYSTEM_TOKENS tokens (whole words)."""
    words: list[str] = []
    for passage in passages():
        words += passage.split()
        if len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) > SYSTEM_TOKENS:
            break
    low, high = 0, len(words)  # the most words within SYSTEM_TOKENS tokens
    while low < high:
        mid = (low + high + 1) // 2
        if len(tokenizer(" ".join(words[:mid]), add_special_tokens=False)["input_ids"]) <= SYSTEM_TOKENS:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def workload(system: str, n: int, sampling: dict[str, Any] | None) -> list[dict[str, Any]]:
    rng = random.Random(0)
    news = [min(256, max(4, int(rng.lognormvariate(math.log(24), 1.0)))) for _ in range(n)]
    questions = [" ".join(p.split()[:QUESTION_WORDS]).rstrip(".,;:") + "?" for p in paragraphs(n)]
    return [{"prompt": f"{system}\n\nQuestion: {q}\nAnswer:", "max_new_tokens": m, **(sampling or {})}
            for q, m in zip(questions, news)]


def serve(url: str, model_dir: Path, requests: list[dict[str, Any]], name: str,
          *flags: str) -> dict[str, Any]:
    with serving_worker(url, model_dir, "prefix", *flags) as (client, port):
        latencies, tokens, seconds = drain(client, requests)
        values = common.metrics(port)
    reused, prompt = (values.get(f"batchery_prefix_{k}_tokens_total", 0.0) for k in ("reused", "prompt"))
    return {"system": name, "requests": len(latencies), "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_s": tokens / seconds,
            "p50_s": common.percentile(latencies, 0.5), "p99_s": common.percentile(latencies, 0.99),
            "hit_rate": reused / prompt if prompt else 0.0, "load": os.getloadavg()[0]}


COLUMNS = (("system", "system", ""), ("requests", "requests", "d"), ("tokens", "tokens", "d"),
           ("tokens_s", "tokens/s", ".0f"), ("p50_s", "latency p50 s", ".1f"),
           ("p99_s", "latency p99 s", ".1f"), ("hit_rate", "prefix hit rate", ".3f"),
           ("x_off", "x (a)", ".2f"), ("load", "load avg after", ".1f"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling, "
                   "temperature 0.8 and top_p 0.95)")
    args = p.parse_args(argv)
    n = 100 if args.quick else 500
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="batchery-gpt2-") as folder, common.private_redis() as url:
        model_dir = build_model(Path(folder))
        system = system_prompt(AutoTokenizer.from_pretrained(model_dir))
        requests = workload(system, n, None if args.greedy else SAMPLING)
        for _ in range(args.repeat):
            common.log(f"prefix: {n} requests, (a) prefix caching off ...")
            rows.append(serve(url, model_dir, requests, "(a) batchery, prefix caching off",
                              "--prefix-cache-tokens", "0"))
            common.log("prefix: (b) prefix caching on (the default) ...")
            rows.append(serve(url, model_dir, requests, "(b) batchery, prefix caching on"))
    best = [max((r for r in rows if r["system"] == s), key=lambda r: r["tokens_s"])
            for s in dict.fromkeys(r["system"] for r in rows)]
    for r in best:
        r["x_off"] = r["tokens_s"] / best[0]["tokens_s"]
    text = common.table(best, COLUMNS)
    ratio = best[1]["x_off"]
    check = f"(b) / (a) tokens/s: {ratio:.2f} (target >= 2): {'met' if ratio >= 2 else 'MISSED'}"
    mode = "greedy" if args.greedy else f"sampling {SAMPLING}"
    print(f"\n## Shared prefix of {SYSTEM_TOKENS} tokens, {mode} ({common.machine()})\n\n"
          f"{text}\n\n{check}\n")
    common.save("prefix", {"machine": common.machine(), "runs": rows, "targets": [check]})
    return {"table": text, "targets": [check]}


if __name__ == "__main__":
    main()
