"""The packages import one way (docs/architecture.md, "Layers"): gossip/ at the bottom, then sync/ and
training/, then node/, then simulations/. Only node/'s CLI modules may reach simulations/, and only
inside a command's body, so that importing the node never imports the research tools."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "gossip": {"gossip"},
    "sync": {"gossip", "sync"},
    "training": {"gossip", "training"},
    "node": {"gossip", "sync", "training", "node"},
    "simulations": {"gossip", "sync", "training", "node", "simulations"},
}


def _imports(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    out: list[tuple[ast.AST, str]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(n, a.name.split(".")[0]) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            out.append((n, n.module.split(".")[0]))
    return out


def violations() -> list[str]:
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(f.read_text(), str(f))
            top_level = {id(n) for n in tree.body}
            for node, top in _imports(tree):
                if top not in ALLOWED or top in allowed:
                    continue
                lazy_cli = pkg == "node" and f.name.startswith("cli") and top == "simulations"
                if lazy_cli and id(node) not in top_level:
                    continue
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: {pkg}/ imports {top}/")
    return bad


def test_imports_run_one_way() -> None:
    assert violations() == []


def test_the_walker_sees_an_upward_import() -> None:
    tree = ast.parse("import os\nfrom node.config import Config\ndef f():\n    from simulations import x\n")
    assert [top for _, top in _imports(tree)] == ["os", "node", "simulations"]


def test_benchmarks_live_under_simulations_bench_only() -> None:
    """A product package (or simulations/ outside bench/) holds no benchmark module: `murmur bench` reaches
    every benchmark in simulations/bench/."""
    stray = [str(f.relative_to(ROOT)) for pkg in ALLOWED for f in sorted((ROOT / pkg).rglob("bench*.py"))
             if f.parent != ROOT / "simulations" / "bench"]
    assert stray == []
