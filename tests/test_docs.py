"""The documentation: the site builds with --strict (no broken link, no missing page),
every shell and Python block of README.md and docs/**/*.md runs as shown, and every
`batchery ...` the prose names is a command and options batchery has.

A block is run unless a comment right before it says why not:
``<!-- not run in tests: needs Docker -->``. The blocks of one page run in order in one
bash session (a Python block as ``python -``), in a fresh directory, with
BATCHERY_REDIS_URL pointing at a private Redis database emptied before the page; a
command ending in ``&`` (a worker, the dashboard) runs in the background until the page
ends, and must still be running then. What a reader would type against their own machine is rewritten
to the test's: the Redis URLs ``redis://localhost:6379/0`` and ``redis://127.0.0.1:6379/0``,
the dashboard's port 8480, the gateway's 8000 and the metrics port 9100 become free ones.
A command that changed and a page that did not so fail here: an unknown option exits 2,
and ``set -e`` stops the page there.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import click
import pytest
import redis

from batchery.cli import cli
from tests.conftest import ROOT, RedisServer, free_port

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}
# Languages of blocks that are shown, not run: what they hold is not a command.
SHOWN = {"text", "json", "jsonl", "yaml", "toml", "mermaid", "promql", "lua", "ini"}
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                   re.M | re.S)
REASON = re.compile(r"<!--\s*not run in tests:\s*(?P<why>(?:(?!-->).)*?)\s*-->\s*\Z", re.S)
BACKGROUND = re.compile(r"(?<![&|])&\s*(#.*)?$")  # `cmd &` or `cmd &  # comment`, not `&&`
PAGE_TIMEOUT_S = 240


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    body: str
    reason: str | None  # why it is not run; None: it runs

    @property
    def where(self) -> str:
        shown = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{shown}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with the reason it is not run if one precedes it."""
    text = page.read_text()
    found, end = [], 0
    for match in FENCE.finditer(text):
        before = text[end:match.start()]
        reason = REASON.search(before)
        indent = len(match["indent"])
        body = "".join(line[indent:] for line in match["body"].splitlines(keepends=True))
        found.append(Block(page, text.count("\n", 0, match.start()) + 1,
                           match["lang"].strip().split(" ")[0], body,
                           reason["why"] if reason else None))
        end = match.end()
    return found


def runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in SHELL | PYTHON and b.reason is None]


def page_script(page_blocks: list[Block], substitutions: dict[str, str]) -> str:
    """One bash script running the blocks in order; background commands tracked."""
    lines = ["set -euo pipefail", "DOCS_BG=()",
             "trap '[ ${#DOCS_BG[@]} -eq 0 ] || "
             "{ kill \"${DOCS_BG[@]}\" 2>/dev/null; wait; }' EXIT"]
    for block in page_blocks:
        body = block.body
        for old, new in substitutions.items():
            body = body.replace(old, new)
        lines.append(f'echo "$(date +%T.%N | cut -c1-12) >>> {block.where}" >&2')
        if block.lang in PYTHON:
            lines += ["python - <<'DOCS_PYTHON_BLOCK'", body.rstrip("\n"), "DOCS_PYTHON_BLOCK"]
            continue
        for line in body.rstrip("\n").splitlines():
            lines.append(line)
            if BACKGROUND.search(line):
                lines.append("DOCS_BG+=($!)")
    lines += ['for pid in "${DOCS_BG[@]}"; do',
              '  kill -0 "$pid" 2>/dev/null ||',
              '    { echo "a background command ended early" >&2; exit 1; }',
              "done"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def docs_redis() -> Iterator[RedisServer]:
    server = RedisServer("--databases", str(DATABASES))
    yield server
    server.close()


def run_page(page_blocks: list[Block], redis_url: str,
             workdir: Path) -> subprocess.CompletedProcess:
    dashboard_port, metrics_port, gateway_port = free_port(), free_port(), free_port()
    substitutions = {"redis://localhost:6379/0": redis_url, "redis://127.0.0.1:6379/0": redis_url,
                     "127.0.0.1:8480": f"127.0.0.1:{dashboard_port}",
                     "127.0.0.1:8000": f"127.0.0.1:{gateway_port}",
                     "--metrics-port 9100": f"--metrics-port {metrics_port}",
                     "127.0.0.1:9100": f"127.0.0.1:{metrics_port}"}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BATCHERY_", "OTEL_")) and k != "REDIS_URL"}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               BATCHERY_REDIS_URL=redis_url, BATCHERY_HOME=str(workdir / ".home"),
               BATCHERY_DASHBOARD_PORT=str(dashboard_port), BATCHERY_PORT=str(gateway_port),
               # a worker times its model at start to choose its batch size: seconds that
               # say nothing about the page; a fixed size skips it
               BATCHERY_MAX_BATCH_SIZE="8",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", NO_MKDOCS_2_WARNING="1")
    script = page_script(page_blocks, substitutions)
    # its own process group: on a timeout the page's background commands go with it
    proc = subprocess.Popen(["bash", "-c", script], cwd=workdir, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=PAGE_TIMEOUT_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output, code = output + f"\n(the page ran past {PAGE_TIMEOUT_S} s)", 124
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the page left behind
    return subprocess.CompletedProcess(proc.args, code, output)


def test_site_builds_strict(tmp_path: Path) -> None:
    started = time.monotonic()
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stderr[-4000:]
    # the CLI reference is generated from the click commands, the API from the docstrings
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--max-batch-tokens" in cli_page and "batchery queue config" in cli_page
    api_page = (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()
    assert "enqueue_many" in api_page
    assert time.monotonic() - started < 60, "the docs build should stay well under a minute"


def test_every_block_is_run_or_says_why_not() -> None:
    unknown = [f"{b.where}: ```{b.lang or '(no language)'}" for page in PAGES
               for b in blocks(page) if b.lang not in SHELL | PYTHON | SHOWN]
    assert not unknown, ("every fenced block names its language (bash, python: run unless a "
                         "'<!-- not run in tests: WHY -->' comes right before it; or one that "
                         f"is only shown: {sorted(SHOWN)}):\n" + "\n".join(unknown))
    empty = [b.where for page in PAGES for b in blocks(page) if b.reason == ""]
    assert not empty, f"'not run in tests' without a reason: {empty}"
    assert sum(len(runnable(page)) for page in PAGES) >= 20, "the docs' examples are run"


EXAMPLE_PAGES = [p for p in PAGES if runnable(p)]
# Pages run two at a time (each in a Redis database of its own): most of a page's time is
# processes starting (torch, a model, a tokenizer), which overlap well.
PARALLEL_PAGES = 2
DATABASES = 64  # one per page that runs examples


@pytest.fixture(scope="module")
def page_runs(request: pytest.FixtureRequest, docs_redis: RedisServer,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Path, Future]]:
    """Every selected page's examples, started in order PARALLEL_PAGES at a time; each
    test waits for its own page (so each page's time counts against its own test)."""
    selected = {item.callspec.params["page"] for item in request.session.items
                if item.originalname == "test_page_examples_run"}
    pages = [p for p in EXAMPLE_PAGES if p in selected]
    assert len(pages) < DATABASES, f"one Redis database per page: {DATABASES} at most"

    def run(db: int, page: Path) -> subprocess.CompletedProcess:
        redis.Redis(port=docs_redis.port, db=db).flushdb()
        url = f"redis://127.0.0.1:{docs_redis.port}/{db}"
        return run_page(runnable(page), url, tmp_path_factory.mktemp("page"))

    pool = ThreadPoolExecutor(PARALLEL_PAGES)
    try:
        yield {page: pool.submit(run, db, page) for db, page in enumerate(pages)}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.timeout(PAGE_TIMEOUT_S + 60)
@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page: Path, page_runs: dict[Path, Future]) -> None:
    done = page_runs[page].result()
    assert done.returncode == 0, (f"an example of {page.relative_to(ROOT)} failed (exit "
                                  f"{done.returncode}); the last block started is the last "
                                  f"'>>>' line:\n{done.stdout[-6000:]}")


def test_readme_links_resolve() -> None:
    """mkdocs checks the links of docs/; the README's (into docs/) are checked here."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert len(targets) >= 20 and not missing, f"README.md links to missing files: {missing}"


def command_mentions(page: Path) -> Iterator[tuple[list[str], str]]:
    """`batchery ...` in the prose of a page (blocks are run instead), one argv for each
    alternative a span names (`batchery queue pause|resume QUEUE`)."""
    text = FENCE.sub("", page.read_text())
    for span in re.findall(r"`(batchery\s[^`]*)`", text.replace("\n", " ")):
        span = span.replace("\\|", "|")  # a | escaped in a table
        words = [w.strip("[]") for w in span.split()]
        if not re.fullmatch(r"[a-z][a-z-]*|-.*", words[1]):
            continue  # not a command: `batchery | 0, 1 executing` is rq info's output
        choices = [w.split("|") if not w.startswith("-") else [w] for w in words[:4]]
        for head in itertools.product(*choices):
            yield [*head, *words[4:]], span


def unknown_names(argv: list[str]) -> list[str]:
    """The commands and options of argv that `batchery` does not have."""
    command: click.Command = cli
    known = {"--help"}
    rest = argv[1:]
    while True:
        options = {o: p for p in command.params for o in (*p.opts, *p.secondary_opts)}
        known |= set(options)
        while isinstance(command, click.Group) and rest and rest[0] in options:
            takes_value = not getattr(options[rest[0]], "is_flag", False)
            rest = rest[1 + takes_value:]  # a group's option before its command
        if not isinstance(command, click.Group) or not rest or rest[0].startswith("-"):
            break
        sub = command.commands.get(rest[0])
        if sub is None:
            return [rest[0]]
        command, rest = sub, rest[1:]
    return [w.split("=")[0] for w in rest if re.fullmatch(r"--?[a-z][a-z-]*(=.*)?", w)
            and w.split("=")[0] not in known]


def test_commands_named_in_the_prose_exist() -> None:
    wrong = [f"{page.relative_to(ROOT)}: `{span}`: no {', '.join(unknown)}"
             for page in PAGES for argv, span in command_mentions(page)
             if (unknown := unknown_names(argv))]
    assert not wrong, "commands or options the pages name that batchery lacks:\n" + \
        "\n".join(wrong)


# -- the runner itself --------------------------------------------------------------------
def test_runner_fails_a_page_whose_command_changed(docs_redis: RedisServer, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Set it:\n\n```bash\nbatchery queue config q --max-pending 5\n"
                    "batchery queue config q --max-pendin 5\n```\n")
    done = run_page(runnable(page), docs_redis.url, tmp_path)
    assert done.returncode == 2 and "No such option" in done.stdout, done.stdout


def test_runner_reads_reasons_and_background_commands(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- not run in tests: needs Kubernetes -->\n```bash\nkubectl apply\n```\n\n"
                    "```bash\nsleep 30 &   # in the background\ntrue && echo ok\n```\n\n"
                    "```text\nshown\n```\n"
                    "<!-- not run in tests: far away --> prose <!-- other -->\n```bash\ntrue\n```\n")
    found = blocks(page)
    assert [b.reason for b in found] == ["needs Kubernetes", None, None, None]
    assert runnable(page) == [found[1], found[3]]
    script = page_script(runnable(page), {})
    assert script.count("DOCS_BG+=($!)") == 1


def test_a_renamed_command_or_option_in_the_prose_is_found() -> None:
    assert unknown_names(["batchery", "queue", "config", "Q", "--max-pendin", "5"]) == \
        ["--max-pendin"]
    assert unknown_names(["batchery", "queue", "stat"]) == ["stat"]
    assert unknown_names(["batchery", "--log-level", "DEBUG", "worker", "-q", "x",
                          "--max-batch-size=8"]) == []
