"""The sans-IO rollout exchange (gossip/exchange.py): shard count, shard of a lineage, subscriptions, gate."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from murmur.gossip import exchange as X


def lid(i: int) -> bytes:
    return hashlib.blake2b(b"lineage%d" % i, digest_size=32).digest()


@given(st.integers(0, 100_000), st.sampled_from([1, 2, 4, 8, 64, 1024, 4096]))
def test_shard_count_is_a_power_of_two_near_n_over_p(n: int, current: int) -> None:
    s = X.shard_count(n, current)
    assert s & (s - 1) == 0 and 1 <= s <= X.MAX_SHARDS
    if s < X.MAX_SHARDS:
        assert n < 2 * s * X.PRODUCERS_PER_SHARD  # never too few shards
    if s > 1:
        assert n >= s * X.PRODUCERS_PER_SHARD * 3 // 4  # never too many


def test_shard_count_hysteresis_and_the_bench_sizes() -> None:
    assert [X.shard_count(n) for n in (1, 8, 15, 16, 32, 1000, 10_000)] == [1, 4, 4, 8, 16, 256, 4096]
    assert X.shard_count(13, 8) == 8 and X.shard_count(11, 8) == 4  # a few producers less: no flapping


def test_ten_thousand_producers_keep_a_couple_of_lineages_a_shard() -> None:
    """The cap sits where a gate's producer table (MAX_KNOWN) ends: a swarm of `huge`'s size (10,000 producers)
    gets 4096 shards, as many lineages a shard as 1,000 producers get on 256, and the count stops there."""
    assert X.MAX_SHARDS == 4096 and X.MAX_SHARDS * X.PRODUCERS_PER_SHARD <= X.MAX_KNOWN
    for n in (9_940, 10_000):
        s = X.shard_count(n)
        assert s == X.MAX_SHARDS and n / s < 2 * X.PRODUCERS_PER_SHARD
        assert X.shard_count(n, s) == s == X.shard_count(n, s // 2)  # from either neighbouring count
    per_shard = Counter(X.shard_of(lid(i), X.MAX_SHARDS) for i in range(10_000))
    assert max(per_shard.values()) <= 12  # a few lineages a shard, not the tens a 1024-shard cap left
    assert X.shard_count(10**6, X.MAX_SHARDS) == X.MAX_SHARDS  # capped
    # a publisher that still counts 2048 shards (announces spread) is accepted by one that counts 4096
    assert all(X.on_shard(lid(i), X.shard_of(lid(i), 2048), X.MAX_SHARDS) for i in range(200))


@given(st.binary(min_size=32, max_size=32), st.sampled_from([1, 2, 4, 8, 16, 1024, 4096]))
def test_shard_of_halves_and_doubles_consistently(lineage: bytes, s: int) -> None:
    j = X.shard_of(lineage, s)
    assert 0 <= j < s
    assert X.shard_of(lineage, 2 * s) in (j, j + s)
    assert X.on_shard(lineage, j, s)
    # a publisher that counts half or double our shards is still accepted
    assert X.on_shard(lineage, X.shard_of(lineage, max(1, s // 2)), s)
    assert X.on_shard(lineage, X.shard_of(lineage, min(X.MAX_SHARDS, 2 * s)), s)


def test_wrong_shard_is_refused() -> None:
    s = 16
    lineage = lid(1)
    allowed = {X.shard_of(lineage, k) for k in (8, 16, 32)}
    wrong = next(j for j in range(s) if j not in allowed)
    gate = X.ShardGate()
    assert gate.belongs([lineage], wrong, s) == "wrong_shard"
    assert gate.belongs([lineage], X.shard_of(lineage, s), s) is None
    assert gate.counts["wrong_shard"] == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(8, 20_000), st.floats(0.1, 1_000.0), st.floats(0.1, 50.0), st.integers(0, 10_000))
def test_inbound_bounded_by_demand_plus_one_shard_whatever_n(n: int, demand: float, rate: float, t: int) -> None:
    """n producers at `rate` rollouts/s each: a consumer's subscribed supply is at most its demand (with
    margin) plus one shard plus its home shard, and it covers the demand when the swarm can."""
    supply = {lid(i): rate for i in range(n)}
    ex = X.Exchange(b"node")
    plan = ex.plan(float(t), n, supply, demand, home=[lid(0)])
    per = {}
    for lineage, r in supply.items():
        per[X.shard_of(lineage, plan.shards)] = per.get(X.shard_of(lineage, plan.shards), 0.0) + r
    got = sum(per.get(j, 0.0) for j in plan.subscribe)
    biggest = max(per.values())
    assert got <= 2 * X.DEMAND_MARGIN * demand + 2 * biggest + 1e-6
    assert len(plan.subscribe) <= X.MAX_SUBSCRIBED
    if sum(supply.values()) >= X.DEMAND_MARGIN * demand and len(plan.subscribe) < X.MAX_SUBSCRIBED:
        assert got >= X.DEMAND_MARGIN * demand - 1e-6 or set(plan.subscribe) == set(range(plan.shards))
    # a shard holds few lineages whatever n is (until MAX_SHARDS): the bound above does not grow with n
    assert biggest <= rate * 6 * max(2 * X.PRODUCERS_PER_SHARD, n / plan.shards)


def test_rotation_changes_the_rotating_shards_over_epochs() -> None:
    n = 256
    supply = {lid(i): 1.0 for i in range(n)}
    ex = X.Exchange(b"node-a")
    seen = set()
    for k in range(12):
        plan = ex.plan(k * X.ROTATE_S, n, supply, demand_rps=4.0, home=[lid(0)])
        assert X.shard_of(lid(0), plan.shards) in plan.subscribe  # the home shard stays
        seen |= set(plan.subscribe) - set(plan.home)
    assert len(seen) >= 6  # many distinct shards over 12 epochs, not a fixed few


def test_epochs_are_staggered_between_nodes() -> None:
    offsets = {X.Exchange(b"node%d" % i).offset for i in range(20)}
    assert len(offsets) == 20 and all(0 <= o < X.ROTATE_S for o in offsets)


def test_announced_supply_that_never_arrives_adds_a_shard() -> None:
    """Liars announce a rate and publish nothing: measured inbound stays short and the node subscribes more."""
    n = 128
    supply = {lid(i): 5.0 for i in range(n)}
    ex = X.Exchange(b"node")
    base = len(ex.plan(0.0, n, supply, 4.0, home=[]).subscribe)
    t = 1.0
    while t < 3 * X.SHORTFALL_WINDOW_S:
        ex.plan(t, n, supply, 4.0, home=[], measured_rps=0.0)
        t += 1.0
    assert ex.extra >= 1
    assert len(ex.plan(t, n, supply, 4.0, home=[], measured_rps=0.0).subscribe) > base
    # and drops it again once inbound is well above demand
    ex.plan(t + 1, n, supply, 4.0, home=[], measured_rps=100.0)
    assert ex.extra < 2


def test_a_node_that_consumes_nothing_joins_only_its_home_shard() -> None:
    supply = {lid(i): 1.0 for i in range(512)}
    plan = X.Exchange(b"f").plan(0.0, 512, supply, 0.0, home=[lid(3)])
    assert plan.subscribe == (X.shard_of(lid(3), plan.shards),)


def test_newcomer_flood_is_bounded_per_shard_and_spares_established_producers() -> None:
    gate = X.ShardGate()
    gate.announced("honest", 0.0)
    now = X.ESTABLISHED_S + 1.0
    admitted = sum(gate.admit(f"fresh{k}", 3, now) is None for k in range(10_000))
    assert admitted <= X.NEWCOMER_BURST + 1
    assert gate.counts["newcomer_budget"] >= 10_000 - X.NEWCOMER_BURST - 1
    assert all(gate.admit("honest", 3, now) is None for _ in range(100))  # never starved by the flood
    assert gate.admit("fresh0", 4, now) is None  # another shard has its own budget


def test_the_newcomer_buckets_stay_bounded_by_the_shard_cap() -> None:
    gate = X.ShardGate()
    most = 0
    for j in range(2 * X.MAX_SHARDS + 5):  # a node that has rotated through every shard twice over
        assert gate.admit("fresh", j, 100.0) is None  # a shard first met has its whole burst
        most = max(most, len(gate.newcomers))
    assert most == X.MAX_SHARDS and len(gate.newcomers) <= X.MAX_SHARDS


def test_meter_reports_after_a_window() -> None:
    m = X.Meter(window_s=10.0)
    assert m.rate(0.0) is None
    m.add(1.0, 50)
    assert m.rate(5.0) is None
    assert m.rate(10.5) == 5.0
    assert m.rate(30.0) == 0.0


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 20_000))
@example(256)  # exactly k keys: the table is full and holds every one of them
@example(257)
def test_distinct_count_is_exact_when_small_and_close_when_large(n: int) -> None:
    c = X.DistinctCount(k=256, window_s=30.0)
    for rep in range(2):  # repeats are not new keys
        for i in range(n):
            c.add(f"peer{i}", float(rep))
    est = c.count(1.0)
    if n <= 256:
        assert est == n
    else:
        assert abs(est - n) <= 0.25 * n
    assert len(c._seen) <= 256
    assert c.count(100.0) == 0  # all expired


def test_stats_count_rates_distinct_producers_and_task_sets_within_bounds() -> None:
    st = X.Stats()
    assert st.rates(0.0) == {}
    for k in range(100):
        st.received(8)
        st.verified(b"p%d" % (k % 5), [(b"ts%d" % k, b"L")], 8, float(k))
    st.drop("wrong_shard")
    r = st.rates(10.0)
    assert r["received_rollouts_per_s"] == 80.0 and r["dropped_batches_per_s"] == 0.1
    assert st.distinct_producers(99.0) == 5
    assert st.distinct_producers(99.0 + X.DISTINCT_WINDOW_S + 1) == 0  # a window, not forever
    assert len(st.task_sets) == X.MAX_TASK_SETS and st.task_sets["other"]["verified_rollouts"] == 100 - 63


def test_the_exchange_shows_in_status_dashboard_and_metrics() -> None:
    from rich.console import Console

    from murmur.node.status import ExchangeView, NodeStatus
    from murmur.node.ui.dashboard import node_panel
    from murmur.node.ui.metrics import Metrics

    s = NodeStatus(
        exchange=ExchangeView(
            shards=8,
            subscribed=[2, 5],
            received_rollouts=40,
            verified_rollouts=32,
            used_rollouts=16,
            dropped={"wrong_shard": 3},
            distinct_producers=4,
            rates={"received_rollouts_per_s": 4.0},
            used_over_verified=0.5,
            task_sets={"ab" * 32: {"verified_rollouts": 32, "used_rollouts": 16}},
            produced_rollouts=100,
            published_rollouts=30,
            uninformative_rollouts=50,
            withheld_rollouts=20,
            publish_budget_per_s=2.5,
            unsampled_batches=7,
            sample_fraction=0.1,
            sample_floor_per_min=2.0,
            sample_rate=0.25,
            lineages_by_task_set={"ab" * 32: {"cd" * 32: 3}},
            groups_generated=12,
            groups_sent=5,
            groups_trained=9,
        )
    )
    con = Console(width=400, record=True)  # one line per row: the checks below read whole phrases
    con.print(node_panel(s))
    text = con.export_text()
    assert "shards 2,5 of 8" in text and "used/verified 0.50" in text
    assert "50 uninformative, 20 over the publish budget of 2.5/s" in text
    assert "sample 10% + 2/min a producer (checked 25%, 7 batches unverified)" in text
    assert "groups generated 12, sent 5, trained 9" in text
    m = Metrics()
    m.update(s)
    assert m.registry.get_sample_value("murmur_exchange_total", {"kind": "withheld_rollouts"}) == 20
    assert m.registry.get_sample_value("murmur_exchange_total", {"kind": "unsampled_batches"}) == 7
    assert [
        m.registry.get_sample_value("murmur_exchange_total", {"kind": f"groups_{k}"})
        for k in ("generated", "sent", "trained")
    ] == [12, 5, 9]
    assert m.registry.get_sample_value("murmur_exchange_publish_budget_rollouts_per_second") == 2.5
    assert m.registry.get_sample_value("murmur_exchange_validator_sample", {"kind": "checked_share"}) == 0.25
    assert m.registry.get_sample_value("murmur_exchange_dropped_total", {"reason": "wrong_shard"}) == 3
    assert m.registry.get_sample_value("murmur_exchange_distinct_producers") == 4
    assert (
        m.registry.get_sample_value("murmur_exchange_task_set_rollouts", {"task_set": "ab" * 32, "kind": "used"}) == 16
    )
    assert (
        m.registry.get_sample_value(
            "murmur_exchange_task_set_generators", {"task_set": "ab" * 32, "lineage": "cd" * 32}
        )
        == 3
    )


def test_a_validator_joins_the_shard_of_the_lineage_it_checks_whatever_the_swarm_size() -> None:
    """Every producer of a lineage publishes to that lineage's shard, so a validator of the lineage that joins
    it sees every producer of it (and spot-checks each at its worker's rate), however many shards there are."""
    from murmur.node.core import machine as C
    from tests.test_core import W, announce, follow_trainer, key, make_core, of

    core, clock = make_core(roles=("follower", "validator"))
    lid = follow_trainer(core, clock, key(9))
    core.handle(W("applied", {"lineage": lid.hex(), "version": 3}))  # it delivered: the worker checks it
    assert core.committed == lid
    for i in range(40, 140):  # 100 other producers: many shards
        a = announce(key(i), 1)
        core.handle(C.AnnounceHeard(a.signer, with_rate(a.body), a.data))
    clock.t += C.ANNOUNCE_EVERY_S
    subs = of(core.handle(C.Tick()), C.Subscribe)
    assert subs and subs[-1].shards >= 16
    assert X.shard_of(lid, subs[-1].shards) in subs[-1].subscribe
    assert len(subs[-1].subscribe) == 1  # it trains not: nothing else


def with_rate(body):  # an announce that states a publishing rate
    import msgspec

    return msgspec.structs.replace(body, publish_batches_per_s=1.0)


def test_an_honest_producer_announcing_every_few_seconds_leaves_the_newcomer_bucket() -> None:
    gate = X.ShardGate()
    for k in range(10):  # an announce every 3 s from t = 0
        gate.announced("honest", 3.0 * k)
    # a flood of fresh keys spends the shard's shared newcomer bucket
    t = X.ESTABLISHED_S + 2.0
    refused = sum(gate.admit(f"fresh{i}", 0, t) is not None for i in range(int(X.NEWCOMER_BURST) + 20))
    assert refused >= 20
    assert all(gate.admit("honest", 0, t) is None for _ in range(100))
    assert gate.admit("fresh-late", 0, t + 0.25) is None  # the honest batches took no newcomer token
    # until X.ESTABLISHED_S after its first announce it is a newcomer like any other
    late = X.ShardGate()
    for k in range(4):
        late.announced("honest", 100.0 + 3.0 * k)
    for t in (100.0 + X.ESTABLISHED_S - 0.5, 100.0 + X.ESTABLISHED_S):
        while late.admit("fresh", 0, t) is None:  # the shared bucket emptied at t
            pass
        assert late.admit("honest", 0, t) == ("newcomer_budget" if t < 100.0 + X.ESTABLISHED_S else None), t


def test_the_shard_count_halves_only_below_three_quarters_of_a_shards_producers() -> None:
    s = 4
    edge = s * X.PRODUCERS_PER_SHARD * 3 // 4  # 6 producers for 4 shards: stays
    assert X.shard_count(edge, current=s) == s
    assert X.shard_count(edge - 1, current=s) == s // 2
    assert X.shard_count(2 * s * X.PRODUCERS_PER_SHARD - 1, current=s) == s
    assert X.shard_count(2 * s * X.PRODUCERS_PER_SHARD, current=s) == 2 * s


def test_a_supply_that_is_not_a_finite_number_is_not_counted() -> None:
    sup = X.Supply({b"a" * 32: 2.0})
    sup.per_shard(4)
    for bad in (float("nan"), float("inf"), float("-inf"), 0.0):
        sup.add(b"b" * 32, bad)
        sup.add(b"a" * 32, bad)
    assert sup.by_lineage == {b"a" * 32: 2.0}
    assert sum(sup.per_shard(4).values()) == 2.0


def test_a_supply_taken_back_leaves_no_entry_behind() -> None:
    sup = X.Supply()
    sup.per_shard(4)  # kept incrementally from here on
    a, b = b"a" * 32, b"b" * 32
    sup.add(a, 2.0)
    sup.add(b, 1.0)
    sup.add(a, -2.0)
    assert sup.of(a) == 0.0 and sup.by_lineage == {b: 1.0}
    assert dict(sup.per_shard(4)) == {X.shard_of(b, 4): 1.0}
    sup.add(b, -1.0)
    assert sup.by_lineage == {} and dict(sup.per_shard(4)) == {}


def test_a_nodes_epoch_turns_at_its_own_offset() -> None:
    ex = X.Exchange(b"node-e")
    assert 0 < ex.offset < X.ROTATE_S
    turn = X.ROTATE_S - ex.offset  # its first new epoch after 0
    assert ex.epoch(0.0) == 0 and ex.epoch(turn - 0.01) == 0 and ex.epoch(turn) == 1


def test_a_demand_that_is_not_a_finite_number_is_no_demand() -> None:
    n = 128
    supply = {lid(i): 5.0 for i in range(n)}
    for bad in (float("nan"), float("inf")):
        ex = X.Exchange(b"node")
        t = 0.0
        while t < 3 * X.SHORTFALL_WINDOW_S:  # measured inbound is 0 all along: no shortfall of no demand
            plan = ex.plan(t, n, supply, bad, home=[lid(3)], measured_rps=0.0)
            t += 1.0
        assert plan.subscribe == (X.shard_of(lid(3), plan.shards),) and ex.extra == 0, bad


def _lineage_on(shard: int, shards: int) -> bytes:
    return next(lid(i) for i in range(100_000) if X.shard_of(lid(i), shards) == shard)


def test_within_an_epoch_a_plan_that_covers_the_demand_stays() -> None:
    """A shard that covers the demand (between it and twice it) is kept for the rest of the epoch, even when
    a shard earlier in this epoch's order starts to offer as much; the next epoch draws again."""
    ex = X.Exchange(b"keep")
    s = X.shard_count(64)
    order = list(X.rotation(ex.node, s, ex.epoch(0.0)))
    first = {_lineage_on(order[5], s): 3.0}
    plan = ex.plan(0.0, 64, first, demand_rps=2.0, home=[])
    assert plan.subscribe == (order[5],)
    more = {**first, _lineage_on(order[0], s): 3.0}
    assert X.Exchange(b"keep").plan(0.0, 64, more, demand_rps=2.0, home=[]).subscribe == (order[0],)  # afresh
    assert ex.plan(1.0, 64, more, demand_rps=2.0, home=[]).subscribe == (order[5],)  # kept


def test_a_demand_met_exactly_takes_no_further_shard() -> None:
    ex = X.Exchange(b"exact")
    s = X.shard_count(64)
    order = list(X.rotation(ex.node, s, ex.epoch(0.0)))
    supply = {_lineage_on(order[1], s): 2.0, _lineage_on(order[3], s): 2.0}
    assert ex.plan(0.0, 64, supply, demand_rps=2.0, home=[]).subscribe == (order[1],)
    assert X.Exchange(b"exact").plan(0.0, 64, supply, demand_rps=2.5, home=[]).subscribe == tuple(
        sorted((order[1], order[3]))
    )


def test_the_shortfall_rule_at_its_edges() -> None:
    """Measured inbound of exactly 0.9 x demand is enough; below it for exactly SHORTFALL_WINDOW_S adds one
    shard, exactly one; exactly 3 x demand gives it back, never more than were added; a NaN or infinite
    measurement, or no demand, changes nothing."""
    supply = {lid(i): 1.0 for i in range(256)}
    d = 2.0
    ex = X.Exchange(b"short")
    for t in range(100):
        ex.plan(float(t), 256, supply, d, home=[], measured_rps=X.SHORTFALL * d)
    assert ex.extra == 0
    ex.plan(100.0, 256, supply, d, home=[], measured_rps=0.0)
    ex.plan(100.0 + X.SHORTFALL_WINDOW_S - 0.5, 256, supply, d, home=[], measured_rps=0.0)
    assert ex.extra == 0
    t = 100.0 + X.SHORTFALL_WINDOW_S
    plan = ex.plan(t, 256, supply, d, home=[], measured_rps=0.0)
    base = X.Exchange(b"short").plan(t, 256, supply, d, home=[])  # the same epoch, no shortfall
    assert ex.extra == 1 and len(plan.subscribe) == len(base.subscribe) + 1
    for measured, demand in ((float("nan"), d), (float("inf"), d), (100.0, 0.0)):
        for t in range(200, 300):
            ex.plan(float(t), 256, supply, demand, home=[], measured_rps=measured)
        assert ex.extra == 1, (measured, demand)
    ex.plan(300.0, 256, supply, d, home=[], measured_rps=3 * d)
    assert ex.extra == 0
    ex.plan(301.0, 256, supply, d, home=[], measured_rps=3 * d)
    assert ex.extra == 0


def test_home_shards_that_fill_every_place_leave_none_for_rotation() -> None:
    s = X.shard_count(4096)
    home = [_lineage_on(j, s) for j in range(X.MAX_SUBSCRIBED)]
    supply = {lid(i): 1.0 for i in range(4096)}
    plan = X.Exchange(b"full").plan(0.0, 4096, supply, demand_rps=50.0, home=home)
    assert plan.subscribe == tuple(range(X.MAX_SUBSCRIBED))


def test_the_meter_and_the_distinct_producers_count_whole_windows() -> None:
    m = X.Meter(window_s=10.0)
    m.add(100.0, 50)  # the first call starts the window
    assert m.rate(109.5) is None
    assert m.rate(110.0) == 0.0  # the event exactly a window old has left it
    m.add(111.0, 20)
    assert m.rate(120.5) == 2.0 and m.rate(121.0) == 0.0
    st = X.Stats()
    st.verified(b"p", [], 1, 1000.0)
    assert st.distinct_producers(1000.0 + X.DISTINCT_WINDOW_S) == 1  # exactly a window old still counts
    assert st.distinct_producers(1000.0 + X.DISTINCT_WINDOW_S + 0.5) == 0


def test_used_rollouts_are_counted_per_task_set() -> None:
    st = X.Stats()
    st.used({"ab" * 32: 5, "not hex": 3, "cd" * 32: -2})
    assert st.counts["used_rollouts"] == 5 and st.task_sets["ab" * 32]["used_rollouts"] == 5


def test_stats_rates_are_over_the_last_rate_window() -> None:
    st = X.Stats()
    for t in range(1000, 1041):  # called once a second; a batch a second until 1020
        if t < 1020:
            st.received(1)
        r = st.rates(float(t))
    # the snapshot 30 s back (1010) is the base: batches 1011..1019 over 30 s
    assert r["received_batches_per_s"] == round(9 / X.RATE_WINDOW_S, 3)


def test_a_distinct_key_counts_until_exactly_its_window_has_passed() -> None:
    c = X.DistinctCount(k=4, window_s=30.0)
    c.add("a", 100.0)
    assert c.count(130.0) == 1 and c.count(130.5) == 0


def test_stats_called_often_still_rate_over_the_window() -> None:
    st = X.Stats()
    for k in range(10_000, 10_401):  # every 0.1 s for 40 s; a batch each call from 20 s to 22 s
        if 10_200 <= k < 10_220:
            st.received(1)
        r = st.rates(k / 10)
    assert r["received_batches_per_s"] == pytest.approx(20 / X.RATE_WINDOW_S, rel=0.05)


def test_extra_shards_never_take_a_node_past_its_subscription_cap() -> None:
    supply = {lid(i): 1.0 for i in range(512)}
    ex = X.Exchange(b"capped")
    ex.extra = X.MAX_SUBSCRIBED  # as many as the shortfall rule ever adds
    plan = ex.plan(0.0, 512, supply, demand_rps=2.0, home=[lid(1)])
    assert len(plan.subscribe) == X.MAX_SUBSCRIBED


def test_per_task_set_a_coordinator_sees_each_lineage_and_how_many_nodes_generate_for_it() -> None:
    """Three producers generate for lineage A on set T (a trainer and two followers), one for lineage B on
    T and on U; a producer counts once however many of its rollouts a batch holds; a lineage nobody
    generated for within the window leaves the table; the tables stay bounded."""
    st = X.Stats()
    T, U, A, B = b"T" * 32, b"U" * 32, b"A" * 32, b"B" * 32
    for p in (b"t", b"f1", b"f2"):
        st.verified(p, [(T, A)] * 8, 8, 0.0)
    st.verified(b"b", [(T, B), (U, B)], 2, 10.0)
    got = st.lineages_by_set(20.0)
    assert got == {T.hex(): {A.hex(): 3, B.hex(): 1}, U.hex(): {B.hex(): 1}}
    assert st.task_sets[T.hex()]["verified_rollouts"] == 25  # still per rollout
    assert st.lineages_by_set(5.0 + X.DISTINCT_WINDOW_S) == {T.hex(): {B.hex(): 1}, U.hex(): {B.hex(): 1}}
    for k in range(X.MAX_LINEAGES_PER_SET + 10):
        st.verified(b"x", [(T, b"%031d" % k + b"L")], 1, 30.0)
    assert len(st.generators[T.hex()]) == X.MAX_LINEAGES_PER_SET
    for k in range(X.MAX_TASK_SETS + 10):
        st.verified(b"y", [(b"%032d" % k, A)], 1, 30.0)
    assert len(st.generators) == X.MAX_TASK_SETS and "other" in st.generators


@settings(max_examples=300, deadline=None)
@given(
    shards=st.sampled_from([1, 2, 8, 64, 512, X.MAX_SHARDS]),
    epoch=st.integers(-5, 10**6),
    node=st.binary(min_size=1, max_size=8),
    data=st.data(),
)
def test_both_candidate_walks_give_the_same_shards(shards: int, epoch: int, node: bytes, data) -> None:
    """`_rotating` finds its candidates by sorting the supplied shards by position when they are few, by
    walking the rotation otherwise: on any supply (some shards offering nothing or less than nothing, as the
    node's own shard does), any shards already taken and any count, both give the same shards in the same
    order, on either side of the threshold."""
    shard = st.integers(0, shards - 1)
    offers = st.one_of(st.just(0.0), st.just(-1.5), st.floats(1e-6, 100.0))
    per_shard = data.draw(st.dictionaries(shard, offers, min_size=1, max_size=min(shards, 200)))
    taken = data.draw(st.sets(shard, max_size=X.MAX_SUBSCRIBED))
    k = data.draw(st.sampled_from([1, 4, 4 * X.MAX_SUBSCRIBED, shards + 1]))

    def avail(j: int) -> float:
        return per_shard.get(j, 0.0)

    args = (node, shards, epoch, avail, per_shard.keys(), taken, k)
    got = X.candidates_by_position(*args)
    assert got == X.candidates_by_walk(*args)
    assert len(got) == min(k, sum(1 for j, r in per_shard.items() if r > 1e-9 and j not in taken))
