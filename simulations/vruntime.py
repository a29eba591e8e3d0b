"""What `node.shell.runtime` and its gossip service do around each simulated node's real `NodeCore`, in virtual
time: build the core and the node's validation pipeline, feed the core the events that reach the node,
and carry out the actions it returns (publish and subscribe through `simulations.vnet`, worker messages
through `simulations.vworker`, the lineage store, catch-up requests, penalties).

The patch transfer is modelled: a receiver whose core accepts a manifest (`NodeCore.offer_manifest`) gets
the bytes one patch-broadcast delay later (its `patch_delay`, measured at start-up by
`simulations.vbroadcast`, scaled by the item's size); patch contents are modelled (the manifest's chunk
hashes are tokens) and storing is a dict per node.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, assert_never

from murmur.gossip import wire
from murmur.gossip.intake import Dropped
from murmur.gossip.scoring import ScoreParams
from murmur.gossip.validation import Pending, Pipeline, PipelineConfig, ScheduleView
from murmur.node.core.machine import (
    Accept,
    Action,
    AnnounceHeard,
    CatalogFailed,
    CatalogReceived,
    CoreSettings,
    Decline,
    DropItem,
    Event,
    FetchCatalog,
    FromWorker,
    LineageKnown,
    LoadStored,
    Log,
    ManifestHeard,
    NodeCore,
    OfferFailed,
    PatchStored,
    PeerGone,
    Penalise,
    Publish,
    RecordRollouts,
    RequestOffer,
    ResendTaskSets,
    RestartWorker,
    RolloutsPublished,
    RolloutsVerified,
    SeedVersion,
    SeePeer,
    StoredItems,
    StorePatch,
    Subscribe,
    SwarmHeard,
    Tick,
    Topic,
    ToWorker,
    TransferDone,
)
from murmur.simulations.scenario import Scenario
from murmur.simulations.vcache import SharedVerification, SimPipeline
from murmur.simulations.vevents import (
    EPOCH,
    AnnounceArrives,
    BatchArrives,
    CatalogAsked,
    EventQueue,
    ManifestArrives,
    OfferAsked,
    PatchArrives,
    PeerLeft,
    Reply,
    Wake,
    WorkerSends,
)
from murmur.simulations.vnet import Network
from murmur.simulations.vnode import BASE_MODEL, LINEAGE_NAME, TOKENS_PER_ROLLOUT, VNode, stored_items
from murmur.simulations.vreport import Recorder
from murmur.simulations.vworker import WORKER_S, Workers
from murmur.sync.ids import Relation
from murmur.sync.items import MAX_ITEMS, StoredItem, item_of
from murmur.training.tasks import Task

TICK = Tick()


class CoreDriver:
    """Drives every honest node's core: the events it is fed and the actions it returns."""

    def __init__(
        self,
        sc: Scenario,
        nodes: list[VNode],
        queue: EventQueue,
        net: Network,
        workers: Workers,
        recorder: Recorder,
        shared: SharedVerification | None,
        resolve: Callable[[wire.TaskRef], Task],
        reward: Callable[[Task, str], float],
        schedule: ScheduleView | None = None,
    ) -> None:
        self.sc = sc
        self.nodes = nodes
        self.queue = queue
        self.net = net
        self.workers = workers
        self.recorder = recorder
        self.shared = shared
        self.resolve = resolve
        self.reward = reward
        self.schedule = schedule  # the shared prompt schedule every node's pipeline checks claims against
        self.by_peer = {n.peer_id: n for n in nodes}
        self.publisher = {n.lineage: n for n in nodes}  # lineage -> the node that publishes it
        self.score_params = ScoreParams(
            graylist_threshold=sc.gossip.graylist_threshold, blacklist_s=sc.gossip.blacklist_s
        )

    # ------------------------------------------------------------ building a node's network process

    def pipeline(self, n: VNode) -> Pipeline:
        """The node's gossip service's validation pipeline (its scores outlive its cores, as a node's do)."""
        sc = self.sc
        cfg = PipelineConfig(
            swarm=sc.swarm,
            max_staleness=sc.training.max_staleness,
            rate_per_s=sc.gossip.rate_limit_per_s,
            burst=sc.gossip.rate_burst,
            replay_entries=50_000,
            replay_ttl_s=900.0,
            score=self.score_params,
        )

        def head(lineage: bytes) -> int | None:  # no core yet: no head known (replaced by the core's on join)
            return None

        if self.shared is not None:
            return SimPipeline(
                cfg,
                clock=self.queue.unix,
                resolve_task=self.resolve,
                reward=self.reward,
                head_version=head,
                shared=self.shared,
                schedule=self.schedule,
            )
        return Pipeline(
            cfg,
            clock=self.queue.unix,
            resolve_task=self.resolve,
            reward=self.reward,
            head_version=head,
            schedule=self.schedule,
        )

    def new_core(self, n: VNode) -> NodeCore:
        """A (re)started node's network process: a fresh core (`n.core`), as `node.shell.runtime` builds it."""
        s, tr = n.spec, self.sc.training
        follow = (self.nodes[s.follow].lineage,) if s.role == "follower" and s.follow is not None else ()
        auto = s.role == "auto"
        if auto:  # a (re)started node with no configured roles starts as its hardware says: a trainer
            n.role = "trainer"
        settings = CoreSettings(
            swarm=self.sc.swarm,
            roles=(n.role,),
            choose_mode=auto,
            max_staleness=tr.max_staleness,
            publish_every=self.sc.sync.publish_every,
            external_rollouts=tr.external_groups,
            group_size=tr.group_size,
            max_new_tokens=TOKENS_PER_ROLLOUT,
            upload_bytes_per_s=s.upload_bytes_per_s,
            follow=follow,
        )
        core = n.core = NodeCore(settings, n.ident, self.queue.unix())
        if n.held_lineage is not None and n.held_lineage != n.lineage:  # what its store holds, as the runtime loads it
            lead = self.publisher[n.held_lineage]
            self.feed(
                n, LineageKnown(n.held_lineage, LINEAGE_NAME, Relation.FOLLOW, lead.ident.public, BASE_MODEL, n.held)
            )
        return core

    # ------------------------------------------------------------ the cores' actions, carried out in virtual time

    def feed(self, n: VNode, ev: Event) -> None:
        """As `node.shell.runtime`'s core loop: the event at the virtual now, its actions carried out in order, then
        each action's follow-up event, before anything else reaches the node."""
        pending = deque((ev,))
        while pending and n.core is not None:
            for a in n.core.handle(pending.popleft(), self.queue.unix(), self.queue.unix_ms()):
                follow_up = self.do(n, a)
                if follow_up is not None:
                    pending.append(follow_up)

    def do(self, n: VNode, a: Action) -> Event | None:
        """Carry out one action in virtual time; its follow-up event, if any (as `Node._carry_out`)."""
        counts = self.recorder.counts
        if isinstance(a, Publish):
            if a.topic == Topic.ANNOUNCE:
                counts["announces"] += 1
                self.net.announced(n, a.data)
                self.net.send(n, n.ctrl, AnnounceArrives, a.data)
            elif self.net.publish(n, a.data, a.shard):  # as the runtime: counted once it went out
                return RolloutsPublished(a.count)
        elif isinstance(a, Subscribe):
            self.net.subscribe(n, a.shards, a.subscribe)
        elif isinstance(a, ToWorker):
            self.workers.receive(n, a.msg)
        elif isinstance(a, Log):
            self.recorder.core_logs[a.msg] += 1
        elif isinstance(a, RecordRollouts):
            counts["rollouts_recorded"] += len(a.entries)
        elif isinstance(a, SeedVersion):
            counts["versions_seeded"] += 1
            self.net.send(n, n.ctrl, ManifestArrives, a.envelope)
            got = self.net.open(a.envelope, wire.PATCH_MANIFEST)
            if got is not None:  # the swarm-wide head view every node's announce topic gives it (vworker.py)
                m = got[1]
                lid = bytes(m.lineage)
                self.workers.published_heads[lid] = max(self.workers.published_heads.get(lid, 0), m.target_version)
        elif isinstance(a, StorePatch):
            return self._store_patch(n, a.pid)
        elif isinstance(a, DropItem):
            items = n.store.get(a.lineage, {})
            for key in [k for k in items if k[1] == a.base and k[2] == a.target]:
                del items[key]
        elif isinstance(a, LoadStored):
            return StoredItems(a.lineage, self._items(n, a.lineage))
        elif isinstance(a, FetchCatalog):
            counts["catalog_requests"] += 1
            dst = self.by_peer.get(a.peer)
            if dst is not None:
                self.queue.push(
                    self.queue.now + self.net.latency(n.spec.index, dst.spec.index),
                    CatalogAsked(dst.spec.index, n.spec.index, a.lineage, n.inc),
                )
        elif isinstance(a, RequestOffer):
            counts["offers_requested"] += 1
            dst = self.by_peer.get(a.peer)
            if dst is not None:
                self.queue.push(
                    self.queue.now + self.net.latency(n.spec.index, dst.spec.index),
                    OfferAsked(
                        dst.spec.index, n.spec.index, a.lineage, (a.item.kind, a.item.base, a.item.target), n.inc
                    ),
                )
        elif isinstance(a, Penalise):
            n.pipeline.scores.penalise(a.peer, a.reason[:120], a.amount, self.queue.unix())
        elif isinstance(a, (SeePeer, ResendTaskSets)):
            pass  # a peer persisted for discovery, our task sets sent again: the simulated swarm has one task set
        elif isinstance(a, RestartWorker):
            # a change of roles (an auto node's core chose to train or to generate); the core asks for any other
            # restart only after a WorkerExited, which nothing here feeds: modelled workers never exit
            if not a.roles:
                raise AssertionError("a restart of a simulated worker, which never exits")
            self.workers.restart(n, a.roles)
        elif isinstance(a, (Accept, Decline)):
            pass  # answers to ManifestOffered, which the broadcast asks through `offer_manifest` (`on_manifest`)
        else:
            assert_never(a)
        return None

    def _items(self, n: VNode, lineage: bytes) -> tuple[StoredItem, ...]:
        return tuple(stored_items(n.store.get(lineage, {}), self.sc.sync.patch_bytes)[-MAX_ITEMS:])

    def _store_patch(self, n: VNode, pid: bytes) -> PatchStored | None:
        """The runtime's store step: a completed transfer is written to the lineage store; what to report."""
        got = n.transfers.pop(pid, None)
        if got is None:
            return None
        env, m, seconds = got
        it = item_of(m)
        n.store.setdefault(bytes(m.lineage), {})[(it.kind, it.base, it.target)] = env
        self.recorder.counts["patches_stored"] += 1
        return PatchStored(m, m.total_bytes, seconds)

    # ------------------------------------------------------------ events that reach a node's network process

    def on_wake(self, ev: Wake) -> None:
        n = self.nodes[ev.node]
        if not n.alive or n.inc != ev.inc or n.core is None:
            return
        # what the live announce topic tells every node, which the one-hop announces here do not: how many
        # producers there are, what each supplies
        self.feed(n, SwarmHeard(self.net.alive_producers - 1, self.net.supply))
        self.feed(n, TICK)
        due = n.core.next_deadline() - EPOCH
        self.queue.push(max(due, self.queue.now + WORKER_S), Wake(ev.node, ev.inc))

    def on_worker(self, ev: WorkerSends) -> None:
        n = self.nodes[ev.node]
        if n.alive and n.inc == ev.inc:
            self.feed(n, FromWorker(ev.msg))

    def on_peer_left(self, ev: PeerLeft) -> None:
        n = self.nodes[ev.node]
        if n.alive and n.inc == ev.inc:
            self.feed(n, PeerGone(ev.peer))

    def on_reply(self, ev: Reply) -> None:
        n = self.nodes[ev.node]
        if n.alive and n.inc == ev.inc:
            self.feed(n, ev.event)

    def _heard(self, ev: AnnounceArrives | ManifestArrives, kind: str) -> tuple[VNode, wire.Envelope, Any] | None:
        """The node a gossip message reaches, with its checked envelope and body; None for a node gone since
        (or restarted) or a message its envelope check refuses."""
        d = self.nodes[ev.node]
        if not d.alive or d.inc != ev.inc or d.core is None:
            return None
        got = self.net.open(ev.data, kind)
        return None if got is None else (d, *got)

    def on_announce(self, ev: AnnounceArrives) -> None:
        heard = self._heard(ev, wire.NODE_ANNOUNCE)
        if heard is None:
            return
        d, env, body = heard
        signer = bytes(env.signer)
        d.intake.heard_announce(signer, body)
        self.feed(d, AnnounceHeard(signer, body, ev.data))

    def on_manifest(self, ev: ManifestArrives) -> None:
        """A manifest reaches a node: its core hears it, and its broadcast asks the core whether to fetch it."""
        heard = self._heard(ev, wire.PATCH_MANIFEST)
        if heard is None:
            return
        d, _, m = heard
        self.feed(d, ManifestHeard(m))
        if d.core is not None and d.core.offer_manifest(m, self.queue.unix()):
            pid = wire.content_id(ev.data)
            if pid in d.transfers:
                return
            seconds = d.patch_delay * m.total_bytes / self.sc.sync.patch_bytes  # the modelled broadcast
            d.transfers[pid] = (ev.data, m, seconds)
            self.recorder.counts["transfers"] += 1
            self.queue.push(self.queue.now + seconds, PatchArrives(ev.node, pid, ev.inc))

    def on_patch(self, ev: PatchArrives) -> None:
        n = self.nodes[ev.node]
        if not n.alive or n.inc != ev.inc or ev.pid not in n.transfers:
            return
        self.feed(n, TransferDone(ev.pid, n.transfers[ev.pid][1]))
        n.transfers.pop(ev.pid, None)  # stored (StorePatch) or already held

    def on_catalog(self, ev: CatalogAsked) -> None:
        """A catch-up catalog request reaches a peer: the reply lists what its lineage store holds."""
        p = self.nodes[ev.node]
        back = self.queue.now + self.net.latency(ev.node, ev.asker)
        reply: CatalogReceived | CatalogFailed
        if p.alive and ev.lineage in p.store:
            reply = CatalogReceived(p.peer_id, ev.lineage, self._items(p, ev.lineage))
        else:
            reply = CatalogFailed(p.peer_id, ev.lineage, "unreachable or not held")
        self.queue.push(back, Reply(ev.asker, reply, ev.asker_inc))

    def on_offer(self, ev: OfferAsked) -> None:
        """A peer asked to seed an item into the broadcast: the asker hears its manifest one latency later."""
        p = self.nodes[ev.node]
        env = p.store.get(ev.lineage, {}).get(ev.item) if p.alive else None
        back = self.queue.now + self.net.latency(ev.node, ev.asker)
        if env is not None:
            self.queue.push(back, ManifestArrives(ev.asker, ev.node, env, ev.asker_inc))
        else:  # as the runtime's failed offer request: the asker's core moves to its next source
            self.queue.push(
                back, Reply(ev.asker, OfferFailed(p.peer_id, ev.lineage, "unreachable or not held"), ev.asker_inc)
            )

    def on_batch(self, ev: BatchArrives) -> None:
        """A copy of a batch reaches a subscriber of its shard: its gossip service's intake
        (`gossip.intake.BatchIntake`, as `GossipService._validate_rollouts` runs it), then GossipSub passes on
        what was accepted; the core hears what the producer delivered, and a trainer's worker gets the groups
        its core routes to it."""
        dst = ev.node
        d = self.nodes[dst]
        if not d.alive or d.inc != ev.inc or ev.shard not in d.shards:
            return
        if not self.net.first_copy(d, ev.data):
            return
        s = self.nodes[ev.origin]
        step = d.intake.admit(ev.shard, self.nodes[ev.fwd].peer_id, s.peer_id, ev.data)
        if isinstance(step, Pending):
            d.pipeline.verify(step)
            step = d.intake.commit(step, 0.0)  # verification costs no virtual time: no CPU to charge
        if isinstance(step, Dropped):
            self.recorder.rejections[step.reason] += 1
            return
        if not step.accepted:
            self.recorder.rejections[step.reason.value] += 1
            self.recorder.row("rejection", t=self.queue.now, node=dst, peer=ev.origin, reason=step.reason.value)
            if step.newly_banned:
                self.recorder.row("event", t=self.queue.now, node=dst, action=f"ban {ev.origin}")
            return
        assert step.batch is not None  # an accepted verdict carries its batch
        self.net.pass_on(d, ev.fwd, ev.origin, ev.data, ev.shard)
        if s.spec.role == "adversary":
            s.adv_accepted += 1
        self.feed(d, RolloutsVerified.of(step.batch))  # what the producer delivered, as the runtime feeds it
        self.workers.intake(d, step)
