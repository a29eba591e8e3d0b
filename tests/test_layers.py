"""The packages import one way (docs/architecture.md, "Layers"): gossip/ at the bottom, then sync/ and
training/, then node/, then simulations/. Only node/'s CLI modules may reach simulations/, and only
inside a command's body, so that importing the node never imports the research tools. Inside node/, the
rooms import one way too. Every import of our packages names them under the `murmur` namespace, as they
are installed."""

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
# node/'s rooms, bottom first: a room imports only from the rooms before it (and from itself). "" is
# node/ itself: the formats and stores every room shares.
ROOMS = ["", "core", "worker", "ui", "shell", "cli"]


def _imports(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """(import node, dotted module) for every absolute import, `murmur.` taken off."""
    out: list[tuple[ast.AST, str]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(n, a.name) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            if n.module == "murmur":
                out += [(n, a.name) for a in n.names]
            else:
                out.append((n, n.module))
    return [(n, m.removeprefix("murmur.")) for n, m in out]


def _unprefixed(tree: ast.AST) -> list[int]:
    """Lines that import one of our packages by its bare folder name (a second copy of every module)."""
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            bad += [n.lineno for a in n.names if a.name.split(".")[0] in ALLOWED]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] in ALLOWED:
            bad.append(n.lineno)
    return bad


def _room(module: str) -> str:
    if module == "node.__main__":
        return "cli"  # `python -m murmur.node` runs the command line
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ROOMS else ""


def violations() -> list[str]:
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(f.read_text(), str(f))
            top_level = {id(n) for n in tree.body}
            here = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            for node, module in _imports(tree):
                top = module.split(".")[0]
                if top not in ALLOWED:
                    continue
                if top not in allowed:
                    lazy_cli = _room(here) == "cli" and top == "simulations"
                    if not (lazy_cli and id(node) not in top_level):
                        bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: {pkg}/ imports {top}/")
                elif pkg == "node" == top and ROOMS.index(_room(module)) > ROOMS.index(_room(here)):
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: node/{_room(here)} imports node/{_room(module)}")
    return bad


def test_imports_run_one_way() -> None:
    assert violations() == []


def test_every_import_of_ours_is_under_the_namespace() -> None:
    bad = [
        f"{f.relative_to(ROOT)}:{line}"
        for d in (*ALLOWED, "tests")
        for f in sorted((ROOT / d).rglob("*.py"))
        for line in _unprefixed(ast.parse(f.read_text(), str(f)))
    ]
    assert bad == []


def test_the_walker_sees_an_upward_import() -> None:
    tree = ast.parse(
        "import os\nfrom murmur.node.config import Config\ndef f():\n    from murmur.simulations import x\n"
        "from murmur import sync\n"
    )
    assert [m for _, m in _imports(tree)] == ["os", "node.config", "sync", "simulations"]
    assert _unprefixed(ast.parse("import os\nfrom node.config import Config\nimport sync.ids\n")) == [2, 3]


def test_the_walker_sees_a_room_importing_upward() -> None:
    assert _room("node.core.machine") == "core" and _room("node.config") == "" and _room("node.cli.app") == "cli"
    assert ROOMS.index(_room("node.shell.runtime")) > ROOMS.index(_room("node.core.machine"))


def test_benchmarks_live_under_simulations_bench_only() -> None:
    """A product package (or simulations/ outside bench/) holds no benchmark module: `murmur bench` reaches
    every benchmark in simulations/bench/."""
    stray = [
        str(f.relative_to(ROOT))
        for pkg in ALLOWED
        for f in sorted((ROOT / pkg).rglob("bench*.py"))
        if f.parent != ROOT / "simulations" / "bench"
    ]
    assert stray == []


def test_a_wheel_installs_only_the_murmur_namespace(tmp_path: Path) -> None:
    """What `pip install` puts in site-packages: `murmur/` (and its dist-info), never a generic `node`. Built
    from a copy of the files git tracks or would track, so that nothing a former build left in the checkout's
    `build/` is packaged, and the build writes nothing into the checkout."""
    import shutil
    import subprocess
    import sys
    import zipfile

    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout.split(b"\0")
    src = tmp_path / "src"
    for name in filter(None, (n.decode() for n in listed)):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"murmur"}
    for pkg in ALLOWED:
        assert f"murmur/{pkg}/__init__.py" in names
    assert "murmur/node/core/machine.py" in names and "murmur/training/tasksets/example.toml" in names
