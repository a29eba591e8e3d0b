"""Am I reachable? AutoNAT-style dial-back by peers over `/murmur/dialback/1`.

Why our own protocol: py-libp2p 0.8.1 has an AutoNAT service, but it was not verified, and what the
node needs is simple and must be bounded: "peer, please dial these addresses of mine and tell me
which answered as me". The server dials from a throwaway host (fresh key, no listener), so the
dial-back is a new connection that must complete Noise *as the requester's peer id* — an existing
connection, or somebody else listening at that address, does not count.

Abuse limits (a dial-back server must not become a port scanner or amplifier): it dials only
addresses whose IP equals the IP it sees the request come from, at most `MAX_ADDRS` addresses,
`DIAL_TIMEOUT_S` each, one request per peer at a time, `MAX_CONCURRENT` requests overall; relayed
requests are refused (the observed IP would be the relay's).

Messages (msgspec, one length-prefixed frame each, `gossip.framing`):
    DialbackRequest  {v: 1, nonce: 16 bytes, addrs: [str ≤ 256 chars] ≤ MAX_ADDRS (empty: only report `observed`)}
    DialbackResponse {v: 1, nonce, observed: "ip:port" or "", results: [DialResult]}
    DialResult       {addr, ok, error ≤ 200 chars, ms}

The decision (`decide`) is a plain function over results from several peers: public if at least one
peer dialled one of our addresses successfully; private if at least `min_peers` peers answered and
none could; unknown otherwise.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import trio

from murmur.gossip.errors import DecodeError, MurmurError
from murmur.gossip.framing import read_frame, write_frame
from murmur.gossip.transport import Stream, StreamError

log = logging.getLogger("murmur.gossip.dialback")

PROTOCOL = "/murmur/dialback/1"
MAX_ADDRS = 4
MAX_ADDR_LEN = 256
MAX_FRAME = 8 * 1024
DIAL_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = MAX_ADDRS * DIAL_TIMEOUT_S + 5.0
MAX_CONCURRENT = 4

PUBLIC, PRIVATE, UNKNOWN = "public", "private", "unknown"


class ReachabilityError(MurmurError):
    """A dial-back request or response was malformed, refused, or timed out."""


class DialbackRequest(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    nonce: bytes
    addrs: list[str]


class DialResult(msgspec.Struct, forbid_unknown_fields=True):
    addr: str
    ok: bool
    error: str = ""
    ms: Annotated[float, msgspec.Meta(ge=0.0, le=1e7)] = 0.0  # a range refuses NaN and inf (docs/protocol.md)


class DialbackResponse(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    nonce: bytes
    observed: str
    results: list[DialResult]


class MalformedDialback(ReachabilityError, DecodeError):
    """A dial-back message that breaks the protocol: a fault of its sender (scored by the host)."""


def _decode(data: bytes, typ: type[Any]) -> Any:
    try:
        return msgspec.msgpack.decode(data, type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedDialback(f"malformed {typ.__name__}: {e}") from None


def check_request(req: DialbackRequest) -> None:
    if req.v != 1:
        raise ReachabilityError(f"unsupported dial-back version {req.v}")  # a newer peer, not a fault
    if len(req.nonce) != 16:
        raise MalformedDialback("nonce must be 16 bytes")
    if len(req.addrs) > MAX_ADDRS:  # an empty list asks only "how do you see me?"
        raise MalformedDialback(f"at most {MAX_ADDRS} addresses per request, got {len(req.addrs)}")
    for a in req.addrs:
        if len(a) > MAX_ADDR_LEN:
            raise MalformedDialback(f"address longer than {MAX_ADDR_LEN} characters")


def addr_ip(addr: str) -> str | None:
    """The IP of an /ip4|/ip6 multiaddr string, else None."""
    parts = addr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            return str(ipaddress.ip_address(parts[2]))
        except ValueError:
            return None
    return None


def is_public_ip(ip: str | None) -> bool:
    if ip is None:
        return False
    try:
        return ipaddress.ip_address(ip).is_global
    except ValueError:
        return False


# ------------------------------------------------------------------ decision (sans-IO)
@dataclass
class PeerVerdict:
    peer: str
    observed: str  # how that peer saw us ("ip:port"), "" if unknown
    reachable: list[str]  # our addresses it dialled successfully
    failed: dict[str, str]  # address -> error
    error: str = ""  # the request itself failed
    local_port: int = 0  # our source port of the connection that peer observed (0: unknown)


@dataclass
class Reachability:
    status: str  # public / private / unknown
    reachable_addrs: list[str]
    observed_ips: list[str]
    verdicts: list[PeerVerdict] = field(default_factory=list)
    reason: str = ""
    checked_unix: float = 0.0
    port_preserved: bool | None = None  # our NAT kept the source port (hole punching can predict it)


def port_preserved(verdicts: list[PeerVerdict]) -> bool | None:
    """Did every peer observe our connection at the source port we used? None when nobody could tell.

    Why: DCUtR predicts our public address as observed IP + listen port, which only works through a NAT
    that keeps ports; a port-randomising ("symmetric") NAT shows up here as a mismatch.
    """
    seen = []
    for v in verdicts:
        if v.error or not v.observed or not v.local_port:
            continue
        try:
            seen.append(int(v.observed.rsplit(":", 1)[1]) == v.local_port)
        except (IndexError, ValueError):
            continue
    return all(seen) if seen else None


def decide(verdicts: list[PeerVerdict], min_peers: int = 1, now: float | None = None) -> Reachability:
    """Public if any peer dialled us back; private if `min_peers` answered and none could; else unknown."""
    answered = [v for v in verdicts if not v.error]
    reachable = sorted({a for v in answered for a in v.reachable})
    observed = sorted({v.observed.rsplit(":", 1)[0] for v in answered if v.observed})
    ts = time.time() if now is None else now
    kept = port_preserved(verdicts)
    if reachable:
        who = sum(1 for v in answered if v.reachable)
        return Reachability(
            PUBLIC, reachable, observed, verdicts, f"{who} peer(s) dialled back {reachable[0]}", ts, kept
        )
    if len(answered) >= min_peers and answered:
        errs = sorted({e for v in answered for e in v.failed.values()})
        return Reachability(
            PRIVATE,
            [],
            observed,
            verdicts,
            f"{len(answered)} peer(s) could not dial any announced address ({'; '.join(errs)[:300]})",
            ts,
            kept,
        )
    why = "; ".join(v.error for v in verdicts if v.error)[:300]
    return Reachability(
        UNKNOWN,
        [],
        observed,
        verdicts,
        f"{len(answered)} of {min_peers} needed peer(s) answered" + (f" ({why})" if why else ""),
        ts,
        kept,
    )


# ------------------------------------------------------------------ server
class DialbackServer:
    """Serves `/murmur/dialback/1` on a transport. Dials from a throwaway host inside `nursery`."""

    def __init__(self, transport: Any, dial_timeout_s: float = DIAL_TIMEOUT_S) -> None:
        self.transport = transport
        self.dial_timeout_s = dial_timeout_s
        self._busy: set[str] = set()
        self._sem = trio.Semaphore(MAX_CONCURRENT)
        self.served = 0
        self.refused = 0
        transport.set_stream_handler(PROTOCOL, self._handle)

    def _observed(self, remote: str) -> tuple[str, str]:
        """(ip, "ip:port") of the connection `remote` used, "" when relayed or unknown."""
        from libp2p.peer.id import ID

        conns = (self.transport.host.get_network().connections or {}).get(ID.from_base58(remote)) or []
        if not isinstance(conns, list):
            conns = [conns]
        for c in conns:
            addrs = [str(a) for a in (c.get_transport_addresses() or [])]
            if any("/p2p-circuit" in a for a in addrs):
                continue
            try:
                host, port = c.muxed_conn.secured_conn.get_remote_address()
                return str(host), f"{host}:{port}"
            except Exception:
                for a in addrs:
                    ip = addr_ip(a)
                    if ip:
                        parts = a.split("/")
                        return ip, f"{ip}:{parts[4] if len(parts) > 4 else 0}"
        return "", ""

    async def _handle(self, stream: Stream, remote: str) -> None:
        with trio.fail_after(REQUEST_TIMEOUT_S):
            req = _decode(await read_frame(stream, MAX_FRAME), DialbackRequest)
            check_request(req)
            ip, observed = self._observed(remote)
            if not ip:
                self.refused += 1
                raise ReachabilityError(f"dial-back request from {remote} over a relay refused")
            if remote in self._busy:
                self.refused += 1
                raise ReachabilityError(f"{remote} already has a dial-back in flight")
            self._busy.add(remote)
            try:
                async with self._sem:
                    results = await self._dial_all(remote, ip, req.addrs)
            finally:
                self._busy.discard(remote)
            resp = DialbackResponse(1, req.nonce, observed, results)
            await write_frame(stream, msgspec.msgpack.encode(resp))
            self.served += 1
        await stream.close()

    async def _dial_all(self, remote: str, ip: str, addrs: list[str]) -> list[DialResult]:
        results: list[DialResult] = []
        todo = []
        for a in addrs:
            aip = addr_ip(a)
            if aip is None or "/tcp/" not in a or "/p2p-circuit" in a:
                results.append(DialResult(a, False, "only direct /ip4|ip6/.../tcp/ addresses are dialled back"))
            elif aip != ip:
                results.append(DialResult(a, False, f"address IP differs from the requester's IP {ip}"))
            else:
                todo.append(a)
        if todo:
            results.extend(await dial_as(remote, todo, self.dial_timeout_s))
        return results


async def dial_as(peer_id: str, addrs: list[str], timeout_s: float) -> list[DialResult]:
    """Dial each address from a throwaway host, expecting Noise to authenticate `peer_id` there."""
    from murmur.gossip.host import open_transport
    from murmur.gossip.identity import Identity

    out: list[DialResult] = []
    async with open_transport(Identity.from_seed(os.urandom(32)), listen=[], dial_timeout_s=timeout_s) as probe:
        for a in addrs:
            full = a if "/p2p/" in a else f"{a}/p2p/{peer_id}"
            t0 = time.perf_counter()
            ok, err = False, ""
            with trio.move_on_after(timeout_s + 0.5) as scope:
                try:
                    got = await probe.connect(full)
                    ok = got == peer_id
                    err = "" if ok else f"answered as {got}"
                except MurmurError as e:
                    err = str(e)[:200]
            if scope.cancelled_caught:
                err = f"no answer within {timeout_s:.1f} s"
            out.append(DialResult(a, ok, err[:200], round((time.perf_counter() - t0) * 1000, 1)))
            if ok:
                await probe.disconnect(peer_id)
    return out


# ------------------------------------------------------------------ client
def local_port(transport: Any, peer: str) -> int:
    """Our TCP source port of the direct connection to `peer` (0 if relayed or not visible).

    py-libp2p 0.8.1 exposes no local address on a connection; this walks its wrappers down to the
    trio socket, and gives up quietly if that layout changes.
    """
    from libp2p.peer.id import ID

    try:
        conns = (transport.host.get_network().connections or {}).get(ID.from_base58(peer)) or []
    except Exception:
        return 0
    for c in conns if isinstance(conns, list) else [conns]:
        try:
            if any("/p2p-circuit" in str(a) for a in (c.get_transport_addresses() or [])):
                continue
            raw = c.muxed_conn.secured_conn.conn.read_writer.read_write_closer
            return int(raw.stream.stream.socket.getsockname()[1])
        except Exception:
            continue
    return 0


def candidate_addrs(transport: Any, observed_ips: list[str] | None = None) -> list[str]:
    """Our direct TCP listen addresses, plus each observed public IP at our listen port (port forwarding)."""
    out: list[str] = []
    ports: set[str] = set()
    for a in transport.listen_addrs():
        if "/p2p-circuit" in a or "/tcp/" not in a:
            continue
        base = a.split("/p2p/")[0]
        parts = base.split("/")
        if len(parts) > 4:
            ports.add(parts[4])
        if addr_ip(base) in ("0.0.0.0", "::"):  # a wildcard listen is not an address anyone can dial
            continue
        if base not in out:
            out.append(base)
    for ip in observed_ips or []:
        fam = "ip6" if ":" in ip else "ip4"
        for p in sorted(ports):
            c = f"/{fam}/{ip}/tcp/{p}"
            if c not in out:
                out.append(c)
    # observed (public) candidates first: they are what matters behind a NAT
    out.sort(key=lambda a: 0 if any(f"/{ip}/" in a for ip in (observed_ips or [])) else 1)
    return out[:MAX_ADDRS]


async def ask_dialback(
    transport: Any, peer: str, addrs: list[str], timeout_s: float = REQUEST_TIMEOUT_S
) -> PeerVerdict:
    """Ask one connected peer to dial `addrs` back."""
    nonce = os.urandom(16)
    req = DialbackRequest(1, nonce, addrs[:MAX_ADDRS])
    check_request(req)
    try:
        with trio.fail_after(timeout_s):
            stream = await transport.open_stream(peer, PROTOCOL)
            try:
                await write_frame(stream, msgspec.msgpack.encode(req))
                resp = _decode(await read_frame(stream, MAX_FRAME), DialbackResponse)
            finally:
                await stream.close()
    except trio.TooSlowError:
        return PeerVerdict(peer, "", [], {}, f"{peer}: no dial-back answer within {timeout_s:.0f} s")
    except (StreamError, ReachabilityError) as e:
        return PeerVerdict(peer, "", [], {}, f"{peer}: {e}")
    if resp.nonce != nonce or resp.v != 1:
        return PeerVerdict(peer, "", [], {}, f"{peer}: dial-back answer does not match the request")
    asked = set(req.addrs)
    ok = [r.addr for r in resp.results if r.ok and r.addr in asked]
    failed = {r.addr: r.error for r in resp.results if not r.ok and r.addr in asked}
    return PeerVerdict(peer, resp.observed[:64], ok, failed, local_port=local_port(transport, peer))


async def check_reachability(
    transport: Any, peers: list[str], min_peers: int = 1, timeout_s: float = REQUEST_TIMEOUT_S
) -> Reachability:
    """Two rounds: learn how peers see us, then ask them to dial our listen and observed addresses."""
    direct_peers = [p for p in peers if p != transport.peer_id][:8]
    if not direct_peers:
        return decide([], min_peers)
    # Round 1 (cheap): our listen addresses, and how each peer observes us.
    first: list[PeerVerdict] = []

    async def ask(p: str, addrs: list[str], into: list[PeerVerdict]) -> None:
        into.append(await ask_dialback(transport, p, addrs, timeout_s))

    async with trio.open_nursery() as n:
        for p in direct_peers:
            n.start_soon(ask, p, candidate_addrs(transport), first)
    observed = sorted({v.observed.rsplit(":", 1)[0] for v in first if v.observed})
    extra = [a for a in candidate_addrs(transport, observed) if addr_ip(a) in observed]
    if not extra or decide(first, min_peers).status == PUBLIC:
        return decide(first, min_peers)
    # Round 2: our observed IP(s) at our listen port — succeeds when the user forwarded the port.
    second: list[PeerVerdict] = []
    async with trio.open_nursery() as n:
        for p in direct_peers:
            n.start_soon(ask, p, extra, second)
    merged = []
    for v in first:
        w = next((x for x in second if x.peer == v.peer), None)
        if w is None or w.error:
            merged.append(v)
        else:
            merged.append(
                PeerVerdict(
                    v.peer,
                    v.observed or w.observed,
                    v.reachable + w.reachable,
                    {**v.failed, **w.failed},
                    v.error if not w.reachable else "",
                    v.local_port or w.local_port,
                )
            )
    return decide(merged, min_peers)
