"""WebRTC-direct fallback (aiortc, a default dependency), imported lazily.

`attach_webrtc` adds the `/webrtc-direct` transport to a running node's host (node.shell.reachability does, with
`network.webrtc`); `measure_loopback` is the benchmark's throughput figure.

Why a fallback only: aiortc pulls in av/ffmpeg wheels and runs on asyncio (py-libp2p bridges it to trio in a
thread); it was measured at 1.4–3.1 MB/s py<->py with one negotiation in six timing out, so it is a
fallback for UDP-only networks, never the default path. When aiortc is missing everything here
reports why instead of failing.

py-libp2p 0.8.1's `/webrtc-direct` needs four fixes before a node can use it; `gossip.libp2p_fixes`
installs them (`install_webrtc`, called here before any connection), and their policy is here as plain
functions (`forget_stream`, `drain_send_queue`, `reset_on_overflow`).

`measure_loopback` builds two throwaway hosts with py-libp2p's `/webrtc-direct` transport (listener
on 127.0.0.1 UDP) and times one bulk stream; the benchmark reports it as `webrtc_mb_s`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from typing import Any

import trio

from murmur.gossip.errors import MurmurError


class WebRTCUnavailable(MurmurError):
    """The WebRTC extra is not installed or the negotiation failed."""


SEND_QUEUE_HIGH = 256 * 1024  # bytes queued in aiortc's SCTP association before a writer waits
SEND_DRAIN_POLL_S = 0.005
SEND_DRAIN_MAX_S = 30.0


def send_queue_bytes(sctp: Any) -> int:
    """Bytes that aiortc's SCTP association holds for data channels and has not handed to SCTP yet."""
    queue = getattr(sctp, "_data_channel_queue", None) or ()
    return sum(len(item[2]) for item in queue)


def forget_stream(stream: Any) -> None:
    """Remove a WebRTC stream that was cleaned up (closed, reset) from its connection's registry, so closed
    streams stop counting against the connection's `max_concurrent_streams` (256)."""
    # the class's method: py-libp2p's SwarmConn shadows `remove_stream` on the instance with an async
    # NetStream hook of another signature, which is part of why nothing ever removed a WebRTC stream
    remove = getattr(type(stream.muxed_conn), "remove_stream", None)
    if remove is not None:
        remove(stream.muxed_conn, stream._channel_id)


async def drain_send_queue(pc: Any) -> None:
    """Wait (on aiortc's asyncio thread, which py-libp2p's WebRTC write awaits) while the peer connection's
    SCTP association holds more than `SEND_QUEUE_HIGH` bytes for data channels.

    Why: aiortc's `RTCDataChannel.send` never blocks and its association sends all channels' messages from
    one FIFO, so a bulk writer queued megabytes ahead of the wire and a stream opened meanwhile (its DCEP
    open and multistream-select behind that backlog) took 4-10 s on loopback, and real nodes behind a
    UDP-only NAT never fetched a patch. aiortc has no event for the association-wide queue, so it is
    polled, bounded by `SEND_DRAIN_MAX_S`."""
    import asyncio

    waited = 0.0
    while (sctp := pc.sctp) is not None and send_queue_bytes(sctp) > SEND_QUEUE_HIGH:
        if waited >= SEND_DRAIN_MAX_S or getattr(sctp, "state", "") == "closed":
            return
        await asyncio.sleep(SEND_DRAIN_POLL_S)
        waited += SEND_DRAIN_POLL_S


READ_QUEUE_MESSAGES = 256  # data-channel messages (<= 16 KiB each) queued for a stream's reader


class _ResetOnOverflow:
    """A WebRTC stream's read-queue sender that resets the stream when the queue is full."""

    def __init__(self, inner: Any, stream: Any) -> None:
        self._inner = inner
        self._stream = stream

    def send_nowait(self, value: bytes) -> None:
        try:
            self._inner.send_nowait(value)
        except trio.WouldBlock:
            if value and not getattr(self._stream, "_murmur_overflowed", False):
                self._stream._murmur_overflowed = True
                self._stream._reset_on_trio_thread()  # RESET to the peer; our reader gets an error
            # an empty value is py-libp2p's end-of-stream marker: a full queue needs none

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def reset_on_overflow(stream: Any) -> None:
    """Give a new WebRTC stream a read queue of `READ_QUEUE_MESSAGES` (4 MiB at most) whose overflow resets
    the stream: the reader gets an error, nothing is lost silently, and the chunk broadcast reopens the
    stream and asks again (a dropped message would leave a hole our length-prefixed frames decode as
    garbage, and the honest sender penalised for it)."""
    send, stream._read_recv = trio.open_memory_channel[bytes](READ_QUEUE_MESSAGES)
    stream._read_send = _ResetOnOverflow(send, stream)


def webrtc_unavailable() -> str | None:
    """None if aiortc can be imported; otherwise the reason (without importing it: it is slow)."""
    if importlib.util.find_spec("aiortc") is None:
        return "aiortc is not installed (rerun `bash install.sh`, or .venv/bin/pip install -e .)"
    return None


async def measure_loopback(n_bytes: int = 4 << 20, timeout_s: float = 60.0) -> dict[str, Any]:
    """Bulk-stream `n_bytes` between two local hosts over /webrtc-direct; returns mb_s, connect_s, hash_ok."""
    reason = webrtc_unavailable()
    if reason:
        raise WebRTCUnavailable(reason)
    import multiaddr
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import PeerInfo

    from murmur.gossip import libp2p_fixes  # not at the top: libp2p_fixes imports this module for the fixes' policy

    libp2p_fixes.install_webrtc()
    proto = TProtocol("/murmur/bench/webrtc-bulk/1")
    a = new_host(key_pair=create_new_key_pair(os.urandom(32)), enable_webrtc=True)
    b = new_host(key_pair=create_new_key_pair(os.urandom(32)), enable_webrtc=True)
    done = trio.Event()
    result: dict[str, Any] = {}

    async def handler(stream: Any) -> None:
        h = hashlib.blake2b(digest_size=32)
        got = 0
        while got < n_bytes:
            part = await stream.read(65536)
            if not part:
                break
            h.update(part)
            got += len(part)
        result["digest"] = h.digest()
        result["got"] = got
        done.set()

    try:
        with trio.fail_after(timeout_s):
            async with (
                b.run([multiaddr.Multiaddr("/ip4/127.0.0.1/udp/0/webrtc-direct")]),
                a.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]),
            ):
                b.set_stream_handler(proto, handler)
                addrs = [x for x in b.get_addrs() if "webrtc-direct" in str(x)]
                if not addrs:
                    raise WebRTCUnavailable(f"no /webrtc-direct listen address: {[str(x) for x in b.get_addrs()]}")
                t = time.perf_counter()
                await a.connect(PeerInfo(b.get_id(), addrs))
                connect_s = time.perf_counter() - t
                s = await a.new_stream(b.get_id(), [proto])
                block = os.urandom(16384)  # data-channel messages are small
                h = hashlib.blake2b(digest_size=32)
                t = time.perf_counter()
                sent = 0
                while sent < n_bytes:
                    c = block[: min(len(block), n_bytes - sent)]
                    await s.write(c)
                    h.update(c)
                    sent += len(c)
                await done.wait()
                dt = time.perf_counter() - t
                return {
                    "mb_s": round(n_bytes / dt / 1e6, 2),
                    "connect_s": round(connect_s, 3),
                    "hash_ok": result.get("digest") == h.digest(),
                    "addr": str(addrs[0]),
                }
    except WebRTCUnavailable:
        raise
    except trio.TooSlowError:
        raise WebRTCUnavailable(f"WebRTC-direct loopback transfer did not finish within {timeout_s:.0f} s") from None
    except Exception as e:
        raise WebRTCUnavailable(f"WebRTC-direct failed: {type(e).__name__}: {e}"[:300]) from None


def webrtc_listen_for(tcp_addrs: list[str]) -> list[str]:
    """UDP `/webrtc-direct` listen addresses next to the TCP ones: same IP, same port number (one port to
    forward), wildcards kept (py-libp2p's listener advertises the interface address for 0.0.0.0)."""
    out = []
    for a in tcp_addrs:
        p = a.split("/")
        if len(p) > 4 and p[1] in ("ip4", "ip6") and p[3] == "tcp" and "/p2p-circuit" not in a and "/ws" not in a:
            out.append(f"/{p[1]}/{p[2]}/udp/{p[4]}/webrtc-direct")
    return list(dict.fromkeys(out))


def is_webrtc_addr(addr: str) -> bool:
    return "/webrtc-direct" in addr


async def attach_webrtc(transport: Any, listen: list[str]) -> list[str]:
    """Add py-libp2p's `/webrtc-direct` transport to a running host and listen on `listen` (UDP).

    Why after the host runs: the node's host is built before its config is looked at here, and the swarm
    routes dials and listeners by multiaddr, so a transport added later serves both. A UDP port that is
    taken falls back to an ephemeral one. Returns the advertised addresses (with certhash and /p2p/);
    raises WebRTCUnavailable with the reason when aiortc is missing or no listener starts.
    """
    reason = webrtc_unavailable()
    if reason:
        raise WebRTCUnavailable(reason)
    import importlib

    import multiaddr

    # aiortc's import (~0.4 s at load 17) would stall the event loop, and with it the node's first gossip:
    # import it in a thread, where the loop keeps running between GIL switches
    await trio.to_thread.run_sync(importlib.import_module, "aiortc")
    from libp2p.transport.webrtc.transport import WebRTCDirectTransport

    from murmur.gossip import libp2p_fixes  # not at the top: libp2p_fixes imports this module for the fixes' policy

    libp2p_fixes.install_webrtc()

    swarm = transport.host.get_network()
    tm = swarm.transport_manager
    if not any(isinstance(x, WebRTCDirectTransport) for x in tm.get_transports()):
        w = WebRTCDirectTransport(private_key=transport.host.get_private_key())
        tm.add_transport(w)
        if swarm.background_nursery is not None and hasattr(w, "set_background_nursery"):
            w.set_background_nursery(swarm.background_nursery)
        if hasattr(w, "set_swarm"):
            w.set_swarm(swarm)
    errors = []
    for a in listen:
        for cand in dict.fromkeys([a, a.replace(a.split("/")[4], "0", 1) if a.split("/")[4] != "0" else a]):
            try:
                with trio.fail_after(15):
                    if await swarm.listen(multiaddr.Multiaddr(cand)):
                        break
                errors.append(f"{cand}: listener did not start")
            except Exception as e:
                errors.append(f"{cand}: {type(e).__name__}: {e}"[:200])
    got = [x for x in transport.listen_addrs() if is_webrtc_addr(x)]
    if not got:
        raise WebRTCUnavailable("no /webrtc-direct listener: " + "; ".join(errors or ["nothing to listen on"]))
    return got
