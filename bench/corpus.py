"""Real English paragraphs of varied length: the docstrings of the Python standard library.

Built at run time from the installed stdlib's source (parsed, never imported), so no
data is committed and every machine with the same Python gets the same paragraphs.
"""

from __future__ import annotations

import ast
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


def paragraphs(n: int | None = None, min_chars: int = 40) -> list[str]:
    """The first ``n`` paragraphs (all when None), in a fixed order; repeats if n is larger."""
    every = _all_paragraphs(min_chars)
    if n is None:
        return list(every)
    return [every[i % len(every)] for i in range(n)]


if __name__ == "__main__":
    texts = paragraphs()
    lengths = sorted(len(t) for t in texts)
    print(f"{len(texts)} paragraphs; chars p10={lengths[len(lengths) // 10]} "
          f"p50={lengths[len(lengths) // 2]} p90={lengths[9 * len(lengths) // 10]} max={lengths[-1]}")
