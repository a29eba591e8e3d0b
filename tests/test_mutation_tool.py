"""The mutation-testing script's module table names files that exist (a renamed test would make every mutant
of its module survive)."""

from __future__ import annotations

from pathlib import Path

from simulations.mutation import MODULE_TESTS

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_and_test_file_exists() -> None:
    for module, tests in MODULE_TESTS.items():
        assert (ROOT / module).is_file(), module
        assert tests and all((ROOT / t).is_file() for t in tests), (module, tests)
