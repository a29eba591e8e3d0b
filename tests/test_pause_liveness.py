"""A link that survives a pause: a peer whose outbound pubsub stream died, or that was stopped with SIGSTOP
(a laptop lid) and resumed, gets gossip (a trainer's announces and manifests) again within 30 s.

When the publisher's outbound pubsub stream to a peer dies while the connection stays (a write stalled
past yamux's 5 s window wait), py-libp2p opens a new stream but forgot the peer's subscriptions, which the
peer never sends again: "no connected peer subscribes" for the rest of the run (gossip/host.py,
`gossip.libp2p_fixes._fix_pubsub_keep_subscriptions`). The slow test stops a real subprocess peer long enough to fill
the publisher's queue to it and shows delivery resuming after SIGCONT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from murmur.gossip.host import open_transport
from murmur.gossip.identity import Identity
from murmur.gossip.transport import PublishError

TOPIC = "/murmur/pause/announce/1"
RECOVER_S = 30.0
PAUSE_S = 15.0  # long enough to fill the publisher's queue to the peer (60 s behaves the same on loopback)

PEER = r"""
import sys, trio
from murmur.gossip.host import open_transport
from murmur.gossip.identity import Identity

async def main():
    async with open_transport(Identity.from_seed(b"\x52" * 32)) as t:
        chan = await t.subscribe(sys.argv[1])
        print(t.listen_addrs()[0], flush=True)
        while True:
            _, data = await chan.receive()
            if len(data) < 64:
                print(data.decode(), flush=True)

trio.run(main)
"""


async def _delivered(pub: Any, chan: Any, tag: bytes, within: float) -> float:
    """Publish `tag` once a second until `chan` yields it; the seconds that took."""
    t0 = trio.current_time()
    with trio.fail_after(within):
        while True:
            try:
                await pub.publish(TOPIC, tag)
            except PublishError:
                pass
            with trio.move_on_after(1.0):
                while (await chan.receive())[1] != tag:
                    pass
                return trio.current_time() - t0


def test_a_dead_outbound_pubsub_stream_is_replaced_and_the_peer_stays_subscribed() -> None:
    out: dict[str, Any] = {}

    async def main() -> None:
        async with (
            open_transport(Identity.from_seed(b"\x53" * 32)) as pub,
            open_transport(Identity.from_seed(b"\x54" * 32)) as peer,
        ):
            await pub.subscribe(TOPIC)
            chan = await peer.subscribe(TOPIC)
            await pub.connect(peer.listen_addrs()[0])
            await _delivered(pub, chan, b"before", 30)
            dead = next(iter(pub.pubsub.peers.values()))
            await dead.reset()  # our outbound pubsub stream dies; the connection stays
            out["after"] = await _delivered(pub, chan, b"after", RECOVER_S)
            out["replaced"] = next(iter(pub.pubsub.peers.values()), None) is not dead
            out["peers"] = pub.peers()

    trio.run(main)
    assert out["replaced"] and len(out["peers"]) == 1
    assert out["after"] < RECOVER_S


@pytest.mark.slow
def test_a_paused_peer_gets_gossip_again_after_it_resumes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", PEER, TOPIC], stdout=subprocess.PIPE, env=env, text=True)
    out: dict[str, float] = {}
    try:

        async def main() -> None:
            lines = trio.open_memory_channel[str](1000)

            def read_lines() -> None:
                for line in proc.stdout:  # type: ignore[union-attr]
                    trio.from_thread.run(lines[0].send, line.strip())

            async with trio.open_nursery() as n:
                n.start_soon(partial(trio.to_thread.run_sync, read_lines, abandon_on_cancel=True))
                with trio.fail_after(60):
                    addr = await lines[1].receive()
                async with open_transport(Identity.from_seed(b"\x51" * 32)) as pub:
                    await pub.subscribe(TOPIC)
                    await pub.connect(addr)

                    async def delivered(tag: str, within: float) -> float:
                        """Publish `tag` until the peer prints it; seconds it took."""
                        t0 = trio.current_time()
                        with trio.fail_after(within):
                            while True:
                                try:
                                    await pub.publish(TOPIC, tag.encode())
                                except PublishError:
                                    pass
                                with trio.move_on_after(1.0):
                                    while True:
                                        if await lines[1].receive() == tag:
                                            return trio.current_time() - t0

                    out["before"] = await delivered("before", 30)
                    os.kill(proc.pid, signal.SIGSTOP)
                    big = b"x" * (400 * 1024)
                    t0 = trio.current_time()

                    # the stopped peer's windows and socket buffers fill, then our writes to it stall
                    while trio.current_time() - t0 < PAUSE_S:
                        try:
                            await pub.publish(TOPIC, big)
                        except PublishError:
                            pass  # its queue is full: counted by the node as an unpublished announce
                        await trio.sleep(0.1)
                    out["peers_while_stopped"] = len(pub.peers())
                    os.kill(proc.pid, signal.SIGCONT)
                    out["after"] = await delivered("after", RECOVER_S)
                n.cancel_scope.cancel()

        trio.run(main)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
    assert out["peers_while_stopped"] == 1  # the connection itself stayed up: only pubsub broke
    assert out["after"] < RECOVER_S
