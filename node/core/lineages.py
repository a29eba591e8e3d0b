"""The lineage table and its identity rules (sans-IO, part of `node.core.machine`).

A lineage id is `sync.ids.lineage_id(publisher key, base-model hash, name)`.
A row's publisher is recorded only when a message *proves* it: a manifest
(whose publisher field the wire layer already matched to the envelope signer)
or an announce demand signed by a key from which the id derives, given a
base-model hash this node knows. So being first to announce a lineage earns
nothing ("capture" is impossible), and only the publisher's signature moves a
head. Everything else a peer says about a lineage is refused and logged.

Numbers from the network are range-checked here before any rule uses them:
a demand's step time is 0 (not measured yet) or at least `MIN_STEP_S`; a head may jump at most `MAX_AHEAD`
versions past the signed head this node last heard; a manifest may list at
most `SIZE_FACTOR` times the base model's bytes. The demand a follower acts
on is bounded by what the publisher demonstrably does: its step time counts
as no shorter than the interval between the signed versions this node saw,
nor than the time since the last one.

A refusal names its reason and whether the claim is provably false (then it
costs the signer a penalty): a manifest whose id does not derive from its own
fields, a demand for a lineage whose publisher is proven by another key,
numbers out of range, a version far past the signed head. A claim this node
merely cannot check (a lineage on a base model it has not seen) costs nothing.

A row (`LineageState`) and the table's choice (`serving`, `committed`) are changed only here: the core
calls the table's methods named for what happened (`version_applied`, `published`, `serve`, `commit`, ...),
which hold the rule, and only reads the rows (`tests/test_lineages_home.py`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from murmur.gossip import wire
from murmur.node.core import roles
from murmur.sync.ids import Relation, lineage_id
from murmur.sync.items import CODEC_KIND
from murmur.sync.staleness import Admission

MIN_STEP_S = 0.001  # a claimed version interval below this is not a measurement (and would overflow the rule)
MAX_AHEAD = 1024  # versions a signed head may move past the last signed head heard in this run
SIZE_FACTOR = 3.0  # a patch, union or anchor lists at most this many times the base model's bytes
SIZE_SLACK = 1 << 20
DEMAND_FRESH_S = 30.0  # a demand not re-announced this long is not acted on
AVOID_S = 600.0  # a publisher whose versions this node could not fetch is not followed again this long
MAX_AVOIDED = 64  # publishers remembered so (the soonest to expire is forgotten first)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a signed claim about a lineage was not acted on; `fault`: the claim is provably false, so it
    costs its signer (a claim this node merely cannot check, e.g. on an unknown base model, does not);
    `forged`: the signer claims a lineage that provably belongs to another key (impersonation, which
    no honest node of any version does), so it costs as much as a bad signature."""

    reason: str
    fault: bool = False
    forged: bool = False

    @classmethod
    def provable(cls, reason: str) -> Refusal | None:
        return cls(reason, True) if reason else None


@dataclass(slots=True)
class LineageState:
    lineage: bytes
    name: str
    relation: Relation
    publisher: bytes = b""  # proven by derivation; b"" until then
    base: bytes = b""
    head: int = 0  # publisher-signed head (or what we hold, if more)
    held: int = 0
    signed_head: int = 0
    live: bool = False  # signed_head was heard from the network in this run
    need_anchor: bool = False
    activation: roles.Activation | None = None
    admission: Admission | None = None  # staleness state of a served lineage (None: never served)
    admission_note: str = ""  # the last StalenessEvent message
    claimed: roles.Demand | None = None  # the publisher's last demand, range-checked
    standby: tuple[str, ...] = ()
    supply: float = 0.0  # rollouts/s its publisher counts from its followers (its signed demand)
    demand_at: float = -math.inf
    active: float = 0.0  # last time a signed message about it arrived
    since: float = 0.0  # when this node first heard of it
    advances: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=8))
    worker_head: int = -1  # the head last told to a trainer's worker (its sampler's staleness rule)
    manifests: int = 0  # signed manifests of it accepted in this run: it publishes, not only announces
    delivered: bool = False  # this node applied a version of it fetched from the network (now or in a former run)


class LineageTable:
    def __init__(self, max_rows: int) -> None:
        self.max_rows = max(4, max_rows)
        self.rows: dict[bytes, LineageState] = {}
        self.own: bytes | None = None
        self.serving: bytes | None = None
        self.committed: bytes | None = None
        self.my_base = b""
        self.model_bytes: dict[bytes, int] = {}  # base-model hash -> bytes of its published state
        self.refused: dict[str, int] = {}
        self.evicted = 0
        self.avoided: dict[bytes, tuple[float, str]] = {}  # publisher -> (until, why this node left it)

    # ------------------------------------------------------------ local facts
    def set_my_base(self, base: bytes, model_bytes: int) -> None:
        self.my_base = base
        if model_bytes > 0:
            self.model_bytes[base] = model_bytes

    def set_own(self, lid: bytes, name: str, public: bytes, base: bytes, version: int, now: float) -> LineageState:
        lin = self.rows.get(lid) or self._insert_kept(lid, name, Relation.OWN, now)
        lin.relation, lin.publisher, lin.base, lin.name = Relation.OWN, public, base, name
        lin.held = lin.head = lin.signed_head = max(lin.head, version)
        self.own = lid
        return lin

    def load(
        self, lid: bytes, name: str, relation: Relation, publisher: bytes, base: bytes, held: int, now: float
    ) -> None:
        """A lineage from the node's store (verified when it was stored)."""
        if len(publisher) == 32 and len(base) == 32 and lineage_id(publisher, base, name) == lid:
            lin = self._insert_kept(lid, name, relation, now)
            lin.publisher, lin.base = publisher, base
            lin.head = lin.held = lin.signed_head = held
            lin.delivered = relation == Relation.FOLLOW and held > 0
            if relation == Relation.OWN:
                self.own = lid

    # ------------------------------------------------------------ what this node does with a lineage
    def serve(self, lid: bytes | None) -> LineageState | None:
        """The follower chose `lid` (None: none): served, and followed from now on (its row, if any)."""
        self.serving = lid
        lin = self.rows.get(lid) if lid is not None else None
        if lin is not None:
            lin.relation = Relation.FOLLOW
        return lin

    def commit(self, lid: bytes | None) -> None:
        """The worker follows `lid` (the served lineage, once it delivered; None: it stands by)."""
        self.committed = lid

    def drop_choice(self) -> None:
        """The node's roles changed: its new worker follows nothing and serves nothing yet."""
        self.serving = self.committed = None

    def published(self, version: int) -> LineageState | None:
        """Our worker published `version` of our own lineage: what we hold is its head (the worker is the
        authority over our own lineage)."""
        lin = self.rows.get(self.own) if self.own is not None else None
        if lin is not None:
            lin.head = lin.held = lin.signed_head = version
        return lin

    def version_applied(self, lid: bytes, version: int, need_anchor: bool) -> tuple[LineageState | None, int]:
        """Our worker now holds `version` of `lid` (a patch applied or an anchor loaded; `need_anchor`: it
        needs an anchor before any patch applies): the row, and the versions it moved forward (0 if none).
        A lineage of which this node applied a version is followed, and has delivered."""
        lin = self.rows.get(lid)
        if lin is None:
            return None, 0
        gained = max(0, version - lin.held)
        if gained:
            lin.delivered = True
        lin.held = version
        lin.need_anchor = need_anchor
        lin.head = max(lin.head, lin.held)
        if lin.relation == Relation.SEEN:
            lin.relation = Relation.FOLLOW
        return lin, gained

    def admission_changed(self, lin: LineageState, state: Admission, note: str) -> None:
        """The staleness guard moved the served lineage's admission (`note`: its message, as logged)."""
        lin.admission, lin.admission_note = state, note

    def activated(self, lin: LineageState, activation: roles.Activation) -> None:
        """Our own lineage's capacity rule ran: the followers it counts and stands by."""
        lin.activation = activation

    def head_to_tell(self, lin: LineageState) -> int | None:
        """The head to tell a trainer's worker about `lin`, counted as told (None: nothing new to tell). A
        lineage publishes once its publisher is proven and a signed manifest of it was accepted (or a version
        of it applied): announcing one is not enough."""
        publishes = lin.manifests > 0 or lin.delivered
        if lin.publisher and publishes and lin.head > lin.worker_head:
            lin.worker_head = lin.head
            return lin.head
        return None

    def worker_restarted(self) -> None:
        """A new worker's sampler starts with no heads: every head is told again."""
        for lin in self.rows.values():
            lin.worker_head = -1

    # ------------------------------------------------------------ network
    def on_demand(self, signer: bytes, d: wire.LineageDemand, now: float) -> tuple[LineageState | None, Refusal | None]:
        """A LineageDemand in a NodeAnnounce signed by `signer`: (the row it moved, why it was refused)."""
        lid = bytes(d.lineage)
        lin = self.rows.get(lid)
        why = Refusal.provable(demand_error(d))
        if why is None and lid == self.own:
            why = Refusal("signer is not the lineage's publisher (this node is)", True, True)
        elif why is None and lin is not None and lin.publisher:
            # the row's publisher and base are proven: anything else from another key is provably false
            if signer != lin.publisher:
                why = Refusal("signer is not the lineage's publisher", True, True)
            elif lineage_id(signer, lin.base, d.name) != lid:
                why = Refusal("lineage name does not derive the lineage id", True)
        elif why is None and not (self.my_base and lineage_id(signer, self.my_base, d.name) == lid):
            # not provably false: the lineage may grow from a base model this node has not seen
            why = Refusal("lineage id does not derive from the signer's key, a known base model and the name")
        if why is None and lin is None:
            lin = self._insert(lid, d.name, Relation.SEEN, now)
            if lin is None:
                why = Refusal("lineage table full")
        if why is not None:
            return None, self._count(why)
        assert lin is not None
        if not lin.publisher:
            lin.publisher, lin.base = signer, self.my_base
        why = self._advance(lin, d.head_version, now)
        lin.claimed = roles.Demand(d.rollouts_per_step, d.step_time_s, d.max_staleness)
        lin.standby = tuple(d.standby)
        lin.supply = float(d.supply_rollouts_per_s)
        lin.demand_at = lin.active = now
        return lin, self._count(why)

    def check_manifest(self, m: wire.PatchManifest) -> Refusal | None:
        """Why a manifest (signature checked, publisher == signer) must not be acted on; None when it may."""
        lid = bytes(m.lineage)
        if lineage_id(bytes(m.publisher), bytes(m.base_model_hash), m.lineage_name) != lid:
            return Refusal("lineage id does not derive from the publisher, base model and name", True, True)
        if lid == self.own:
            return Refusal("names this node's own lineage", True, True)
        if m.codec not in CODEC_KIND:
            return Refusal(f"unknown codec {m.codec[:32]!r}", True)
        if m.base_version > m.target_version or (m.codec == "anchor-v1") != (m.base_version == m.target_version):
            return Refusal("versions do not fit the codec", True)
        # defence in depth: gossip/wire.py refuses such a manifest where it is decoded (authoritative); the size
        # bound below reads total_bytes, which bounds the download only when the chunks add up to it
        if sum(c.size for c in m.chunks) != m.total_bytes:
            return Refusal("chunk sizes do not add up to the total", True)
        known = self.model_bytes.get(bytes(m.base_model_hash), 0)
        size = known or self.model_bytes.get(self.my_base, 0)
        if size and m.total_bytes > SIZE_FACTOR * size + SIZE_SLACK:
            # provable only against the manifest's own base model, whose size this node knows
            return Refusal(f"{m.total_bytes} bytes is out of proportion to a {size}-byte base model", bool(known))
        lin = self.rows.get(lid)
        if lin is not None and lin.live and m.target_version > lin.signed_head + MAX_AHEAD:
            return Refusal(f"version {m.target_version} is far ahead of the signed head {lin.signed_head}", True)
        return None

    def on_manifest(self, m: wire.PatchManifest, now: float) -> tuple[LineageState | None, Refusal | None]:
        lid = bytes(m.lineage)
        if lid == self.own:
            return None, None  # our own manifests, relayed back to us: our worker is the authority
        why = self.check_manifest(m)
        lin = self.rows.get(lid)
        if why is None and lin is None:
            lin = self._insert(lid, m.lineage_name, Relation.SEEN, now)
            if lin is None:
                why = Refusal("lineage table full")
        if why is not None:
            return None, self._count(why)
        assert lin is not None
        lin.publisher, lin.base = bytes(m.publisher), bytes(m.base_model_hash)
        lin.active = now
        why = self._advance(lin, m.target_version, now)
        if why is None:
            lin.manifests += 1
        return lin, self._count(why)

    def _count(self, why: Refusal | None) -> Refusal | None:
        if why is not None:
            key = why.reason.split(" (")[0][:80]
            if key in self.refused or len(self.refused) < 64:
                self.refused[key] = self.refused.get(key, 0) + 1
        return why

    def _advance(self, lin: LineageState, version: int, now: float) -> Refusal | None:
        if lin.live and version > lin.signed_head + MAX_AHEAD:
            return Refusal(f"version {version} is far ahead of the signed head {lin.signed_head}", True)
        if version > lin.signed_head or not lin.live:
            if version > lin.signed_head:
                lin.advances.append((now, version))
            lin.signed_head = max(lin.signed_head, version)
            lin.live = True
        lin.head = max(lin.head, lin.signed_head)
        return None

    # ------------------------------------------------------------ what a follower may serve
    def effective_demand(self, lin: LineageState, now: float) -> roles.Demand | None:
        """The publisher's claimed demand, with its step time no shorter than what this node observed."""
        d = lin.claimed
        if d is None or now - lin.demand_at > DEMAND_FRESH_S:
            return None
        if d.step_time_s <= 0:
            return d
        step = d.step_time_s
        if len(lin.advances) >= 2:
            (t0, v0), (t1, v1) = lin.advances[0], lin.advances[-1]
            step = max(step, (t1 - t0) / max(1, v1 - v0))
        step = max(step, now - (lin.advances[-1][0] if lin.advances else lin.since))
        return roles.Demand(d.rollouts_per_step, min(step, 1e6), d.max_staleness)

    def followable(self, now: float, configured: tuple[bytes, ...] = ()) -> list[tuple[LineageState, roles.Demand]]:
        """Lineages a follower may serve, with the demand it may believe.

        A lineage whose publisher has published signed manifests in this run
        is *published*; while any is, lineages known from announces alone are
        not offered: a head moved by announces proves no training, so a fresh
        announce with a rising head and a large claimed demand cannot pull
        followers away from a lineage that publishes patches. A publisher this
        node left because it could not fetch its versions (`avoid`) is not
        offered until that memory expires. Configured lineages are offered
        whether published, avoided or not.
        """
        out, published = [], []
        for lin in self.rows.values():
            if lin.relation == Relation.OWN or not lin.publisher or not lin.base:
                continue
            if configured and lin.lineage not in configured:
                continue
            if not configured and self.is_avoided(lin.publisher, now):
                continue
            d = self.effective_demand(lin, now)
            if d is not None:
                out.append((lin, d))
                if lin.manifests:
                    published.append((lin, d))
        return out if configured else (published or out)

    def avoid(self, publisher: bytes, reason: str, now: float) -> None:
        """Remember (bounded) that this node could not fetch `publisher`'s versions."""
        self.avoided[publisher] = (now + AVOID_S, reason[:200])
        for p in [p for p, (until, _) in self.avoided.items() if until <= now]:
            del self.avoided[p]
        while len(self.avoided) > MAX_AVOIDED:
            del self.avoided[min(self.avoided, key=lambda p: self.avoided[p][0])]

    def is_avoided(self, publisher: bytes, now: float) -> bool:
        row = self.avoided.get(publisher)
        return row is not None and row[0] > now

    # ------------------------------------------------------------ the memory budget
    def _insert(self, lid: bytes, name: str, relation: Relation, now: float) -> LineageState | None:
        """A row for a lineage heard from the network: None when the table is full of rows it may not evict."""
        if not self._make_room():
            return None
        return self._new_row(lid, name, relation, now)

    def _insert_kept(self, lid: bytes, name: str, relation: Relation, now: float) -> LineageState:
        """A row for the node's own or a stored lineage: kept even when no row could be evicted for it (the
        table then grows past max_rows by rows the node itself holds, never by rows heard from the network)."""
        self._make_room()
        return self._new_row(lid, name, relation, now)

    def _make_room(self) -> bool:
        """Whether a new row fits, evicting the least active seen row (not own, served or committed) when full."""
        if len(self.rows) >= self.max_rows:
            keep = {self.own, self.serving, self.committed}
            victims = [r for r in self.rows.values() if r.relation == Relation.SEEN and r.lineage not in keep]
            if not victims:
                return False
            del self.rows[min(victims, key=lambda r: r.active).lineage]
            self.evicted += 1
        return True

    def _new_row(self, lid: bytes, name: str, relation: Relation, now: float) -> LineageState:
        lin = self.rows[lid] = LineageState(lid, name, relation, active=now, since=now)
        return lin


def demand_error(d: wire.LineageDemand) -> str:
    """Why a LineageDemand's numbers are out of range ("" when they are in range).

    The wire bounds every field (`gossip.wire.LineageDemand`); what it lets through that the capacity
    rule cannot use is a step time so small that versions-per-latency overflows.
    """
    t = d.step_time_s
    if not math.isfinite(t) or (t != 0.0 and not MIN_STEP_S <= t <= 1e6):
        return f"step_time_s {t!r} out of range (0 or {MIN_STEP_S}..1e6)"
    return ""
