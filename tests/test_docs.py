"""The documentation site: it builds with --strict (no broken link, no missing page)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT


def test_site_builds_strict(tmp_path: Path) -> None:
    started = time.monotonic()
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
    # the CLI reference is generated from the click commands, the API from the docstrings
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--max-batch-tokens" in cli_page and "batchery queue config" in cli_page
    api_page = (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()
    assert "enqueue_many" in api_page
    assert time.monotonic() - started < 60, "the docs build should stay well under a minute"
