"""A lineage row (`node.core.lineages.LineageState`) and the table's choice (`LineageTable.serving`/`committed`) are
changed only by `node/core/lineages.py`: the rules that move a head, what is held, delivered, followed and served
live there, in methods named for the event (`version_applied`, `serve`, `commit`, ...), and every other
module calls them. This walker fails on any other product module that assigns one of those attributes."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from murmur.node.core.lineages import LineageState, LineageTable

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gossip", "sync", "training", "node", "simulations")
HOME = Path("node/core/lineages.py")
ROW = {f.name for f in dataclasses.fields(LineageState)}
TABLE = set(vars(LineageTable(4)))
# Objects of other classes that happen to have an attribute of the same name (what each is, in the comment).
OTHERS = {
    ("sync/staleness.py", "t.head"),  # the staleness guard's own track of a lineage
    ("node/core/roles.py", "act.supply"),  # a roles.Activation being built
    ("simulations/vworker.py", "n.held"),  # the simulated node's modelled worker state (vnode.VNode)
    ("node/worker/main.py", "self.inbox.sampler.own"),  # the worker's sampler's own lineage (training.sampler)
}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, ast.Tuple | ast.List) else [t]
        return out
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, target) of each assignment to a lineage row's or the lineage table's attribute on an object
    other than `self` (a class's own attribute of the same name is its own), and each such `setattr`."""
    found = []
    for node in ast.walk(tree):
        for t in _targets(node):
            if (
                isinstance(t, ast.Attribute)
                and t.attr in ROW | TABLE
                and not (isinstance(t.value, ast.Name) and t.value.id == "self")
            ):
                found.append((node.lineno, ast.unparse(t)))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in ROW | TABLE
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def violations() -> list[str]:
    bad = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT)
            if rel == HOME:
                continue
            for line, target in writes(ast.parse(f.read_text(), str(f))):
                if (rel.as_posix(), target) not in OTHERS:
                    bad.append(f"{rel}:{line}: assigns {target}")
    return bad


def test_only_node_lineages_changes_a_lineage_row() -> None:
    assert violations() == []


def test_the_walker_sees_each_kind_of_write() -> None:
    src = (
        "lin.head = 3\nself.table.serving = None\nlin.held, x = 1, 2\nlin.relation: str = 'x'\n"
        "lin.advances += []\nsetattr(lin, 'delivered', True)\nself.head = 1\nlin.other = 1\n"
    )
    assert [line for line, _ in writes(ast.parse(src))] == [1, 2, 3, 4, 5, 6]


def test_the_home_itself_writes_them() -> None:
    """The walker would see the writes that belong there (it is not blind to the rules it guards)."""
    assert writes(ast.parse((ROOT / HOME).read_text()))
