"""Murmur node: CLI, config, identity, runtime, state store, dashboard, metrics, doctor."""

__version__ = "0.1.0"


def _own_site_packages() -> None:
    """A worker spawned under another environment's interpreter (the vLLM one, node/worker.py) is handed
    the network process's sys.path: swap that virtual environment's site-packages for this
    interpreter's own before anything else is imported. A no-op in any other process."""
    import sys
    import sysconfig
    from pathlib import Path

    own = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    foreign = [p for p in sys.path if p.endswith("site-packages") and p not in own
               and (Path(p).parents[2] / "pyvenv.cfg").exists() and str(Path(p).parents[2]) != sys.prefix]
    if not foreign:
        return
    import site

    sys.path[:] = [p for p in sys.path if p not in foreign]
    for p in dict.fromkeys(own):
        site.addsitedir(p)


_own_site_packages()
