"""Inbound connections per source address range (sans-IO), as go-libp2p's connection limiter counts them.

A key is free to make, so per-peer limits alone let one machine open as many connections as it
makes keys. Connections are therefore also counted per source range: one IPv4 address (/32) or
one IPv6 /56 (what one subscriber is usually given) may hold `StreamLimits.ip_connections`
inbound connections at once. Loopback is unlimited, as in go-libp2p: a local swarm or a relay on
the same machine is the operator's own. The count is taken from the connections the host holds
at the moment a new one is added, so a closed connection frees its place with no bookkeeping.
A refusal charges no one: many honest nodes share one address behind a NAT.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IPV4_PREFIX = 32
IPV6_PREFIX = 56
UNLIMITED = ("127.0.0.0/8", "::1/128")


def range_of(ip: str, unlimited: Iterable[str] = UNLIMITED) -> str | None:
    """The range `ip` is counted in ("198.51.100.7/32", "2001:db8:0:100::/56"); None when it is not
    counted (an unlimited network, or not an address)."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    for net in unlimited:
        try:
            if addr in ipaddress.ip_network(net, strict=False):
                return None
        except (ValueError, TypeError):
            continue
    prefix = IPV4_PREFIX if addr.version == 4 else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{addr}/{prefix}", strict=False))


def full_range(ip: str, held: Iterable[str], cap: int, unlimited: Iterable[str] = UNLIMITED) -> str | None:
    """The range a new inbound connection from `ip` would overfill, given the addresses of the
    inbound connections held now (`held`); None when it may be added."""
    rng = range_of(ip, unlimited)
    if rng is None:
        return None
    n = sum(1 for other in held if range_of(other, unlimited) == rng)
    return rng if n >= cap else None
