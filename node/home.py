"""The node home: identity key, config.toml and state database in one folder."""

from __future__ import annotations

from pathlib import Path

from murmur.gossip.errors import MurmurError
from murmur.gossip.identity import KEY_FILE, Identity
from murmur.node.config import CONFIG_FILE, Config, load_config, render_default_config
from murmur.node.store import Store, open_store


def init_home(home: Path, force: bool = False) -> Identity:
    """Create (or complete) a node home. Refuses to replace an identity unless forced."""
    home = Path(home)
    try:
        home.mkdir(parents=True, exist_ok=True)
        home.chmod(0o700)
    except OSError as e:
        raise MurmurError(f"{home}: cannot create node home: {e.strerror}") from None
    ident = Identity.generate()
    ident.save(home / KEY_FILE, force=force)
    cfg = home / CONFIG_FILE
    if not cfg.exists():
        tmp = cfg.with_name(cfg.name + ".tmp")
        tmp.write_text(render_default_config())
        tmp.replace(cfg)
    open_store(home).close()
    return ident


def load_identity(home: Path) -> Identity:
    return Identity.load(Path(home) / KEY_FILE)


def ensure_home(home: Path) -> Identity:
    """Identity of an existing home, creating the home first when it is new."""
    if (Path(home) / KEY_FILE).exists():
        return load_identity(home)
    return init_home(home)


def load_home_config(home: Path, explicit: Path | None = None) -> Config:
    return load_config(Path(explicit) if explicit else Path(home) / CONFIG_FILE)


def open_home_store(home: Path) -> Store:
    return open_store(home)
