"""mkdocs hooks: the source tree as it installs (for the API reference), and the parts of
pages that are read from the code when the site is built, so they cannot drift from it.

- batchery's subpackages live in folders named otherwise (setup.cfg's package_dir:
  batchery.producer is producer/, batchery.batching is batching/, ...), which a reader
  of source files (mkdocstrings' griffe) cannot follow. The tree is copied into
  build/api-src/ the way pip installs it, before any page is read.
- A page line ``<!-- generated: NAME -->`` is replaced by the table NAME: the Lua
  scripts' contracts (their header comments), the queue settings (QueueSettings' fields,
  defaults, comments and ranges), the worker's Prometheus metrics.
"""

from __future__ import annotations

import configparser
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "api-src"


def package_dirs() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["package_dir"].strip().splitlines()
    return dict(line.replace(" ", "").split("=", 1) for line in lines if "=" in line)


def copy_tree() -> None:
    shutil.rmtree(TREE, ignore_errors=True)
    for package, folder in sorted(package_dirs().items()):
        target = TREE.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in (ROOT / folder).glob("*.py"):
            shutil.copyfile(source, target / source.name)  # a link: griffe follows it back


def lua_contracts() -> str:
    """Each script's header: the comment lines before its first line of code."""
    sections = []
    for path in sorted((ROOT / "batching" / "lua").glob("*.lua")):
        if path.name.startswith("_"):
            continue
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("--"):
                break
            header.append(line[3:] if line.startswith("-- ") else line[2:])
        sections.append(f"### {path.name}\n\n```text\n" + "\n".join(header) + "\n```\n")
    return "\n".join(sections)


def queue_settings() -> str:
    """QueueSettings' fields: default, accepted range, and the comment above each."""
    from batchery.batching import settings
    defaults = asdict(settings.QueueSettings())
    comments: dict[str, str] = {}
    pending: list[str] = []
    source = Path(settings.__file__).read_text()
    body = source.split("class QueueSettings", 1)[1].split("\n\n\n", 1)[0]
    for line in body.splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            pending.append(text.lstrip("# "))
        elif ":" in text and not text.startswith(('"', "'")) and pending:
            comments[text.split(":", 1)[0]] = " ".join(pending)
            pending = []
    rows = ["| setting | default | range | what |", "|---|---|---|---|"]
    for name, default in defaults.items():
        low_high = settings.LIMITS.get(name)
        shown = ", ".join(f"{k}={v:g}" for k, v in default.items()) if isinstance(default, dict) \
            else f"{default}"
        bounds = f"{number(low_high[0])}..{number(low_high[1])}" if low_high else ""
        what = comments.get(name, "").replace("|", "\\|")
        rows.append(f"| `{name}` | `{shown}` | {bounds} | {what} |")
    return "\n".join(rows) + "\n"


def number(value: float) -> str:
    return f"{int(value):,}" if value == int(value) else f"{value:g}"


def worker_metrics() -> str:
    """Every Prometheus metric a worker declares, with its type, labels and help."""
    from prometheus_client.metrics import MetricWrapperBase

    from batchery.workers import metrics
    found = [*vars(metrics).values(), *getattr(metrics, "_BY_QUEUE", {}).values()]
    declared = {m._name: m for m in found
                if isinstance(m, MetricWrapperBase) and m._labelnames}  # not bound children
    rows = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for metric in sorted(declared.values(), key=lambda m: m._name):
        name = metric._name + ("_total" if metric._type == "counter" else "")
        labels = ", ".join(metric._labelnames)
        rows.append(f"| `{name}` | {metric._type} | {labels} | {metric._documentation} |")
    return "\n".join(rows) + "\n"


GENERATED: dict[str, Callable[[], str]] = {
    "lua-contracts": lua_contracts, "queue-settings": queue_settings,
    "worker-metrics": worker_metrics}


def on_config(config: Any) -> Any:
    copy_tree()
    return config


# Also when mkdocs loads this file, before any plugin's on_config: mkdocstrings' handler
# drops a search path that does not exist yet (a fresh clone has no build/).
copy_tree()


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    for name, make in GENERATED.items():
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    # mkdocs-click 0.9 prints click 8.2+'s "no default" sentinel as a default: blank it
    return html.replace("<td><code>Sentinel.UNSET</code></td>", "<td></td>")
