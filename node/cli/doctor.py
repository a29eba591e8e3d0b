"""`murmur doctor`: connectivity and environment checks, each a small function returning `Check`s.

To add a check (NAT type, relay reservation, hole punching, ...), write a
function `(ctx: Context) -> list[Check]` and append it to `CHECKS`; it gets
the config, home and dial timeout, and must bound its own time. A check that
fails says what to do in `fix`. Severity `error` makes the command fail;
`warning` is shown but tolerated (e.g. a laptop behind NAT can still join
through peers that dial it back or through a relay).
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil

from murmur.node.config import Config

MIN_PYTHON = (3, 11)
LIBP2P_VERSION = "0.8.1"
MIN_DISK_BYTES = 2 * 2**30
MIN_BUDGET_MB = 512


class Check(msgspec.Struct, kw_only=True):
    name: str
    ok: bool
    detail: str
    fix: str = ""
    severity: str = "error"  # error | warning

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


@dataclass
class Context:
    cfg: Config
    home: Path
    timeout_s: float = 5.0
    extra_bootstrap: list[str] = field(default_factory=list)

    @property
    def bootstrap(self) -> list[str]:
        return list(dict.fromkeys(self.cfg.network.bootstrap + self.extra_bootstrap))


# ---------------------------------------------------------------- environment


def check_python(ctx: Context) -> list[Check]:
    v = sys.version_info
    ok = (v.major, v.minor) >= MIN_PYTHON
    return [
        Check(
            name="python",
            ok=ok,
            detail=f"Python {v.major}.{v.minor}.{v.micro}",
            fix="" if ok else "install Python 3.11 or newer and reinstall murmur in a fresh venv",
        )
    ]


def check_torch(ctx: Context) -> list[Check]:
    try:
        import torch
    except Exception as e:  # an import failure of any kind is what this check reports
        return [
            Check(
                name="torch",
                ok=False,
                detail=f"cannot import torch: {e}",
                fix="pip install torch==2.13.0 (CPU wheel) or the CUDA build for your GPU",
            )
        ]
    gpu = torch.cuda.is_available()
    return [
        Check(
            name="torch",
            ok=True,
            detail=f"torch {torch.__version__}, {'CUDA ' + torch.cuda.get_device_name(0) if gpu else 'CPU only'}",
        )
    ]


def check_engine(ctx: Context) -> list[Check]:
    """The engine the worker will run: transformers, or vLLM (sparse in place / dense reload) and why not."""
    from murmur.gossip.errors import MurmurError
    from murmur.node.worker.main import engine_check

    if ctx.cfg.training.engine != "vllm":
        return [Check(name="engine", ok=True, detail="transformers")]
    try:
        py, mode = engine_check({"engine": "vllm", "model": ctx.cfg.training.model})
    except MurmurError as e:
        return [
            Check(
                name="engine",
                ok=False,
                detail=str(e),
                fix='bash install.sh --vllm cpu (or --vllm gpu), or set [training] engine = "transformers"',
            )
        ]
    return [Check(name="engine", ok=True, detail=f"{mode}, worker under {py}")]


def check_libp2p(ctx: Context) -> list[Check]:
    try:
        from importlib.metadata import version

        import libp2p  # noqa: F401 - imported only to see that it imports

        v = version("libp2p")
    except Exception as e:
        return [
            Check(
                name="libp2p",
                ok=False,
                detail=f"cannot import libp2p: {e}",
                fix="apt-get install libgmp-dev, then pip install libp2p==0.8.1",
            )
        ]
    ok = v == LIBP2P_VERSION
    return [
        Check(
            name="libp2p",
            ok=ok,
            detail=f"libp2p {v}",
            fix="" if ok else f"murmur is tested with libp2p=={LIBP2P_VERSION}: pip install libp2p=={LIBP2P_VERSION}",
            severity="error" if ok else "warning",
        )
    ]


# ---------------------------------------------------------------- network


def _tcp_listen(addr: str) -> tuple[str, int] | None:
    parts = addr.strip("/").split("/")
    if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp":
        try:
            return parts[1], int(parts[3])
        except ValueError:
            return None
    return None


def check_listen_ports(ctx: Context) -> list[Check]:
    out = []
    for addr in ctx.cfg.network.listen:
        hp = _tcp_listen(addr)
        if hp is None:
            out.append(
                Check(
                    name=f"listen {addr}",
                    ok=False,
                    detail="not an /ip4|ip6/<host>/tcp/<port> address",
                    fix="use e.g. /ip4/0.0.0.0/tcp/4001 in network.listen",
                )
            )
            continue
        host, port = hp
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.bind((host, port))
            out.append(Check(name=f"listen {addr}", ok=True, detail=f"TCP port {port} is free on {host}"))
        except OSError as e:
            out.append(
                Check(
                    name=f"listen {addr}",
                    ok=False,
                    detail=f"cannot bind {host}:{port}: {e.strerror}",
                    fix=f"another program (or a running node) holds port {port}: stop it, or choose "
                    "another port with --listen or network.listen",
                )
            )
        finally:
            s.close()
    return out


async def _dial_all(addrs: list[str], timeout_s: float) -> list[tuple[str, bool, str, float]]:
    import trio

    from murmur.gossip.host import open_transport
    from murmur.gossip.identity import Identity

    results: list[tuple[str, bool, str, float]] = []
    async with open_transport(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"], dial_timeout_s=timeout_s) as t:
        for addr in addrs:
            t0 = time.monotonic()
            try:
                with trio.fail_after(timeout_s):
                    await t.connect(addr)
                results.append((addr, True, "", time.monotonic() - t0))
            except trio.TooSlowError:
                results.append((addr, False, f"no answer within {timeout_s:.0f} s", time.monotonic() - t0))
            except Exception as e:  # ConnectError and friends: reported, not raised
                results.append((addr, False, str(e)[:300], time.monotonic() - t0))
    return results


def check_bootstrap(ctx: Context) -> list[Check]:
    addrs = ctx.bootstrap
    if not addrs:
        return [
            Check(
                name="bootstrap",
                ok=True,
                severity="warning",
                detail="no bootstrap peers configured: this node can only be joined, not join",
                fix="add a peer's full multiaddr (…/p2p/<peer id>) to network.bootstrap or pass --bootstrap",
            )
        ]
    bad = [a for a in addrs if "/p2p/" not in a]
    out = [
        Check(
            name=f"bootstrap {a}",
            ok=False,
            detail="multiaddr lacks /p2p/<peer id>",
            fix="ask the peer for its full address: `murmur node status` prints it",
        )
        for a in bad
    ]
    good = [a for a in addrs if "/p2p/" in a]
    if not good:
        return out
    import trio

    try:
        results = trio.run(_dial_all, good, ctx.timeout_s)
    except Exception as e:
        return out + [
            Check(
                name="bootstrap",
                ok=False,
                detail=f"could not start a libp2p host to dial: {e}",
                fix="run `murmur doctor` again; if it persists, reinstall libp2p==0.8.1",
            )
        ]
    for addr, ok, err, dt in results:
        out.append(
            Check(
                name=f"bootstrap {addr}",
                ok=ok,
                detail=f"connected in {dt * 1000:.0f} ms (Noise, yamux)" if ok else f"unreachable: {err}",
                fix=""
                if ok
                else "check the address and that the peer is running; its firewall must allow "
                "inbound TCP on that port; try another bootstrap peer",
            )
        )
    return out


def _outbound_ip() -> str:
    """The local address the OS would use to reach the Internet (UDP connect sends nothing)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed, no packet is sent
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def check_reachability(ctx: Context) -> list[Check]:
    ports = [hp[1] for hp in (_tcp_listen(a) for a in ctx.cfg.network.listen) if hp]
    hosts = [hp[0] for hp in (_tcp_listen(a) for a in ctx.cfg.network.listen) if hp]
    if hosts and all(ipaddress.ip_address(h).is_loopback for h in hosts if h.replace(".", "").isdigit()):
        return [
            Check(
                name="reachability",
                ok=False,
                severity="warning",
                detail="listening on loopback only: no other machine can dial this node",
                fix="listen on /ip4/0.0.0.0/tcp/4001 to accept peers from other machines",
            )
        ]
    ip = _outbound_ip()
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        addr = ipaddress.ip_address("127.0.0.1")
    port = ports[0] if ports else 4001
    if addr.is_global:
        return [
            Check(
                name="reachability",
                ok=True,
                detail=f"public address {ip}: peers can dial TCP {port} if no firewall blocks it",
                fix="",
            )
        ]
    return [
        Check(
            name="reachability",
            ok=False,
            severity="warning",
            detail=f"address {ip} is private: peers outside your network cannot dial this node (NAT)",
            fix=f"forward TCP port {port} on your router to {ip}, or list public relay peers in "
            "network.relays; outbound connections to bootstrap peers still work",
        )
    ]


# ---------------------------------------------------------------- resources


def check_disk(ctx: Context) -> list[Check]:
    p = ctx.home if ctx.home.exists() else ctx.home.parent
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    ok = free >= MIN_DISK_BYTES
    return [
        Check(
            name="disk",
            ok=ok,
            detail=f"{free / 2**30:.1f} GiB free at {p}",
            fix=""
            if ok
            else f"free at least {MIN_DISK_BYTES / 2**30:.0f} GiB, or move the home with "
            "--home / MURMUR_HOME; lower sync.retain_versions to keep fewer patches",
        )
    ]


def check_memory(ctx: Context) -> list[Check]:
    budget = ctx.cfg.node.memory_budget_mb
    avail = psutil.virtual_memory().available // 2**20
    total = psutil.virtual_memory().total // 2**20
    if budget < MIN_BUDGET_MB:
        return [
            Check(
                name="memory",
                ok=False,
                detail=f"node.memory_budget_mb = {budget} MiB",
                fix=f"set node.memory_budget_mb to at least {MIN_BUDGET_MB}",
            )
        ]
    ok = budget <= avail
    return [
        Check(
            name="memory",
            ok=ok,
            detail=f"budget {budget} MiB, available {avail} of {total} MiB",
            fix=""
            if ok
            else f"lower node.memory_budget_mb to at most {avail} (the node would swap), or close other programs",
            severity="error" if ok else "warning",
        )
    ]


def check_model(ctx: Context) -> list[Check]:
    """Which roles this machine can take for `[training] model`: the plan's estimate against the budget and RAM."""
    import msgspec.structs

    from murmur.gossip.errors import MurmurError
    from murmur.node.worker.modelplan import lr_warning, plan

    cfg = ctx.cfg
    try:
        p = plan(cfg.training.model, cfg.node.memory_budget_mb)
    except MurmurError as e:
        return [
            Check(
                name="model",
                ok=False,
                detail=str(e),
                fix="set training.model to murmur-tiny or a local "
                "Hugging Face causal-LM directory (config.json, weights, tokenizer)",
            )
        ]
    if p is None:
        return [Check(name="model", ok=True, detail="murmur-tiny (built locally): any role fits")]
    usable = min(cfg.node.memory_budget_mb, psutil.virtual_memory().available // 2**20)
    p = msgspec.structs.replace(p, budget_mb=usable)
    need = ", ".join(f"{r} {n} MiB" for r, n in p.need_mb.items())
    fit = p.roles_that_fit()
    lr = f"; training.lr {p.lr:g} suits this size" if cfg.training.lr != p.lr else ""
    too_fast = lr_warning(p, cfg.training.lr)
    rate = (
        [
            Check(
                name="learning rate",
                ok=False,
                detail=too_fast,
                severity="warning",
                fix=f"remove training.lr from the config (or set it to {p.lr:g})",
            )
        ]
        if too_fast
        else []
    )
    detail = (
        f"{p.model}: {p.params / 1e6:.1f}M parameters, needs about {need}; with {usable} MiB usable this "
        f"machine can take: {' or '.join('+'.join(r) for r in fit) or 'no role'}{lr}"
    )
    if not fit:
        return [
            Check(
                name="model",
                ok=False,
                detail=detail,
                fix=f"raise node.memory_budget_mb to at least {p.need_mb['validator']} (and free that much RAM), "
                "or pick a smaller model",
            )
        ] + rate
    if cfg.node.roles and not p.fits(list(cfg.node.roles)):
        return [
            Check(
                name="model",
                ok=False,
                detail=detail,
                fix=f"configured roles {'+'.join(cfg.node.roles)} need about {p.need_for(list(cfg.node.roles))}"
                f" MiB: raise node.memory_budget_mb or set node.roles to one that fits",
            )
        ] + rate
    return [
        Check(
            name="model",
            ok=True,
            detail=detail,
            severity="warning" if ["trainer"] not in fit else "error",
            fix="" if ["trainer"] in fit else "too little memory to train this model: the node will follow",
        )
    ] + rate


def check_nat(ctx: Context) -> list[Check]:
    """Which path this node uses and why: a running node's live view, else a dial-back probe through the
    bootstrap peers (and a relay reservation), else the local guess above (node.cli.doctor_reachability)."""
    from murmur.node.cli.doctor_reachability import doctor_check

    return doctor_check(ctx)


CHECKS: list[Callable[[Context], list[Check]]] = [
    check_python,
    check_torch,
    check_engine,
    check_libp2p,
    check_listen_ports,
    check_bootstrap,
    check_nat,
    check_disk,
    check_memory,
    check_model,
]


def run_checks(
    cfg: Config,
    home: Path,
    extra_bootstrap: list[str] | None = None,
    timeout_s: float = 5.0,
    checks: list[Callable[[Context], list[Check]]] | None = None,
) -> list[Check]:
    ctx = Context(cfg, Path(home), timeout_s, list(extra_bootstrap or []))
    out: list[Check] = []
    for fn in checks or CHECKS:
        try:
            out.extend(fn(ctx))
        except Exception as e:  # a broken check is itself a finding, never a crash of the doctor
            out.append(
                Check(
                    name=fn.__name__.removeprefix("check_"),
                    ok=False,
                    detail=f"check crashed: {e}",
                    fix="report this as a bug with `murmur doctor --json` output",
                )
            )
    return out


def passed(checks: list[Check]) -> bool:
    return all(c.ok or c.severity == "warning" for c in checks)


def render(checks: list[Check], console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table("", "check", "result", "fix", title="murmur doctor")
    for c in checks:
        mark = "[green]pass[/]" if c.ok else ("[yellow]warn[/]" if c.severity == "warning" else "[red]FAIL[/]")
        # details carry paths, addresses and peers' words: text, never markup
        t.add_row(mark, Text(c.name), Text(c.detail), Text(c.fix))
    console.print(t)
