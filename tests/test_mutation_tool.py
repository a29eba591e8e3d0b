"""The mutation-testing script's module table names files that exist (a renamed test would make every mutant
of its module survive)."""

from __future__ import annotations

import math
from pathlib import Path

from murmur.simulations.mutation import MODULE_TESTS

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_and_test_file_exists() -> None:
    for module, tests in MODULE_TESTS.items():
        assert (ROOT / module).is_file(), module
        assert tests and all((ROOT / t).is_file() for t in tests), (module, tests)


def _init_session(tmp: Path, name: str) -> Path:
    """A real cosmic-ray session over a small module (cosmic-ray's own `init`; job ids are fresh uuids)."""
    import subprocess
    import sys

    module = tmp / "small.py"
    if not module.exists():
        module.write_text(
            "def f(a, b):\n    if a < b and a != 0:\n        return a + b * 2 - 1\n"
            "    return a // 3 if a >= 5 else b % 4\n"
        )
    cfg = tmp / "cr.toml"
    cfg.write_text(
        f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = 10\nexcluded-modules = []\n'
        'test-command = "true"\n[cosmic-ray.distributor]\nname = "local"\n'
    )
    db = tmp / f"{name}.sqlite"
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", "init", str(cfg), str(db)], cwd=tmp, check=True)
    return db


def _kept(db: Path) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT s.operator_name, s.occurrence, s.start_pos_row, s.start_pos_col "
            "FROM mutation_specs s JOIN work_items w ON w.job_id = s.job_id"
        ).fetchall()
        assert con.execute("SELECT COUNT(*) FROM work_items").fetchone()[0] == len(rows)
    return sorted(rows)


def test_sample_is_n_of_the_mutants_and_the_same_for_the_same_seed(tmp_path: Path) -> None:
    from murmur.simulations.mutation import sample_session

    a, b, c, full = (_init_session(tmp_path, x) for x in "abcf")
    everything = _kept(full)
    assert len(everything) > 20
    assert sample_session(a, 10, seed=0) == (10, len(everything))
    assert sample_session(b, 10, seed=0) == (10, len(everything))
    assert sample_session(c, 10, seed=1) == (10, len(everything))
    # the same mutants although the two inits drew different job ids; another seed, another sample
    assert _kept(a) == _kept(b)
    assert len(_kept(a)) == 10 and set(_kept(a)) <= set(everything)
    assert _kept(c) != _kept(a)
    # more asked than there are: all of them
    assert sample_session(full, 10_000, seed=0) == (len(everything), len(everything))
    assert _kept(full) == everything


def test_the_summary_of_a_sample_says_so_with_its_interval(tmp_path: Path) -> None:
    from murmur.simulations.mutation import report, sample_session

    db = _init_session(tmp_path, "s")
    _, total = sample_session(db, 7, seed=3)
    out = report("small.py", str(db))  # nothing run yet: no score, but the sample is stated
    assert out["sampled"] == f"7 of {total}" and out["seed"] == 3
    assert out["mutants"] == 0 and out["score"] is None and out["interval"] is None


def test_wilson_interval_on_known_cases() -> None:
    from murmur.simulations.mutation import wilson

    # published values of the 95 % Wilson score interval
    lo, hi = wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-4 and abs(hi - 0.7634) < 1e-4
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and abs(hi - 0.2775) < 1e-4
    lo, hi = wilson(10, 10)
    assert abs(lo - 0.7225) < 1e-4 and hi == 1.0
    lo, hi = wilson(81, 263)
    assert abs(lo - 0.2553) < 1e-3 and abs(hi - 0.3662) < 1e-3
    assert wilson(0, 0) == (0.0, 1.0)
    # by definition the bounds are the p where the observed score is z standard errors away from p
    for k, n in ((1, 3), (37, 40), (140, 150), (149, 150)):
        for p in wilson(k, n):
            if 0.0 < p < 1.0:
                assert abs((k / n - p) ** 2 - 1.96**2 * p * (1 - p) / n) < 1e-12


def _position(module: str, line_text: str, token: str) -> tuple[int, int]:
    """(row, column) of `token` in the first line of `module` that contains `line_text`, as cosmic-ray gives it."""
    for row, line in enumerate((ROOT / module).read_text().splitlines(), start=1):
        if line_text in line:
            return row, line.index(token, line.index(line_text))
    raise AssertionError(line_text)


def test_only_mutated_signature_annotations_count_as_equivalent() -> None:
    from murmur.simulations.mutation import _annotation_only

    # a parameter of a signature spread over lines, and a return annotation: strings, never evaluated
    assert _annotation_only(
        "gossip/validation.py", _position("gossip/validation.py", "reward_batch: BatchReward | None", "|")
    )
    assert _annotation_only("gossip/validation.py", _position("gossip/validation.py", "-> Verdict | None:", "|"))
    # a class field (msgspec and dataclasses read these) and a runtime union are code
    assert not _annotation_only(
        "gossip/validation.py", _position("gossip/validation.py", "    batch: wire.RolloutBatch | None = None", "|")
    )
    assert not _annotation_only("gossip/wire.py", _position("gossip/wire.py", "ConfigValue = int | Finite", "|"))
    # the default value after an annotation is code too
    row, col = _position("gossip/validation.py", "reward_batch: BatchReward | None = None", "= None")
    assert not _annotation_only("gossip/validation.py", (row, col + 2))


def test_resume_reruns_the_survivors_but_not_the_equivalent_ones(tmp_path: Path, monkeypatch) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    from murmur.simulations import mutation

    db = _init_session(tmp_path, "r")
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        jobs = [item.job_id for item in wdb.work_items][:3]
        for job, outcome, line in zip(jobs, ("SURVIVED", "SURVIVED", "KILLED"), ("x = 1", "x = 2", "x = 3")):
            wdb.set_result(
                job,
                WorkResult(
                    worker_outcome=WorkerOutcome.NORMAL,
                    test_outcome=TestOutcome[outcome],
                    diff=f"--- a\n+++ b\n-x = 0\n+{line}\n",
                ),
            )
    module = str(tmp_path / "small.py")  # absolute: read where it is, not under the repository
    monkeypatch.setattr(mutation, "EQUIVALENT", {(module, "x = 1")})
    assert mutation.to_rerun(module, db) == [jobs[1]]


SNIPPET = """\
import math


class Budget:
    peer_streams: int = 64
    node_streams: int = 4096
    name: str = ""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.count = 0

    def close(self, q, now: float, window_s: float) -> None:
        self.count -= 1
        q.discard(now)
        while q and q[0] <= now - window_s:
            q.pop()

    def full(self, n: int) -> bool:
        return n >= self.peer_streams

    def bad(self, x: float, a) -> bool:
        if not x <= 1e-3 or x != x:
            return True
        ok = (a >= -1000.0) & (a <= 1e-3)
        return not math.isfinite(x) or not -1000.0 <= x <= 1e-3 or min(x, self.rate) == x
"""


def _texts(op: str) -> set[tuple[int, str]]:
    from murmur.simulations.semantic import mutants

    return {(m.line, m.replacement) for m in mutants(SNIPPET, operators=(op,))}


def test_each_semantic_operator_writes_its_bug() -> None:
    # the wrong end of a window: `<=` for `<` on the expiry, `>` for `>=` on the cap; the window the wrong way
    assert (16, "q[0] < now - window_s") in _texts("window_edge")
    assert (20, "n > self.peer_streams") in _texts("window_edge")
    assert (16, "(now + window_s)") in _texts("window_sign")
    assert (26, "max(x, self.rate)") in _texts("window_sign")
    # a count not given back; the drain loop's pop is left alone (removing it only hangs the loop)
    assert _texts("given_back") == {(14, "pass"), (15, "pass")}
    # the check on the other int field declared beside it, never on a field of another type
    assert _texts("wrong_field") == {(20, "self.node_streams")}
    nan = _texts("nan_through")
    assert (23, "(x > 0.001)") in nan  # `not x <= hi` written `x > hi`
    assert (23, "False") in nan  # the NaN self-test made false
    assert (25, "(~((a < -1000.0) | (a > 0.001)))") in nan  # numpy's range check as "not outside"
    assert {(26, "True"), (26, "(not math.isinf(x))"), (26, "(not math.isnan(x))")} <= nan  # isfinite removed
    assert (26, "(-1000.0 > x or x > 0.001)") in nan  # `not lo <= x <= hi` written "outside"


def test_a_semantic_mutant_changes_only_its_span_and_lets_nan_through() -> None:
    from murmur.simulations.semantic import mutants

    ns: dict[str, object] = {}
    exec(compile(SNIPPET, "snippet", "exec"), ns)
    assert ns["Budget"](1.0).bad(math.nan, None) is True  # type: ignore[operator]
    (m,) = [m for m in mutants(SNIPPET, operators=("nan_through",)) if m.line == 23 and m.replacement == "(x > 0.001)"]
    mutated = m.apply(SNIPPET)
    diff = m.diff(SNIPPET, "snippet.py")
    assert [x for x in diff.splitlines() if x[:1] in "+-" and x[:3] not in ("+++", "---")] == [
        "-        if not x <= 1e-3 or x != x:",
        "+        if (x > 0.001) or x != x:",
    ]
    assert mutated.splitlines()[:22] == SNIPPET.splitlines()[:22]
    ns = {}
    exec(compile(mutated, "snippet", "exec"), ns)
    budget = ns["Budget"](-5.0)  # type: ignore[operator]
    assert budget.bad(0.5, None) is True and budget.bad(-1.0, -1.0) is False
    assert not (math.nan > 0.001)  # the mutant's own check lets NaN through (the self-test behind it does not)


def test_semantic_outcomes_are_summarised_per_operator_with_equivalents_apart(monkeypatch) -> None:
    from murmur.simulations import mutation

    rows = [
        {"operator": "window_edge", "line": 3, "diff": "--- a\n+++ b\n-x\n+y = 1\n", "result": "killed"},
        {"operator": "window_edge", "line": 4, "diff": "--- a\n+++ b\n-x\n+y = 2\n", "result": "survived"},
        {"operator": "given_back", "line": 5, "diff": "--- a\n+++ b\n-x\n+pass\n", "result": "timeout"},
        {"operator": "nan_through", "line": 6, "diff": "--- a\n+++ b\n-x\n+y = 3\n", "result": "survived"},
        {"operator": "nan_through", "line": 7, "diff": "--- a\n+++ b\n-x\n+y = 4\n", "result": "incompetent"},
    ]
    monkeypatch.setattr(mutation, "EQUIVALENT", {("m.py", "y = 3")})
    out = mutation.summarize_semantic("m.py", [], rows, total=5)
    assert (out["killed"], out["survived"], out["equivalent"], out["incompetent"]) == (2, 1, 1, 1)
    assert out["score"] == round(2 / 3, 3)
    assert out["operators"] == {"given_back": "1/1", "window_edge": "1/2"}
    assert [s["line"] for s in out["survivors"]] == [4]
