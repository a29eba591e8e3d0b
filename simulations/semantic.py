"""Semantic mutants: the plausible one-line bugs that operator mutants (cosmic-ray's) do not write.

    python -m murmur.simulations.mutation gossip/limits.py --semantic [--operators window_sign given_back] [--json]

cosmic-ray swaps one operator or number for another; the bugs that slip past a suite of defence tests
are of another kind (issue 43). Each operator here writes one family of them, one mutant per site:

- `window_edge`: the wrong end of a window or bound: `<` for `<=`, `>` for `>=` and back, on one
  ordering comparison.
- `window_sign`: a window measured the wrong way: `now - w` for `now + w` (and back), where an operand
  names a time (`now`, `*_s`, `window`, `deadline`, `ttl`, `until`, `since`, `last`, `age`); `min` for
  `max` (a cap turned into a floor) on a two-argument call.
- `given_back`: a count or reservation not given back: a `-=` statement removed, or a statement that
  releases (`release`, `discard`, `close_stream`, `free`, `remove`, `pop`, `clear`, `del`) removed; not
  inside a `while` loop (that loop drains until the statement's effect, so removing it only hangs).
- `wrong_field`: a check on the wrong field: in a comparison, an attribute replaced by another
  attribute of the same class with the same declared type, the one declared next before it and the one
  next after (class annotations, annotated `self.x` assignments, and `self.x = param` of an annotated
  parameter or a literal, in the module and the repository modules it imports from).
- `nan_through`: a comparison that lets NaN through: `not a <= b` written `a > b`; a range check
  `lo <= x <= hi` (or `x >= lo and x <= hi`, or numpy's `(x >= lo) & (x <= hi)`) written as "not
  outside" (`not (x < lo or x > hi)`, `~((x < lo) | (x > hi))`); `math.isfinite(x)` removed (`True`)
  or narrowed to `not isinf(x)` / `not isnan(x)` (numpy and torch: `~isinf(x)` / `~isnan(x)`);
  the NaN self-test made blind (`x == x` as `True`, `x != x` as `False`).

A mutant is a source span replaced by new text, so its diff is one small hunk; equivalent ones are
listed in `simulations.mutation.EQUIVALENT` by the line their diff adds, as cosmic-ray's are.
"""

from __future__ import annotations

import ast
import difflib
import os
import random
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OPERATORS = ("window_edge", "window_sign", "given_back", "wrong_field", "nan_through")

_FLIP: dict[type, type] = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_COMPLEMENT: dict[type, type] = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.GtE: ast.Lt}
_ORDER = tuple(_FLIP)
_TIME = re.compile(
    r"(^|_)(now|t|t0|window|deadline|ttl|until|since|last|age|expiry|updated|started)($|_)|_s$|_at$", re.IGNORECASE
)
_GIVE_BACK = {"release", "discard", "close_stream", "free", "remove", "pop", "clear"}


@dataclass(frozen=True)
class Mutant:
    operator: str
    line: int  # 1-based, where the replaced span starts
    start: tuple[int, int]  # (line, byte column) of the span, as ast gives them
    end: tuple[int, int]
    replacement: str

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        (l0, c0), (l1, c1) = self.start, self.end
        head = lines[l0 - 1].encode()[:c0].decode()
        tail = lines[l1 - 1].encode()[c1:].decode()
        return "".join(lines[: l0 - 1]) + head + self.replacement + tail + "".join(lines[l1:])

    def diff(self, source: str, name: str) -> str:
        return "".join(
            difflib.unified_diff(
                source.splitlines(keepends=True),
                self.apply(source).splitlines(keepends=True),
                f"a/{name}",
                f"b/{name}",
                n=0,
            )
        )


def _span(node: ast.AST) -> tuple[tuple[int, int], tuple[int, int]]:
    line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
    return (line, col), (getattr(node, "end_lineno", None) or line, getattr(node, "end_col_offset", None) or 0)


def _names(node: ast.AST) -> Iterator[str]:
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr


def _timeish(node: ast.AST) -> bool:
    return any(_TIME.search(x) for x in _names(node))


def _paren(node: ast.AST) -> str:
    return f"({ast.unparse(node)})"


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}


def _ordering(node: ast.AST) -> bool:
    return isinstance(node, ast.Compare) and all(isinstance(op, _ORDER) for op in node.ops)


def _complement(c: ast.Compare, numpy: bool) -> ast.expr:
    """The comparison that is true exactly where `c` is false, except on NaN (where both are false)."""
    parts: list[ast.expr] = []
    left = c.left
    for op, right in zip(c.ops, c.comparators):
        parts.append(ast.Compare(left, [_COMPLEMENT[type(op)]()], [right]))
        left = right
    if len(parts) == 1:
        return parts[0]
    if numpy:
        out = parts[0]
        for p in parts[1:]:
            out = ast.BinOp(out, ast.BitOr(), p)
        return out
    return ast.BoolOp(ast.Or(), parts)


# ------------------------------------------------------------ the fields of each class, with their types


def _annotation_types(tree: ast.Module) -> dict[str, dict[str, str]]:
    """class -> field -> declared type (its annotation's text), from class bodies and `__init__`-style
    assignments to `self` in their methods."""
    out: dict[str, dict[str, str]] = {}
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        fields = out.setdefault(cls.name, {})
        for st in cls.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                fields[st.target.id] = ast.unparse(st.annotation)
        for fn in [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            params = {a.arg: ast.unparse(a.annotation) for a in [*fn.args.args, *fn.args.kwonlyargs] if a.annotation}
            for walked in ast.walk(fn):
                if isinstance(walked, ast.AnnAssign) and _self_attr(walked.target):
                    fields.setdefault(walked.target.attr, ast.unparse(walked.annotation))  # type: ignore[union-attr]  # _self_attr proved an Attribute
                elif isinstance(walked, ast.Assign):
                    for target in walked.targets:
                        pairs = (
                            zip(target.elts, walked.value.elts)
                            if isinstance(target, ast.Tuple) and isinstance(walked.value, ast.Tuple)
                            else [(target, walked.value)]
                        )
                        for t, v in pairs:
                            typ = _type_of(v, params)
                            if _self_attr(t) and typ:
                                fields.setdefault(t.attr, typ)  # type: ignore[attr-defined]  # _self_attr proved an Attribute
    return out


def _self_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _type_of(v: ast.AST, params: dict[str, str]) -> str:
    if isinstance(v, ast.Name):
        return params.get(v.id, "")
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("float", "int", "str", "bool"):
        return v.func.id
    if isinstance(v, ast.Constant) and not isinstance(v.value, (type(None), bool)):
        return type(v.value).__name__
    if isinstance(v, ast.UnaryOp):
        return _type_of(v.operand, params)
    if isinstance(v, ast.Attribute) and ast.unparse(v) in ("math.inf", "math.nan"):
        return "float"
    return ""


def _repo_imports(tree: ast.Module, root: Path) -> list[Path]:
    out = []
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            p = root / (n.module.replace(".", "/") + ".py")
            if p.is_file():
                out.append(p)
    return out


def field_types(source: str, root: Path | None = None) -> dict[str, dict[str, str]]:
    tree = ast.parse(source)
    out = _annotation_types(tree)
    for p in _repo_imports(tree, root) if root is not None else []:
        for cls, fields in _annotation_types(ast.parse(p.read_text())).items():
            out.setdefault(cls, fields)
    return out


# ------------------------------------------------------------ the operators


def mutants(source: str, root: Path | None = None, operators: tuple[str, ...] = OPERATORS) -> list[Mutant]:
    """Every semantic mutant of `source` (a module's text), in source order; `root`: where the repository
    modules it imports from live (for `wrong_field`'s declared types)."""
    tree = ast.parse(source)
    parents = _parents(tree)
    types = field_types(source, root) if "wrong_field" in operators else {}
    out: list[Mutant] = []

    def add(op: str, node: ast.AST, text: str) -> None:
        if op in operators:
            (s, e) = _span(node)
            out.append(Mutant(op, s[0], s, e, text))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], _ORDER):
            flipped = ast.Compare(node.left, [_FLIP[type(node.ops[0])]()], node.comparators)
            add("window_edge", node, ast.unparse(flipped))
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, (ast.Add, ast.Sub))
            and (_timeish(node.left) or _timeish(node.right))
        ):
            other = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
            add("window_sign", node, _paren(ast.BinOp(node.left, other, node.right)))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("min", "max")
            and len(node.args) == 2
            and not node.keywords
        ):
            swapped = "max" if node.func.id == "min" else "min"
            add("window_sign", node, ast.unparse(ast.Call(ast.Name(swapped), node.args, [])))
        if isinstance(node, ast.stmt) and _gives_back(node) and not _in_while(node, parents):
            add("given_back", node, "pass")
        if isinstance(node, ast.Compare):
            cls = _enclosing_class(node, parents)
            for attr in [n for n in ast.walk(node) if isinstance(n, ast.Attribute)]:
                # `self.x`: a field of the class the method is in; another base: of any class declaring x
                own = _self_attr(attr) and cls in types
                for field in _same_typed(attr.attr, {cls: types[cls]} if own else types):
                    add("wrong_field", attr, ast.unparse(ast.Attribute(attr.value, field, ast.Load())))
        _nan(node, parents, add)
    out.sort(key=lambda m: (m.start, m.end, m.operator, m.replacement))
    return list(dict.fromkeys(out))  # the same text at the same span once


def _gives_back(node: ast.stmt) -> bool:
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Sub):
        return True
    if isinstance(node, ast.Delete):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
        return node.value.func.attr in _GIVE_BACK
    return False


def _enclosing_class(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    p = parents.get(node)
    while p is not None and not isinstance(p, ast.ClassDef):
        p = parents.get(p)
    return p.name if isinstance(p, ast.ClassDef) else ""


def _in_while(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    p = parents.get(node)
    while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
        if isinstance(p, ast.While):
            return True
        p = parents.get(p)
    return False


def _same_typed(attr: str, types: dict[str, dict[str, str]]) -> list[str]:
    """The fields of the same declared type declared next before and next after `attr` in each class that
    declares it (the likeliest to be confused: `peer_streams` beside `node_streams`)."""
    out: set[str] = set()
    for fields in types.values():
        typ = fields.get(attr)
        if typ:
            same = [f for f, t in fields.items() if t == typ]
            i = same.index(attr)
            out |= set(same[max(0, i - 1) : i] + same[i + 1 : i + 2])
    return sorted(out)


def _nan(node: ast.AST, parents: dict[ast.AST, ast.AST], add: Any) -> None:
    # `not a <= b` -> `a > b`; `not lo <= x <= hi` -> `x < lo or x > hi`
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and _ordering(node.operand):
        add("nan_through", node, _paren(_complement(node.operand, numpy=False)))  # type: ignore[arg-type]  # _ordering proved a Compare
    # a chained range check, not under `not`: `lo <= x <= hi` -> `not (x < lo or x > hi)`
    elif (
        isinstance(node, ast.Compare)
        and _ordering(node)
        and len(node.ops) > 1
        and not (isinstance(up := parents.get(node), ast.UnaryOp) and isinstance(up.op, ast.Not))
    ):
        add("nan_through", node, f"(not {_paren(_complement(node, numpy=False))})")
    # `x >= lo and x <= hi` -> `not (x < lo or x > hi)`
    if (
        isinstance(node, ast.BoolOp)
        and isinstance(node.op, ast.And)
        and len(node.values) > 1
        and all(_ordering(v) for v in node.values)
    ):
        parts = [_complement(v, numpy=False) for v in node.values]  # type: ignore[arg-type]  # _ordering proved a Compare
        add("nan_through", node, f"(not {_paren(ast.BoolOp(ast.Or(), parts))})")
    # numpy: `(x >= lo) & (x <= hi)` -> `~((x < lo) | (x > hi))`
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.BitAnd)
        and _ordering(node.left)
        and _ordering(node.right)
    ):
        inner = ast.BinOp(_complement(node.left, True), ast.BitOr(), _complement(node.right, True))  # type: ignore[arg-type]  # _ordering proved a Compare
        add("nan_through", node, f"(~{_paren(inner)})")
    # isfinite removed or narrowed
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "isfinite"
        and isinstance(node.func.value, ast.Name)
        and len(node.args) == 1
    ):
        mod, arg = node.func.value.id, ast.unparse(node.args[0])
        if mod == "math":
            add("nan_through", node, "True")
            add("nan_through", node, f"(not math.isinf({arg}))")
            add("nan_through", node, f"(not math.isnan({arg}))")
        else:
            add("nan_through", node, f"(~{mod}.isinf({arg}))")
            add("nan_through", node, f"(~{mod}.isnan({arg}))")
    # the NaN self-test made blind: `x == x` always true, `x != x` always false
    if (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], (ast.Eq, ast.NotEq))
        and ast.dump(node.left) == ast.dump(node.comparators[0])
    ):
        add("nan_through", node, "True" if isinstance(node.ops[0], ast.Eq) else "False")


# ------------------------------------------------------------ running them


@dataclass
class Outcome:
    operator: str
    line: int
    diff: str
    result: str  # killed, survived, timeout (counted killed), incompetent (the module does not import)
    seconds: float


def run(
    module: str,
    tests: list[str],
    root: Path,
    work: Path,
    command: str,
    timeout_s: float,
    operators: tuple[str, ...] = OPERATORS,
    sample: int | None = None,
    seed: int = 0,
    only: set[str] | None = None,
    log: Any = None,
) -> tuple[list[Outcome], int]:
    """Run `command` (the module's tests) in `work` (a copy of the repository) against each mutant of
    `module`; with `only` (diffs), just those mutants. Returns the outcomes and how many mutants there were."""
    path = work / module
    source = path.read_text()
    every = mutants(source, root, operators)
    chosen = every
    if sample is not None:
        chosen = sorted(
            random.Random(seed).sample(every, min(sample, len(every))),
            key=lambda m: (m.start, m.end, m.operator, m.replacement),
        )
    env = dict(os.environ, PYTHONPATH=str(work), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    outcomes: list[Outcome] = []
    try:
        for m in chosen:
            diff = m.diff(source, module)
            if only is not None and diff not in only:
                continue
            text = m.apply(source)
            try:
                compile(text, module, "exec")
            except SyntaxError:
                outcomes.append(Outcome(m.operator, m.line, diff, "incompetent", 0.0))
                continue
            path.write_text(text)
            t0 = time.monotonic()
            # its own process group: a mutant that hangs is stopped with every process its tests started
            proc = subprocess.Popen(
                shlex.split(command),
                cwd=work,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout_s)
                # pytest: 1 tests failed, 2 collection or import errors (the mutant does not import)
                result = {0: "survived", 1: "killed", 2: "incompetent"}.get(rc, "killed")
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                result = "timeout"
            outcomes.append(Outcome(m.operator, m.line, diff, result, round(time.monotonic() - t0, 1)))
            if log is not None:
                log(f"{result:>11} {module}:{m.line} {m.operator}: {m.replacement[:80]}")
    finally:
        path.write_text(source)
    return outcomes, len(every)


def as_dicts(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    return [asdict(o) for o in outcomes]
