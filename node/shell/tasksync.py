"""Task sets over gossip in the live node: the registry it verifies rollouts against, sets that arrive
from trusted coordinators, and the node's own sets (`murmur tasks publish`) sent to its peers."""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Any

import trio

from murmur.gossip import wire
from murmur.gossip.errors import MurmurError
from murmur.node.logs import event

log = logging.getLogger("murmur.node")

CHECK_CPU_S = 2.0  # verifier CPU seconds per generator to check a received task set (the per-batch limit)


class TaskSetGossip:
    def __init__(self, store: Any, own_public: bytes, coordinators: list[str], drops: Any, *, swarm: str) -> None:
        from murmur.training.tasksets import TaskRegistry

        self.store, self.own, self.drops = store, own_public, drops
        self.trusted = {bytes.fromhex(k) for k in coordinators} | {own_public}  # configured, and ourselves
        self.swarm = swarm
        self.registry = TaskRegistry(swarm)
        self.registry.add_builtin()
        self.sent: set[bytes] = set()
        self.pool: Any | None = None  # a training.verifiers.VerifierPool: where received sets are checked
        for ts in store.task_sets():
            with contextlib.suppress(MurmurError):
                self.registry.add(ts["envelope"], self.trusted)

    async def on_task_set(self, origin: str, m: wire.TaskSetManifest, data: bytes) -> None:
        """A signed task set from a coordinator this node trusts joins the registry and the store.

        Checking it generates tasks from its configuration (reasoning-gym's included), so the check runs
        in a verifier worker (`pool`, set by the node) under the verifiers' memory budget and a CPU limit
        of `CHECK_CPU_S` per generator, never on the event loop; without a pool it runs in a thread."""
        from murmur.training.tasksets import check_manifest

        tid = wire.content_id(wire.decode_envelope(data, swarm=self.swarm).body)
        if tid in self.registry:
            return
        try:
            tid, checked = self.registry.trusted_manifest(data, self.trusted)  # cheap: before any generation
            if self.pool is not None:
                limit = CHECK_CPU_S * (1 + len(checked.generators))
                await trio.to_thread.run_sync(
                    partial(self.pool.call, check_manifest, checked, f"task set {checked.name!r}", cpu_s=limit)
                )
            else:
                await trio.to_thread.run_sync(check_manifest, checked, f"task set {checked.name!r}")
            self.registry.add(data, self.trusted, check=False)
        except MurmurError as e:
            self.drops.add("task_set_refused")
            log.debug("task set from %s not accepted: %s", origin, e)
            return
        await trio.to_thread.run_sync(self.store.add_task_set, tid, m.name, m.version, bytes(m.coordinator), data)
        event(log, "task set added", name=m.name, version=m.version, id=tid.hex()[:16])

    async def announce_own(self, service: Any) -> None:
        """Our own task sets go out on the announce topic once when they appear; `sent.clear()` (a new
        peer showed up) sends them again, so late joiners get them too."""
        from murmur.gossip.transport import PublishError

        for ts in await trio.to_thread.run_sync(self.store.task_sets):
            tid = bytes(ts["task_set_id"])
            if bytes(ts["coordinator"]) != self.own or tid in self.sent:
                continue
            if tid not in self.registry:
                try:
                    self.registry.add(ts["envelope"], self.trusted)
                except MurmurError as e:
                    log.warning("own task set %s unusable: %s", tid.hex()[:16], e)
                    continue
            try:
                await service.publish_announce(bytes(ts["envelope"]))
            except PublishError:
                self.drops.add("task_set_unpublished")
                return  # no peers yet: try again next round
            self.sent.add(tid)
            event(log, "task set announced", name=ts["name"], version=ts["version"], id=tid.hex()[:16])
