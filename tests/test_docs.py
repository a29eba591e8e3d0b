"""The guides run as written: their TOML loads with the node's own loaders, their `murmur ...` lines name commands
and flags that exist, the paths they name exist, and every config key is documented with its real default.

A TOML block that is deliberately partial says so in its info string: ```` ```toml fragment ````.
Failure messages name the doc, its line and what is wrong, so a renamed key or flag points at the text to fix.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import typer.main
from typer.testing import CliRunner

from murmur.gossip.errors import MurmurError
from murmur.node.cli.app import app
from murmur.node.config import SECTIONS, Config, env_overrides, load_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
CODE_DIRS = ("node", "gossip", "sync", "training", "simulations", "tests", "docs")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def fenced_blocks(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line of the opening fence, info string, body) for each fenced block."""
    text = path.read_text()
    for m in FENCE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2)


def code_spans(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each inline code span outside fenced blocks."""
    text = path.read_text()
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in re.finditer(r"(`+)(.+?)\1", prose):
        yield prose.count("\n", 0, m.start()) + 1, m.group(2).strip()


# ------------------------------------------------------------------ TOML blocks


def toml_blocks() -> list[Any]:
    out = []
    for doc in DOCS:
        for line, info, body in fenced_blocks(doc):
            words = info.split()
            if words and words[0] == "toml":
                out.append(pytest.param(doc, line, body, "fragment" in words[1:], id=f"{doc.name}:{line}"))
    return out


@pytest.mark.parametrize("doc,line,body,fragment", toml_blocks())
def test_toml_block_loads_with_the_nodes_loader(
    doc: Path, line: int, body: str, fragment: bool, tmp_path: Path
) -> None:
    where = f"{_rel(doc)}:{line}"
    raw = tomllib.loads(body)  # even a fragment is TOML
    if fragment:
        return
    f = tmp_path / "block.toml"
    f.write_text(body)
    try:
        if "generators" in raw:
            from murmur.training.tasksets import load_task_set_toml

            load_task_set_toml(f)
        elif "group" in raw:
            from murmur.simulations.scenario import load

            load(f)
        else:
            load_config(f, environ={})
    except MurmurError as e:
        pytest.fail(
            f"{where}: this TOML block is refused by the node's loader: {e}\n"
            "(fix the block, or mark a deliberately partial one ```toml fragment)",
            pytrace=False,
        )


# ------------------------------------------------------------------ murmur command lines


def command_lines() -> list[tuple[str, str]]:
    """(where, command line) for every `murmur ...` line in fenced blocks and inline code."""
    out = []
    for doc in DOCS:
        for line, _, body in fenced_blocks(doc):
            for i, text in enumerate(body.splitlines()):
                m = re.match(r"^\s*(?:\$\s+)?(murmur\s.*)$", text)
                if m:
                    out.append((f"{_rel(doc)}:{line + 1 + i}", m.group(1)))
        for line, span in code_spans(doc):
            if span.startswith("murmur "):
                out.append((f"{_rel(doc)}:{line}", span))
    return out


def _tokens(text: str) -> list[str]:
    text = re.sub(r"\s#.*$", "", text)  # a shell comment
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def _option_names(cmd: Any) -> set[str]:
    names = {"--help"}
    for p in cmd.params:
        if p.param_type_name == "option":
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def resolve_command(line: str) -> tuple[list[str], list[str]]:
    """(command path, problems) for one `murmur ...` line."""
    root = typer.main.get_command(app)
    cmd: Any = root  # typer's own click: groups have `commands`
    path: list[str] = []
    problems: list[str] = []
    tokens = [t.strip("[]") for t in _tokens(line)[1:]]  # `[--seed S]`: an optional flag
    i = 0
    while hasattr(cmd, "commands") and i < len(tokens) and not tokens[i].startswith(("-", "<")):  # <command>
        if "|" in tokens[i]:  # `bench codec|gossip --json`: each alternative
            for alt in tokens[i].split("|"):
                problems += resolve_command(" ".join(["murmur", *path, alt, *tokens[i + 1 :]]))[1]
            return path, problems
        sub = cmd.commands.get(tokens[i])
        if sub is None:
            problems.append(
                f"`murmur {' '.join(path)}` has no command {tokens[i]!r} (commands: {', '.join(sorted(cmd.commands))})"
            )
            return path, problems
        path.append(tokens[i])
        cmd = sub
        i += 1
    known = _option_names(cmd)
    for tok in tokens[i:]:
        if tok == "--":
            break
        if re.match(r"^--?[A-Za-z]", tok):
            name = tok.split("=", 1)[0]
            if name not in known:
                problems.append(f"`murmur {' '.join(path)}` has no option {name} (options: {', '.join(sorted(known))})")
    return path, problems


def test_every_murmur_command_line_names_commands_and_flags_that_exist() -> None:
    lines = command_lines()
    assert len(lines) > 30, "the command-line scan found almost nothing: is the doc format still fenced/inline?"
    problems = []
    paths = set()
    for where, line in lines:
        path, why = resolve_command(line)
        problems += [f"{where}: {line!r}: {w}" for w in why]
        if not why:
            paths.add(tuple(path))
    runner = CliRunner()
    for path in sorted(paths):
        r = runner.invoke(app, [*path, "--help"])
        if r.exit_code != 0:
            problems.append(f"`murmur {' '.join(path)} --help` exits {r.exit_code}: {r.output[-300:]}")
    assert not problems, "\n".join(problems)


def _leaf_commands(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _leaf_commands(sub, [*path, name])
    else:
        yield path, cmd


def test_every_command_and_option_is_documented() -> None:
    """Each command is named in a guide (`murmur <command>`) and each of its options appears in a guide naming it
    (docs/commands.md lists them all)."""
    texts = {doc: doc.read_text() for doc in DOCS}
    problems = []
    for path, cmd in _leaf_commands(typer.main.get_command(app), []):
        name = "murmur " + " ".join(path)
        naming = [t for t in texts.values() if re.search(re.escape(name) + r"(?![\w-])", t)]
        if not naming:
            problems.append(f"`{name}` is named in no doc (add it to docs/commands.md)")
            continue
        for p in cmd.params:
            if p.param_type_name != "option" or "--help" in p.opts:
                continue
            if not any(re.search(re.escape(o) + r"(?![\w-])", t) for o in p.opts for t in naming):
                problems.append(f"`{name} {p.opts[0]}` is in no doc that names `{name}` (add it to docs/commands.md)")
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_a_removed_flag_and_command() -> None:
    assert resolve_command("murmur node start --home /tmp/h --bootstrap /ip4/1.2.3.4/tcp/1/p2p/x")[1] == []
    assert resolve_command("murmur simulate -s wan --virtual --out /tmp/wan --json")[1] == []
    assert "no option --download" in resolve_command("murmur node start --download 5")[1][0]
    assert "no command 'launch'" in resolve_command("murmur node launch")[1][0]


# ------------------------------------------------------------------ paths


PATH_SPAN = re.compile(r"^(?:(?:" + "|".join(CODE_DIRS) + r")/[\w./-]*|test_\w+\.py)?(?:::\w+(?:\[[^\]]*\])?)?$")


def _path_problem(span: str) -> str | None:
    name, _, func = span.partition("::")
    func = func.split("[")[0]  # `test_x[param]`: the test function
    if not name:  # `::test_x` after a file named earlier in the same sentence: some test file defines it
        defined = any(
            re.search(rf"^\s*(?:async )?def {re.escape(func)}\(", f.read_text(), re.M)
            for f in (ROOT / "tests").glob("*.py")
        )
        return None if defined else f"no test file defines {func}"
    if name.startswith("test_"):
        name = f"tests/{name}"
    p = ROOT / name
    if not p.exists():
        # `sync/items.wanted`: a module and a name in it
        module, _, attr = name.rpartition(".")
        mod = ROOT / f"{module}.py"
        if attr and mod.is_file() and re.search(rf"\b{re.escape(attr)}\b", mod.read_text()):
            return None
        return f"{name} does not exist"
    if func and not re.search(rf"^\s*(?:async )?def {re.escape(func)}\(", p.read_text(), re.M):
        return f"{name} has no test {func}"
    return None


def test_every_path_a_doc_names_exists() -> None:
    problems, seen = [], 0
    for doc in DOCS:
        for line, span in code_spans(doc):
            if span and PATH_SPAN.match(span):
                seen += 1
                why = _path_problem(span)
                if why:
                    problems.append(f"{_rel(doc)}:{line}: `{span}`: {why}")
        text = doc.read_text()
        for m in re.finditer(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):
            if not (doc.parent / m.group(1)).exists():
                problems.append(
                    f"{_rel(doc)}:{text.count(chr(10), 0, m.start()) + 1}: link {m.group(1)} does not exist"
                )
    assert seen > 50, "the path scan found almost nothing"
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ config keys


KEY_SPAN = re.compile(r"^(" + "|".join(SECTIONS) + r")\.([a-z_0-9]+)$")
FILE_SUFFIXES = {"py", "log", "jsonl", "json", "toml", "db", "sock", "md", "csv", "html", "bin", "env"}


def _scenario_keys(section: str) -> tuple[str, ...]:
    """Fields of a scenario file's section of that name (docs/scenarios.md): `training.step_s` is one."""
    import typing

    from murmur.simulations.scenario import Scenario

    typ = typing.get_type_hints(Scenario).get(section)
    return getattr(typ, "__struct_fields__", ())


ENV_SPAN = re.compile(r"^MURMUR_[A-Z0-9_]+")


def test_docs_name_only_config_keys_that_exist() -> None:
    """`section.key` in a doc is a config key (or a module of that package); MURMUR_<SECTION>_<KEY> names a key."""
    problems = []
    for doc in DOCS:
        for line, span in code_spans(doc):
            m = KEY_SPAN.match(span.split(" ")[0].split("=")[0])  # `sync.follow = [...]`: the key
            if m:
                section, key = m.groups()
                elsewhere = (
                    (ROOT / section / f"{key}.py").exists()
                    or (ROOT / section / key).is_dir()
                    or key in FILE_SUFFIXES
                    or key in _scenario_keys(section)
                )
                if key not in SECTIONS[section].__struct_fields__ and not elsewhere:
                    problems.append(
                        f"{_rel(doc)}:{line}: `{span}` names no config key (section [{section}] has: "
                        f"{', '.join(SECTIONS[section].__struct_fields__)})"
                    )
            e = ENV_SPAN.match(span)
            if e:
                try:
                    env_overrides({e.group(0): "0"})
                except MurmurError as err:
                    problems.append(f"{_rel(doc)}:{line}: `{span}`: {err}")
    assert not problems, "\n".join(problems)


def _linked_guides(doc: Path) -> list[Path]:
    text = doc.read_text()
    names = set(re.findall(r"\]\(([\w-]+\.md)", text)) | set(re.findall(r"`docs/([\w-]+\.md)`", text))
    return [doc] + [doc.parent / n for n in sorted(names) if (doc.parent / n).exists() and n != doc.name]


def _literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def documented_defaults(docs: list[Path]) -> dict[str, list[tuple[str, Any]]]:
    """key -> [(where, default)] from table rows `| `section.key` | default | ...`; the default is the cell's
    first code span (or first word), read as a TOML literal."""
    out: dict[str, list[tuple[str, Any]]] = {}
    for doc in docs:
        for i, row in enumerate(doc.read_text().splitlines()):
            cells = [c.strip() for c in row.strip().strip("|").split("|")] if row.lstrip().startswith("|") else []
            if len(cells) < 2:
                continue
            m = re.fullmatch(r"`((?:" + "|".join(SECTIONS) + r")\.[a-z_0-9]+)`", cells[0])
            if not m:
                continue
            span = re.match(r"`([^`]*)`", cells[1])
            text = span.group(1) if span else (cells[1].split() or [""])[0]
            out.setdefault(m.group(1), []).append((f"{_rel(doc)}:{i + 1}", _literal(text)))
    return out


def test_every_config_key_is_documented_for_volunteers_with_its_real_default() -> None:
    docs = _linked_guides(ROOT / "docs" / "volunteer.md")
    found = documented_defaults(docs)
    defaults = msgspec.to_builtins(Config())
    problems = []
    for section, typ in SECTIONS.items():
        for key in typ.__struct_fields__:
            name, real = f"{section}.{key}", defaults[section][key]
            if name not in found:
                problems.append(
                    f"{name} (default {real!r}) is in no table row `| `{name}` | default | ... |` of "
                    f"docs/volunteer.md or a guide it links ({', '.join(d.name for d in docs)})"
                )
            for where, doc_default in found.get(name, []):
                if doc_default != real:
                    problems.append(
                        f"{where}: {name} is documented with default {doc_default!r}; the code's default is {real!r}"
                    )
    assert not problems, "\n".join(problems)


def test_the_defaults_check_catches_a_wrong_default(tmp_path: Path) -> None:
    doc = tmp_path / "guide.md"
    doc.write_text(
        "| key | default |\n|---|---|\n| `sync.max_staleness` | `5` | versions |\n"
        '| `node.swarm` | `"murmur-default"` | name |\n'
    )
    found = documented_defaults([doc])
    assert found["sync.max_staleness"][0][1] == 5 != Config().sync.max_staleness
    assert found["node.swarm"][0][1] == Config().node.swarm


def test_the_path_check_catches_a_removed_file_and_test() -> None:
    assert _path_problem("tests/test_docs.py::test_every_path_a_doc_names_exists") is None
    assert _path_problem("test_docs.py::test_every_path_a_doc_names_exists[x]") is None
    assert "does not exist" in (_path_problem("node/no_such_module.py") or "")
    assert "has no test" in (_path_problem("tests/test_docs.py::test_no_such_test") or "")
    assert "no test file defines" in (_path_problem("::test_no_such_test") or "")
