"""In CI (env CI=true) a skip that tests/conftest.py's ALLOWED_CI_SKIPS does not list fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_sessionfinish  # noqa: F401\n")
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    assert True\n\n"
        "def test_quietly_skips():\n    pytest.skip('no network namespaces')\n\n"
        "@pytest.mark.xfail(reason='known')\ndef test_known_failure():\n    assert False\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=str(tmp_path),
    )


def test_unexpected_skip_fails_the_run_in_ci(tmp_path: Path) -> None:
    ci = _run(tmp_path, "true")
    assert ci.returncode == 1, ci.stdout[-2000:]
    assert "test_some.py::test_quietly_skips" in ci.stdout and "test_known_failure" not in ci.stdout.split("CI:")[-1]


def test_outside_ci_skips_pass(monkeypatch) -> None:
    from tests.conftest import pytest_sessionfinish

    monkeypatch.delenv("CI", raising=False)
    pytest_sessionfinish(None, 0)  # type: ignore[arg-type]  # returns before touching the session


def test_allowed_prefixes_cover_their_skips() -> None:
    from types import SimpleNamespace

    from tests.conftest import unexpected_skips

    reps = [
        SimpleNamespace(nodeid="tests/test_a.py::test_x"),
        SimpleNamespace(nodeid="tests/test_b.py::test_y"),
        SimpleNamespace(nodeid="tests/test_c.py::test_z", wasxfail="known"),
    ]
    assert unexpected_skips(reps, {"tests/test_a.py": "why"}) == ["tests/test_b.py::test_y"]
