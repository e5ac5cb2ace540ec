"""The code's shape, held by tests: one owner per rule, layers that import downward only,
short modules, no reaching into another module's private names.

Read from the source (ast), so a change that breaks a rule fails here with the place
to mend, not in review.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> the package it installs as (setup.cfg package_dir)
PACKAGES = {"batchery": "batchery", "batching": "batchery.batching", "producer": "batchery.producer",
            "workers": "batchery.workers", "gateway": "batchery.gateway",
            "dashboard": "batchery.dashboard"}
MAX_LINES = 400
# The layers, lowest first: a module imports from its own area or from a lower layer.
# base: errors, configuration, connections, tracing, listening; the Redis protocol; the two
# sides of the queue (producers, workers: neither imports the other); the HTTP servers
# (the gateway, the dashboard); the command line over all of them.
LAYER = {"base": 0, "batching": 1, "producer": 2, "workers": 2, "gateway": 3, "dashboard": 3,
         "cli": 4}
# `batchery` itself is the public API's facade (Client, AsyncClient, Result, errors), and
# batchery.keda renders autoscaling triggers from the key layout (batching).
FACADE, PLACED = {"batchery"}, {"batchery.keda": "batching"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def area(module: str) -> str:
    last = module.rsplit(".", 1)[-1]
    if last in ("cli", "cli_shared", "queue_cli", "__main__") or module in FACADE:
        return "cli"
    if module in PLACED:
        return PLACED[module]
    second = module.split(".")[1] if "." in module else ""
    return second if second in LAYER else "base"


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported from, names taken, line) of each batchery import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("batchery"):
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("batchery")]
    return found


def test_layers_import_downward_only() -> None:
    known = modules()
    wrong = []
    for module, path in known.items():
        for target, names, line in imports(path):
            # "from batchery.workers import metrics": the module metrics, not the package
            targets = [f"{target}.{n}" if f"{target}.{n}" in known else target for n in names] or [target]
            for imported in targets:
                mine, theirs = area(module), area(imported)
                if mine != theirs and LAYER[theirs] >= LAYER[mine]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {theirs} ({imported})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_module_takes_another_modules_private_names() -> None:
    known = modules()
    wrong = []
    for module, path in known.items():
        tree = ast.parse(path.read_text())
        imported_modules = set()
        for target, names, line in imports(path):
            wrong += [f"{path.relative_to(ROOT)}:{line}: {target}.{n}" for n in names
                      if n.startswith("_") and not n.startswith("__")]
            imported_modules |= {n for n in names if f"{target}.{n}" in known}
        for node in ast.walk(tree):  # metrics._something, where metrics is one of ours
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in imported_modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not wrong, "private names used outside their module:\n" + "\n".join(wrong)


def test_every_module_is_under_400_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in modules().values()
            if (n := len(p.read_text().splitlines())) >= MAX_LINES]
    assert not long, f"split these by role (at most {MAX_LINES - 1} lines):\n" + "\n".join(long)


def is_number(node: ast.expr) -> bool:
    """A number written as such, or as arithmetic on numbers (``7 * 86_400``, ``1 << 20``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return is_number(node.operand)
    return isinstance(node, ast.BinOp) and is_number(node.left) and is_number(node.right)


def test_each_numeric_default_has_one_owner_and_a_reason() -> None:
    """A module-level number (a limit, a period, a default) is defined in one module, with
    a comment on its line or just above saying why it is that number."""
    owners: dict[str, list[str]] = defaultdict(list)
    bare = []
    for path in modules().values():
        lines = path.read_text().splitlines()
        for node in ast.parse("\n".join(lines)).body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
            for target in targets:
                if not (isinstance(target, ast.Name) and target.id.isupper() and len(target.id) > 1):
                    continue
                if not is_number(node.value):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                owners[target.id].append(where)
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                if "#" not in lines[node.lineno - 1] and not above.startswith("#"):
                    bare.append(f"{where}: {target.id}")
    twice = {name: places for name, places in owners.items() if len(places) > 1}
    assert not twice, f"defined in more than one module: {twice}"
    assert not bare, "numbers with no reason given:\n" + "\n".join(bare)
