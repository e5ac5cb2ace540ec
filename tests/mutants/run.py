"""``make mutants``: plant each fault of ``faults.py`` in a copy of the tree and run the
tests named to catch it.

Each fault gets a fresh copy of the project (tracked and untracked files, not the ignored
ones) in a temporary directory, laid out as the package installs (``batchery.batching`` is
``batching/``, ...), so the working tree is never touched. The copy runs first on the
import path of the tests and of every process they start. The tests run with ``-x``; the
first failure names the test that caught the fault. A fault whose tests all pass
SURVIVED, and the run exits 1.

    python -m tests.mutants.run                 # every fault, after a clean baseline run
    python -m tests.mutants.run --only reaper   # faults whose name contains "reaper"
    python -m tests.mutants.run --list          # the faults and their tests, no run
"""

from __future__ import annotations

import argparse
import configparser
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from tests.mutants.faults import FAULTS, Fault

ROOT = Path(__file__).resolve().parents[2]


def top_level_subpackages() -> list[str]:
    """The subpackages installed from top-level folders: setup.cfg's package_dir entries
    ``batchery.X = X`` (a fault planted in a folder missing here would not be imported)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    entries = (line.split("=") for line in config["options"]["package_dir"].splitlines()
               if "=" in line)
    return [folder.strip() for name, folder in entries
            if name.strip() == f"batchery.{folder.strip()}"]


SUBPACKAGES = top_level_subpackages()  # producer, workers, batching, dashboard, gateway
PER_FAULT_TIMEOUT_S = 900


@dataclass
class Outcome:
    fault: str
    caught_by: str      # the first failing test, or "SURVIVED" / "ERROR: ..."
    seconds: float

    @property
    def survived(self) -> bool:
        return not self.caught_by.startswith("tests/")  # an ERROR is no catch either


def project_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode()
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def copy_tree(into: Path) -> Path:
    """A copy of the project under ``into``, importable as the installed package."""
    tree = into / "tree"
    for name in project_files():
        target = tree / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    for package in SUBPACKAGES:
        (tree / "batchery" / package).symlink_to(Path("..") / package)
    return tree


def plant(tree: Path, fault: Fault) -> None:
    path = tree / fault.file
    text = path.read_text()
    found = text.count(fault.original)
    if found != 1:
        raise ValueError(f"{fault.name}: the original text occurs {found} times in {fault.file}, "
                         "not once: make it exact")
    path.write_text(text.replace(fault.original, fault.replacement))


def environment(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_the_copy(tree: Path) -> None:
    """Every subpackage imports from the copy (an editable install maps them elsewhere)."""
    code = "import importlib\n" + "".join(
        f"print(importlib.import_module('batchery.{package}').__file__)\n"
        for package in SUBPACKAGES)
    probe = subprocess.run([sys.executable, "-c", code], cwd=tree, env=environment(tree),
                           capture_output=True, text=True, timeout=120)
    paths = probe.stdout.split()
    if probe.returncode or len(paths) != len(SUBPACKAGES) or not all(
            Path(p).resolve().is_relative_to(tree.resolve()) for p in paths):
        raise RuntimeError(f"the copy in {tree} is not what Python imports: {probe.stdout}"
                           f"{probe.stderr}")


def first_failure(report: Path) -> str | None:
    if not report.exists():
        return None
    for case in ElementTree.parse(report).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            return f"{path}::{case.get('name')}"
    return None


def run_tests(tree: Path, tests: tuple[str, ...], report: Path) -> tuple[int, str]:
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", *tests]
    try:
        done = subprocess.run(command, cwd=tree, env=environment(tree), capture_output=True,
                              text=True, timeout=PER_FAULT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {PER_FAULT_TIMEOUT_S}s"
    return done.returncode, done.stdout[-3000:] + done.stderr[-2000:]


def try_fault(fault: Fault | None, tests: tuple[str, ...], verbose: bool) -> Outcome:
    started = time.monotonic()
    name = fault.name if fault else "baseline (no fault)"
    with tempfile.TemporaryDirectory(prefix="batchery-mutant-") as scratch:
        tree = copy_tree(Path(scratch))
        check_imports_the_copy(tree)
        if fault:
            plant(tree, fault)
        code, output = run_tests(tree, tests, Path(scratch) / "report.xml")
        failed = first_failure(Path(scratch) / "report.xml")
    if verbose or (fault is None and code != 0):
        print(output, file=sys.stderr)
    if code == 0:
        caught = "SURVIVED" if fault else "passed"
    elif failed:
        caught = failed
    else:
        caught = f"ERROR: pytest exit {code}"
        print(output, file=sys.stderr)
    return Outcome(name, caught, time.monotonic() - started)


def print_table(outcomes: list[Outcome]) -> None:
    width = max(len(o.fault) for o in outcomes)
    print(f"\n{'fault'.ljust(width)}  {'seconds':>7}  caught by")
    for o in outcomes:
        print(f"{o.fault.ljust(width)}  {o.seconds:7.0f}  {o.caught_by}")
    survived = [o.fault for o in outcomes if o.survived]
    print(f"\n{len(outcomes) - len(survived)} of {len(outcomes)} faults caught"
          + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[],
                        help="run only faults whose name contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the faults, run nothing")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run of every named test on the unchanged copy")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    args = parser.parse_args(argv)
    chosen = [f for f in FAULTS if not args.only or any(o in f.name for o in args.only)]
    if not chosen:
        parser.error(f"no fault matches {args.only}; --list shows them")
    if args.list:
        for fault in chosen:
            print(f"{fault.name}: {fault.file}\n    " + "\n    ".join(fault.tests))
        return 0
    if not args.no_baseline:
        every = tuple(dict.fromkeys(t for f in chosen for t in f.tests))
        baseline = try_fault(None, every, args.verbose)
        print(f"baseline, {len(every)} tests unchanged: {baseline.caught_by} "
              f"({baseline.seconds:.0f} s)", flush=True)
        if baseline.caught_by != "passed":
            print("the named tests fail without any fault: fix them first", file=sys.stderr)
            return 2
    outcomes = []
    for fault in chosen:
        outcome = try_fault(fault, fault.tests, args.verbose)
        print(f"{outcome.fault}: {outcome.caught_by} ({outcome.seconds:.0f} s)", flush=True)
        outcomes.append(outcome)
    print_table(outcomes)
    return 1 if any(o.survived for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
