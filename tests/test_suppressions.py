"""Every suppression in the product packages names what it silences and says why (docs/testing.md, "Lint and
types"): `# type: ignore[code]  # reason` and `# noqa: CODE - reason` (or `# noqa: CODE  # reason`). ruff
(RUF100) and mypy (warn_unused_ignores) in .ci/run drop the ones no longer needed; this keeps the rest explained."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("node", "gossip", "sync", "training", "simulations")
TYPE_IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<codes>\[[^\]]*\])?(?P<rest>.*)")
NOQA = re.compile(r"#\s*noqa\b(?::\s*(?P<codes>[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*))?(?P<rest>.*)", re.IGNORECASE)
REASON = re.compile(r"\s+(?:#|-)\s*\w")


def unexplained(source: str) -> list[tuple[int, str]]:
    """(line, comment) of each suppression comment in `source` without a code or without a reason after it."""
    bad = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        for pattern in (TYPE_IGNORE, NOQA):
            m = pattern.search(tok.string)
            if m and not (m["codes"] and REASON.match(m["rest"])):
                bad.append((tok.start[0], tok.string))
    return bad


def test_every_type_ignore_and_noqa_in_the_product_packages_names_its_code_and_a_reason() -> None:
    bad = [
        f"{f.relative_to(ROOT)}:{line}: {text}"
        for pkg in PACKAGES
        for f in sorted((ROOT / pkg).rglob("*.py"))
        for line, text in unexplained(f.read_text())
    ]
    assert not bad, "\n".join(bad)


def test_a_bare_or_unexplained_suppression_is_found_and_an_explained_one_passes() -> None:
    src = """x = f()  # type: ignore
y = g()  # type: ignore[attr-defined]
z = h()  # type: ignore[attr-defined]  # the stubs lack h
import os  # noqa
import re  # noqa: F401
import io  # noqa: F401 - re-exported
import sys  # noqa: E402, F401  # after the path is set
s = "# type: ignore"  # a string, not a comment
"""
    assert [line for line, _ in unexplained(src)] == [1, 2, 4, 5]
