"""docs/gateway.md stays true to the code: its batchery command lines parse with
batchery's own click commands, its Python examples compile, its key lines load."""

from __future__ import annotations

import re
import shlex

from batchery.gateway.auth import Keys
from tests.conftest import ROOT
from tests.test_deploy import check  # noqa: F401  (the fixture)

DOC = (ROOT / "docs" / "gateway.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC, re.S)


def test_command_lines_parse(check) -> None:  # noqa: F811
    found = 0
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            m = re.search(r"(?:^|\s)(batchery\s[^&#]*)", line)
            if m:
                check(shlex.split(m.group(1)), f"docs/gateway.md: {line}")
                found += 1
    assert found >= 6


def test_python_examples_compile_and_key_lines_load(tmp_path) -> None:
    for n, block in enumerate(blocks("python")):
        compile(block, f"docs/gateway.md python block {n}", "exec")
    [keys] = blocks("text")
    (tmp_path / "keys").write_text(keys)
    assert len(Keys.load(str(tmp_path / "keys"), None)) == 2
