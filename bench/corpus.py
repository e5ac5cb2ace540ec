"""Real English text of varied length, built at run time (no data is committed).

``paragraphs``: the docstrings of the Python standard library (parsed, never imported),
short to medium (mean about 35 tokens). ``passages``: the Python language reference as
``pydoc`` ships it, as passages of one to six consecutive paragraphs of one topic:
longer and wider, from a sentence to past the 256 tokens an encoder keeps (the chunks a
retrieval index embeds). Every machine
with the same Python gets the same texts.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

SKIP_DIRS = {"test", "tests", "site-packages", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
WORD = re.compile(r"[A-Za-z]{2,}")


@lru_cache(maxsize=None)
def _all_paragraphs(min_chars: int) -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        for doc in _docstrings(path):
            for block in re.split(r"\n\s*\n", doc):
                text = " ".join(block.split())
                if len(text) >= min_chars and text not in seen and _is_prose(text):
                    seen.add(text)
                    out.append(text)
    return tuple(out)


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return [d for d in (ast.get_docstring(n) for n in nodes) if d]


def _is_prose(text: str) -> bool:
    """Mostly words, not a code sample or a table."""
    words = WORD.findall(text)
    return len(words) >= 6 and sum(map(len, words)) >= 0.6 * len(text) and ">>>" not in text


@lru_cache(maxsize=None)
def _all_passages() -> tuple[str, ...]:
    from pydoc_data.topics import topics
    pick = random.Random(0)  # a fixed cut: the same passages on every run
    out: list[str] = []
    for name in sorted(topics):
        blocks = [" ".join(b.split()) for b in re.split(r"\n\s*\n", topics[name])]
        prose = [b for b in blocks if len(b) >= 40 and _is_prose(b)]
        for start in range(len(prose)):  # one passage per paragraph, as a sliding-window index
            out.append(" ".join(prose[start:start + pick.choice((1, 1, 2, 2, 3, 4, 6))]))
    return tuple(dict.fromkeys(out))


def passages(n: int | None = None) -> list[str]:
    """The first ``n`` passages of the language reference, shuffled once with a fixed seed
    (so any prefix mixes topics and lengths); repeats if n is larger."""
    every = list(_all_passages())
    random.Random(1).shuffle(every)
    if n is None:
        return every
    return [every[i % len(every)] for i in range(n)]


def paragraphs(n: int | None = None, min_chars: int = 40) -> list[str]:
    """The first ``n`` paragraphs (all when None), in a fixed order; repeats if n is larger."""
    every = _all_paragraphs(min_chars)
    if n is None:
        return list(every)
    return [every[i % len(every)] for i in range(n)]


if __name__ == "__main__":
    for name, texts in (("paragraphs", paragraphs()), ("passages", passages())):
        lengths = sorted(len(t) for t in texts)
        print(f"{name}: {len(texts)} texts; chars p10={lengths[len(lengths) // 10]} "
              f"p50={lengths[len(lengths) // 2]} p90={lengths[9 * len(lengths) // 10]} "
              f"max={lengths[-1]}")
