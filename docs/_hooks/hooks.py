"""mkdocs hooks: the source tree as it installs, for the API reference; the CLI tables.

batchery's subpackages live in folders named otherwise (setup.cfg's package_dir:
batchery.producer is producer/, batchery.batching is batching/, ...), which a reader of
source files (mkdocstrings' griffe) cannot follow. This copies them into build/api-src/
the way pip installs them, before any page is read.
"""

from __future__ import annotations

import configparser
import shutil
from pathlib import Path
from typing import Any

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


def on_config(config: Any) -> Any:
    copy_tree()
    return config


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    # mkdocs-click 0.9 prints click 8.2+'s "no default" sentinel as a default: blank it
    return html.replace("<td><code>Sentinel.UNSET</code></td>", "<td></td>")
