"""The worker process's entry point (`node.shell.workerlink` spawns `main`), stdlib only until it hands over.

With `engine = "vllm"` the worker runs under the vLLM environment's interpreter, and multiprocessing's
spawn hands the child the network process's `sys.path`, site-packages included: the swap to this
interpreter's own site-packages must come before the worker imports numpy, torch or vLLM, so it runs
here, before `node.worker.main` is imported. (Under the `murmur` console script the child first re-runs that
script, whose imports are the CLI's pure-Python typer and rich.) A no-op under the network process's own
interpreter.
"""

from __future__ import annotations

from typing import Any


def own_site_packages() -> None:
    """Swap the site-packages of another virtual environment on `sys.path` for this interpreter's own."""
    import sys
    import sysconfig
    from pathlib import Path

    own = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    foreign = [
        p
        for p in sys.path
        if p.endswith("site-packages")
        and p not in own
        and (Path(p).parents[2] / "pyvenv.cfg").exists()
        and str(Path(p).parents[2]) != sys.prefix
    ]
    if not foreign:
        return
    import site

    sys.path[:] = [p for p in sys.path if p not in foreign]
    for p in dict.fromkeys(own):
        site.addsitedir(p)


def main(conn: Any, spec: dict[str, Any]) -> None:
    """Entry point of the spawned worker process: `node.worker.main` under this interpreter's own packages."""
    own_site_packages()
    from murmur.node.worker import main as worker

    worker.main(conn, spec)
