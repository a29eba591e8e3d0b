"""The node's lineage table (node/core/lineages.py), sans-IO: which signed claims move a row, which are refused,
and what a follower may believe of a publisher's demand. (sync/versions.py's publisher and follower are
tests/test_lineage.py's.)"""

from __future__ import annotations

import pytest

from murmur.gossip import wire
from murmur.gossip.errors import DecodeError
from murmur.node.core.lineages import DEMAND_FRESH_S, SIZE_FACTOR, LineageTable, Refusal
from murmur.sync.ids import Relation, lineage_id
from tests.test_core import BASE, demand, key, manifest


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def table(model_bytes: int = 1 << 20) -> tuple[LineageTable, Clock]:
    clock = Clock()
    t = LineageTable(64)
    t.set_my_base(BASE, model_bytes)
    return t, clock


def test_a_manifest_whose_chunks_do_not_add_up_is_refused_by_the_wire_and_again_by_the_table() -> None:
    """The chunk sum is checked where a manifest is decoded (gossip/wire.py, the authoritative check); the
    table checks it again, as defence in depth, before its size bound reads `total_bytes`: what the wire
    refuses the table refuses too, and what it lets through the table takes."""
    t, _ = table()
    pub = key(9)
    lying = manifest(pub, "lin", 1, 2, total=1000)
    lying.v, lying.total_bytes = wire.FORMAT_VERSION, 10
    with pytest.raises(DecodeError, match="add up"):
        wire.open_envelope(wire.seal(pub, wire.PATCH_MANIFEST, lying, swarm="t"), swarm="t")
    why = t.check_manifest(lying)
    assert why is not None and why.fault and "add up" in why.reason
    honest = manifest(pub, "lin", 1, 2, total=1000)
    honest.v = wire.FORMAT_VERSION
    wire.open_envelope(wire.seal(pub, wire.PATCH_MANIFEST, honest, swarm="t"), swarm="t")
    assert t.check_manifest(honest) is None


def test_only_a_stored_own_lineage_becomes_this_nodes_own() -> None:
    t, clock = table()
    rows = {rel: key(i) for i, rel in enumerate((Relation.FOLLOW, Relation.SEEN, Relation.OWN), start=1)}
    for rel, ident in rows.items():
        t.load(lineage_id(ident.public, BASE, rel), rel, rel, ident.public, BASE, 5, clock.t)
        assert t.own == (lineage_id(ident.public, BASE, "own") if rel == Relation.OWN else None), rel
    assert {r.relation for r in t.rows.values()} == set(Relation)


def test_a_manifest_is_refused_only_past_three_times_the_base_model_and_a_mebibyte() -> None:
    size = 1 << 20
    t, clock = table(size)
    pub = key(9)
    limit = int(SIZE_FACTOR * size) + (1 << 20)
    assert t.check_manifest(manifest(pub, "lin", 1, 2, total=limit)) is None
    why = t.check_manifest(manifest(pub, "lin", 1, 2, total=limit + 1))
    assert why is not None and why.fault and "out of proportion" in why.reason


def test_a_demand_is_acted_on_for_thirty_seconds() -> None:
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    lin, why = t.on_demand(pub.public, demand(lid, "lin", 3, step_time_s=0.0), clock.t)
    assert why is None and lin is not None
    clock.t += DEMAND_FRESH_S
    assert t.effective_demand(lin, clock()) is not None
    clock.t += 0.5
    assert t.effective_demand(lin, clock()) is None


def test_the_observed_step_time_counts_only_versions_that_moved_the_head() -> None:
    """After a restart a row holds version 10 (not yet heard live): an older signed version heard first
    sets nothing apart from liveness, so the step time measured later spans real advances only."""
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    t.load(lid, "lin", Relation.SEEN, pub.public, BASE, 10, clock.t)
    lin, why = t.on_manifest(manifest(pub, "lin", 4, 5), clock.t)
    assert why is None and lin is not None and lin.head == 10 and lin.live
    clock.t += 100.0
    lin, why = t.on_demand(pub.public, demand(lid, "lin", 11, step_time_s=1.0), clock.t)
    assert why is None and [v for _, v in lin.advances] == [11]
    d = t.effective_demand(lin, clock())
    assert d is not None and d.step_time_s == 1.0  # the claim stands: one advance, heard just now


def test_own_lineage_listed_first_does_not_hide_the_followable_ones() -> None:
    t, clock = table()
    me, pub = key(1), key(9)
    t.set_own(lineage_id(me.public, BASE, "mine"), "mine", me.public, BASE, 3, clock.t)
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(pub.public, demand(lid, "lin", 3), clock.t)
    assert [lin.lineage for lin, _ in t.followable(clock())] == [lid]


def test_the_step_time_is_no_shorter_than_the_publisher_demonstrably_takes() -> None:
    """A publisher claiming 1 s per version while its signed versions arrive 10 s apart is believed at 10 s."""
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(pub.public, demand(lid, "lin", 3, step_time_s=1.0), clock.t)
    clock.t += 10.0
    lin, why = t.on_demand(pub.public, demand(lid, "lin", 4, step_time_s=1.0), clock.t)
    assert why is None and lin is not None
    d = t.effective_demand(lin, clock())
    assert d is not None and d.step_time_s == 10.0
    clock.t += 30.0  # and no shorter than the time since its last version
    assert t.effective_demand(lin, clock()).step_time_s == 30.0


def test_a_signed_head_may_jump_1024_versions_and_no_more() -> None:
    """docs/architecture.md: a signed head may not jump more than 1024 versions past the last one heard."""
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(pub.public, demand(lid, "lin", 10), clock.t)
    lin, why = t.on_manifest(manifest(pub, "lin", 10 + 1024 - 1, 10 + 1024), clock.t)
    assert why is None and lin is not None and lin.signed_head == 10 + 1024
    lin, why = t.on_manifest(manifest(pub, "lin", 10 + 2048, 10 + 2049), clock.t)
    assert why is not None and why.fault and "far ahead" in why.reason and t.rows[lid].signed_head == 10 + 1024
    _, why = t.on_demand(pub.public, demand(lid, "lin", 10 + 2049), clock.t)  # an announce's head: the same bound
    assert why is not None and why.fault and "far ahead" in why.reason and t.rows[lid].signed_head == 10 + 1024
    lin, why = t.on_demand(pub.public, demand(lid, "lin", 10 + 2048), clock.t)
    assert why is None and lin.signed_head == 10 + 2048


def test_claims_on_a_proven_lineage_by_another_key_are_impersonation() -> None:
    """Whatever the impersonator's key sorts as: a demand for this node's own lineage or for a lineage whose
    publisher is proven, and a manifest whose id does not derive from its own fields, are forged claims."""
    t, clock = table()
    me, pub = key(1), key(128)
    own = lineage_id(me.public, BASE, "mine")
    t.set_own(own, "mine", me.public, BASE, 3, clock.t)
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(pub.public, demand(lid, "lin", 3), clock.t)
    lower = next(key(i) for i in range(2, 100) if key(i).public < pub.public)
    higher = next(key(i) for i in range(2, 100) if key(i).public > pub.public)
    for liar in (lower, higher):  # a comparison of keys, not their equality, would let one side through
        for target, name in ((own, "mine"), (lid, "lin")):
            lin, why = t.on_demand(liar.public, demand(target, name, 4), clock.t)
            assert lin is None and why is not None and why.fault and why.forged, (liar.public[:1], name)
    for wrong in (b"\x00" * 32, b"\xff" * 32):
        why = t.check_manifest(manifest(pub, "lin", 3, 4, lineage=wrong))
        assert why is not None and why.fault and why.forged and "derive" in why.reason
    assert t.rows[lid].publisher == pub.public and t.rows[lid].signed_head == 3


def test_the_observed_step_time_spans_the_last_eight_versions() -> None:
    """docs/architecture.md: a follower believes a publisher's step time no shorter than what its last 8
    signed versions took: one long pause is forgotten only when 8 newer versions show it over."""
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    times = [0.0, 1.0, 100.0, 101.0, 102.0, 103.0, 104.0, 105.0, 107.0]  # versions 1..9: a pause after 2
    start = clock.t
    for v, at in enumerate(times, start=1):
        clock.t = start + at
        lin, why = t.on_demand(pub.public, demand(lid, "lin", v, step_time_s=0.5), clock.t)
        assert why is None
    d = t.effective_demand(lin, clock())
    assert d is not None and d.step_time_s == pytest.approx((107.0 - 1.0) / 7)  # versions 2..9: the pause counts


def test_refusals_are_counted_under_bounded_keys() -> None:
    """The refusal counters (node status) keep at most 64 reasons, each at most 80 characters."""
    clock = Clock()
    t = LineageTable(64)  # knows no base model: nothing can be proven, every claim is refused
    for i in range(100):
        lid = lineage_id(key(3).public, b"\x09" * 32, f"l{i}")
        _, why = t.on_demand(key(7).public, demand(lid, f"l{i}", 1), clock.t)
        assert why is not None and not why.fault
    (reason,) = t.refused  # "lineage id does not derive from the signer's key, a known base model and the name"
    assert t.refused[reason] == 100 and len(reason) == 80 and reason.startswith("lineage id does not derive")
    for i in range(100):  # reasons that differ: the table stops growing at 64
        t._count(Refusal(f"reason {i}"))
    assert len(t.refused) == 64 and t.refused["reason 0"] == 1


def test_a_full_table_evicts_only_rows_merely_seen() -> None:
    """The least active row merely seen goes first; a followed or own row is never evicted for a stranger's."""
    clock = Clock()
    t = LineageTable(4)
    t.set_my_base(BASE, 1 << 20)
    follow = key(20)
    t.load(
        lineage_id(follow.public, BASE, "f"), "f", Relation.FOLLOW, follow.public, BASE, 1, clock.t
    )  # the least active
    for i in range(3):
        clock.t += 1
        p = key(30 + i)
        t.on_demand(p.public, demand(lineage_id(p.public, BASE, f"s{i}"), f"s{i}", 1), clock.t)
    clock.t += 1
    newcomer = key(40)
    lin, why = t.on_demand(newcomer.public, demand(lineage_id(newcomer.public, BASE, "n"), "n", 1), clock.t)
    assert why is None and lin is not None
    assert {r.name for r in t.rows.values()} == {"f", "s1", "s2", "n"} and t.evicted == 1


def test_a_table_full_of_followed_rows_still_takes_the_nodes_own_and_stored_lineages_but_no_strangers() -> None:
    """Only rows heard from the network are refused for room: the node's own lineage and those in its store
    are its own state, so the table grows past its bound for them rather than failing."""
    t = LineageTable(4)
    t.set_my_base(BASE, 1 << 20)
    for i in range(4):
        f = key(20 + i)
        t.load(lineage_id(f.public, BASE, f"f{i}"), f"f{i}", Relation.FOLLOW, f.public, BASE, 1, 0.0)
    stranger = key(40)
    lin, why = t.on_demand(stranger.public, demand(lineage_id(stranger.public, BASE, "n"), "n", 1), 0.0)
    assert lin is None and why is not None and why.reason == "lineage table full"
    stored, me = key(41), key(42)
    t.load(lineage_id(stored.public, BASE, "g"), "g", Relation.FOLLOW, stored.public, BASE, 2, 0.0)
    own = lineage_id(me.public, BASE, "mine")
    assert t.set_own(own, "mine", me.public, BASE, 3, 0.0) is t.rows[own]
    assert len(t.rows) == 6 and t.own == own and t.evicted == 0


def test_a_claimed_step_time_is_0_or_from_a_millisecond_to_a_million_seconds() -> None:
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    for step, ok in ((0.0, True), (0.001, True), (0.0009, False), (1e6, True), (1e6 + 1, False)):
        _, why = t.on_demand(pub.public, demand(lid, "lin", 3, step_time_s=step), clock.t)
        assert (why is None) == ok and (ok or why.fault), step


def test_a_publisher_is_avoided_for_ten_minutes() -> None:
    t, clock = table()
    pub = key(9)
    t.avoid(pub.public, "its versions could not be fetched", clock())
    assert t.is_avoided(pub.public, clock() + 599.0)
    assert not t.is_avoided(pub.public, clock() + 600.0)
    assert not t.is_avoided(pub.public, clock() + 700.0)
    assert not t.is_avoided(key(10).public, clock())


def test_of_64_avoided_publishers_the_soonest_to_expire_is_forgotten_first() -> None:
    t, clock = table()
    pubs = [key(100 + i).public for i in range(65)]
    for i, pub in enumerate(pubs):
        clock.t += 1.0
        t.avoid(pub, f"{'z' if i == 0 else 'a'} could not fetch", clock())  # the oldest has the last reason
    assert len(t.avoided) == 64 and pubs[0] not in t.avoided and pubs[1] in t.avoided


def test_a_stored_row_loads_only_with_a_32_byte_key_and_base_that_derive_its_id() -> None:
    t, clock = table()
    pub = key(9).public
    for publisher, base in ((pub[:31], BASE), (pub, BASE[:31]), (pub + b"\x00", BASE)):  # a damaged store
        t.load(b"\x01" * 32, "lin", Relation.FOLLOW, publisher, base, 4, clock.t)
        assert not t.rows
    lid = lineage_id(pub, BASE, "lin")
    t.load(lid, "lin", Relation.FOLLOW, pub, BASE, 4, clock.t)
    assert t.rows[lid].held == 4


def test_a_publishers_demand_under_another_name_is_provably_false() -> None:
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(pub.public, demand(lid, "lin", 3), clock.t)
    lin, why = t.on_demand(pub.public, demand(lid, "other-name", 4), clock.t)
    assert lin is None and why is not None and why.fault and not why.forged and "derive" in why.reason


def test_an_unmeasured_step_time_stays_unmeasured_and_a_measured_one_is_capped() -> None:
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    lin, _ = t.on_demand(pub.public, demand(lid, "lin", 3, step_time_s=0.0), clock.t)
    clock.t += 20.0  # an observation exists (20 s since the head was heard), yet 0 means "not measured"
    assert t.effective_demand(lin, clock()).step_time_s == 0.0
    clock.t += 5e6  # the next version 5e6 s later: believed no slower than 1e6 s
    lin, _ = t.on_demand(pub.public, demand(lid, "lin", 4, step_time_s=1.0), clock.t)
    assert t.effective_demand(lin, clock()).step_time_s == 1e6


def test_a_table_holds_at_least_four_rows() -> None:
    """Own, served and two more, however small the configured bound."""
    clock = Clock()
    t = LineageTable(1)
    t.set_my_base(BASE, 1 << 20)
    for i in range(5):
        clock.t += 1
        p = key(30 + i)
        t.on_demand(p.public, demand(lineage_id(p.public, BASE, f"s{i}"), f"s{i}", 1), clock.t)
    assert len(t.rows) == 4 and t.evicted == 1


def test_this_nodes_own_manifests_relayed_back_change_nothing_and_count_as_no_refusal() -> None:
    t, clock = table()
    me = key(1)
    own = lineage_id(me.public, BASE, "mine")
    t.set_own(own, "mine", me.public, BASE, 3, clock.t)
    assert t.on_manifest(manifest(me, "mine", 3, 4), clock.t) == (None, None)
    assert t.refused == {} and t.rows[own].signed_head == 3
    why = t.check_manifest(manifest(me, "mine", 3, 4))  # judged (an offer): provably not to be acted on
    assert why is not None and why.fault and why.forged


def test_configured_lineages_are_offered_whatever_their_order() -> None:
    t, clock = table()
    a, b = key(9), key(10)
    la, lb = lineage_id(a.public, BASE, "a"), lineage_id(b.public, BASE, "b")
    t.on_demand(a.public, demand(la, "a", 3), clock.t)
    t.on_demand(b.public, demand(lb, "b", 3), clock.t)
    assert [lin.lineage for lin, _ in t.followable(clock(), (lb,))] == [lb]


def test_a_lineage_first_heard_holds_the_base_model_version_0() -> None:
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    lin, _ = t.on_demand(pub.public, demand(lid, "lin", 3), clock.t)
    assert (lin.held, lin.head, lin.signed_head) == (0, 3, 3)


def test_claims_arrive_as_fresh_objects_and_are_compared_by_value() -> None:
    """The store and the network hand over new str and bytes objects: a stored own row is this node's own,
    a publisher's next demand is its own, however the values were built."""
    t, clock = table()
    me, pub = key(1), key(9)
    own = lineage_id(me.public, BASE, "mine")
    t.load(own, "mine", "".join(["o", "wn"]), bytes(bytearray(me.public)), BASE, 2, clock.t)
    assert t.own == own
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(bytes(bytearray(pub.public)), demand(lid, "lin", 3), clock.t)
    lin, why = t.on_demand(bytes(bytearray(pub.public)), demand(lid, "lin", 4), clock.t)
    assert why is None and lin.signed_head == 4


def test_an_anchor_names_one_version_and_a_manifest_far_ahead_is_refused_on_sight() -> None:
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(pub.public, demand(lid, "lin", 10), clock.t)
    for m in (manifest(pub, "lin", 3, 4, codec="anchor-v1"), manifest(pub, "lin", 4, 4)):
        why = t.check_manifest(m)
        assert why is not None and why.fault and "fit the codec" in why.reason
    assert t.check_manifest(manifest(pub, "lin", 4, 4, codec="anchor-v1")) is None
    why = t.check_manifest(manifest(pub, "lin", 10 + 1024, 10 + 1025))
    assert why is not None and why.fault and "far ahead" in why.reason
    assert t.check_manifest(manifest(pub, "lin", 10 + 1023, 10 + 1024)) is None


def test_a_first_heard_head_is_no_advance() -> None:
    """Only versions past one already heard measure the publisher's pace."""
    t, clock = table()
    pub = key(9)
    lid = lineage_id(pub.public, BASE, "lin")
    t.on_demand(pub.public, demand(lid, "lin", 0, step_time_s=1.0), clock.t)
    clock.t += 20.0
    lin, _ = t.on_demand(pub.public, demand(lid, "lin", 1, step_time_s=1.0), clock.t)
    assert t.effective_demand(lin, clock()).step_time_s == 1.0


def test_an_avoided_publisher_listed_first_does_not_hide_the_others() -> None:
    t, clock = table()
    a, b = key(9), key(10)
    la, lb = lineage_id(a.public, BASE, "a"), lineage_id(b.public, BASE, "b")
    t.on_demand(a.public, demand(la, "a", 3), clock.t)
    t.on_demand(b.public, demand(lb, "b", 3), clock.t)
    t.avoid(a.public, "could not fetch", clock())
    assert [lin.lineage for lin, _ in t.followable(clock())] == [lb]
