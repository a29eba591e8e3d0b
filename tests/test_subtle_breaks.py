"""Behaviours a plausible one-line bug breaks while every defence is still in place (issue 43): a count not
given back, the wrong end of a window, a check on the wrong field, a comparison that lets NaN through. Each
test fails with its bug (docs/testing.md lists the bug each was checked against). In-process, explicit time."""

from __future__ import annotations

import math
import struct
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given, settings, strategies as st

from gossip import wire
from gossip.cpubudget import ACTIVE_S, CpuBudget
from gossip.exchange import ESTABLISHED_S, NEWCOMER_BURST, ShardGate
from gossip.hostlimits import range_full
from gossip.identity import Identity
from gossip.limits import StreamBudget, StreamLimits
from node.roles import Demand, Offer, activate, required_rate

# ------------------------------------------------------------ inbound streams (gossip/limits.py, hostlimits.py)


def test_the_node_wide_stream_count_returns_to_zero_as_one_peers_streams_close() -> None:
    """One key opening and closing a node's whole stream cap, one stream at a time, leaves nothing counted:
    a count not given back on close would lock every other peer out after 4,096 streams."""
    budget = StreamBudget()
    for _ in range(budget.limits.node_streams + 1):
        assert budget.open_stream("churner")
        budget.close_stream("churner")
    assert budget.node_streams == 0 and budget.streams == {}
    assert budget.open_stream("honest")
    # the per-peer count is given back as well: the key may hold its whole share again
    for _ in range(budget.limits.peer_streams):
        assert budget.open_stream("churner")
    assert not budget.open_stream("churner")
    assert budget.node_streams == budget.limits.peer_streams + 1


def _swarm_conn(budget: StreamBudget, peer: str, handled: list[Any]) -> Any:
    """Just what py-libp2p 0.8.1's `SwarmConn._handle_muxed_stream` reads, around the budget hook."""
    async def add_stream(muxed: Any) -> Any:
        return SimpleNamespace(muxed=muxed, _resource_released=True)

    async def handler(net_stream: Any) -> None:
        handled.append(net_stream.muxed)
        if net_stream.muxed == "fails":
            raise RuntimeError("the protocol handler failed")

    swarm = SimpleNamespace(_murmur_budget=budget, common_stream_handler=handler)
    return SimpleNamespace(swarm=swarm, muxed_conn=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer)),
                           _add_stream=add_stream, remove_stream=lambda s: None)


def test_the_stream_hook_gives_each_stream_back_however_its_handler_ends() -> None:
    from libp2p.network.connection.swarm_connection import SwarmConn

    from gossip import libp2p_fixes

    libp2p_fixes.install()
    budget = StreamBudget(StreamLimits(peer_streams=4, node_streams=8))
    handled: list[Any] = []
    conn = _swarm_conn(budget, "churner", handled)

    async def main() -> None:
        for i in range(3 * budget.limits.node_streams):
            try:
                await SwarmConn._handle_muxed_stream(conn, "fails" if i % 2 else f"s{i}")
            except RuntimeError:
                pass
            assert budget.node_streams == 0, i

    trio.run(main)
    assert len(handled) == 3 * budget.limits.node_streams  # every stream reached its handler
    assert budget.open_stream("honest")


# ------------------------------------------------------------ inbound connections per address (hostlimits.py)


def _conn(ip: str, direction: str = "") -> Any:
    """A direct connection from `ip`; `direction` as py-libp2p's `Direction` prints (`inbound`, `outbound`)."""
    return SimpleNamespace(get_connection_type=lambda: "ConnectionType.DIRECT",
                           get_transport_addresses=lambda: [f"/ip4/{ip}/tcp/4001"], direction=direction)


def test_outbound_connections_do_not_count_against_the_inbound_per_address_limit() -> None:
    lim = StreamLimits(ip_connections=2, ip_unlimited=())
    ip = "198.51.100.7"
    # the node dialled this address many times: none of those count against its inbound share
    dialled = [_conn(ip, "outbound") for _ in range(10)]
    assert range_full(lim, "inbound", _conn(ip), dialled) is None
    # its inbound connections do, and the one past the cap is refused
    held = dialled + [_conn(ip, "inbound"), _conn(ip, "inbound")]
    assert range_full(lim, "inbound", _conn(ip), held) == f"{ip}/32"
    assert range_full(lim, "inbound", _conn("198.51.100.8"), held) is None
    # and a connection the node dials itself is never refused for the address's inbound share
    assert range_full(lim, "outbound", _conn(ip), held) is None


# ------------------------------------------------------------ stream offences (gossip/limits.py)


def test_stream_offences_expire_after_their_window() -> None:
    charged: list[str] = []
    budget = StreamBudget(StreamLimits(offences=3, offence_window_s=600.0), on_charge=lambda p, w: charged.append(p))
    # three offences within the window: charged
    for t in (0.0, 100.0, 599.0):
        budget.offence("a", "held frame", t)
    assert charged == ["a"]
    # three offences spread wider than the window: the first two have expired when the third comes
    for t in (1000.0, 1100.0, 1700.0):
        budget.offence("b", "held frame", t)
    assert charged == ["a"]
    # an offence exactly one window old has expired (the window is open at its old end)
    for t in (2000.0, 2300.0, 2600.0):
        budget.offence("c", "held frame", t)
    assert charged == ["a"]
    budget.offence("c", "held frame", 2600.5)  # 2300, 2600, 2600.5: three within 600 s
    assert charged == ["a", "c"]


# ------------------------------------------------------------ behaviour log-probs (gossip/wire.py)


def _logprobs(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1000.5, 0.5])
def test_a_non_finite_logprob_is_refused_in_a_rollout_longer_than_256_tokens(bad: float) -> None:
    for n in (300, 4096):
        for j in (0, n // 2, n - 1):
            values = [-0.25] * n
            values[j] = bad
            fault = wire.logprob_fault(_logprobs(values))
            assert fault and f"at token {j} " in fault, (n, j, fault)
        assert wire.logprob_fault(_logprobs([-0.25] * n)) == ""


_MAX_F32 = struct.unpack("<f", struct.pack("<f", wire.LOGPROB_MAX))[0]
_EDGES = [math.nan, math.inf, -math.inf, wire.LOGPROB_MIN, _MAX_F32, math.nextafter(wire.LOGPROB_MIN, -math.inf),
          float(struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", _MAX_F32))[0] + 1))[0]),
          -0.0, 0.0, -104.0]


def _in_range(x: float) -> bool:
    return wire.LOGPROB_MIN <= x <= _MAX_F32


@settings(max_examples=200, deadline=None)
@given(n=st.sampled_from([255, 256, 257]), data=st.data())
def test_both_forms_of_the_logprob_check_agree_at_their_boundary(n: int, data: Any) -> None:
    """Up to 256 values are checked in Python, more with numpy: at 255, 256 and 257 values, with NaN, +-inf,
    the bounds and the float32 just past each, both forms refuse exactly the out-of-range values and name
    the first one."""
    f32 = st.floats(min_value=wire.LOGPROB_MIN, max_value=_MAX_F32, width=32)
    values = [data.draw(f32)] * n
    for _ in range(data.draw(st.integers(0, 4))):
        values[data.draw(st.integers(0, n - 1))] = data.draw(st.one_of(st.sampled_from(_EDGES), f32))
    values = list(struct.unpack(f"<{n}f", _logprobs(values)))  # as the receiver reads them
    fault = wire.logprob_fault(_logprobs(values))
    bad = [j for j, x in enumerate(values) if not _in_range(x)]
    if not bad:
        assert fault == ""
    else:
        assert f"at token {bad[0]} " in fault, (bad, fault)


# ------------------------------------------------------------ partial rollouts (gossip/validation.py)

LINEAGE = b"\x4c" * 32
PRODUCER = Identity.from_seed(b"\x41" * 32)


def test_a_partial_rollout_whose_first_tokens_are_too_old_is_refused_whatever_its_later_tokens() -> None:
    """Head 20, bound 4: a rollout begun at version 15 and continued at 20 is stale, alone or after a fresh
    rollout of the same lineage in its batch; begun at 16 it is used."""
    from simulations.bench.gossip import SWARM, make_rollout, registry
    from gossip.validation import Pipeline, PipelineConfig, Reason
    from tests.samples import Clock
    from training.verifiers import score

    reg = registry()
    clock = Clock()
    p = Pipeline(PipelineConfig(swarm=SWARM, max_staleness=4), clock=clock, resolve_task=reg.resolve, reward=score,
                 head_version=lambda lin: 20 if lin == LINEAGE else None, task_set_trusted=reg.__contains__)

    def partial(seed: int, first: int) -> wire.Rollout:
        r = make_rollout(reg, seed, 16, version=first, lineage=LINEAGE)
        return msgspec.structs.replace(r, token_versions=[(0, first), (4, 18), (8, 20)])

    def batch(seq: int, rollouts: list[wire.Rollout]) -> bytes:
        b = wire.RolloutBatch(v=wire.FORMAT_VERSION, swarm=SWARM, producer=PRODUCER.public, seq=seq,
                              created_ms=int(clock() * 1000), rollouts=rollouts)
        return wire.seal(PRODUCER, wire.ROLLOUT_BATCH, b, swarm=SWARM)

    fresh = make_rollout(reg, 2, 16, version=20, lineage=LINEAGE)
    for seq, rollouts in enumerate(([partial(4, 15)], [fresh, partial(6, 15)], [partial(8, 15), fresh]), 1):
        step = p.admit(batch(seq, rollouts), PRODUCER.peer_id)
        assert getattr(step, "reason", None) is Reason.STALE_VERSION, (seq, step)
    assert p.check(batch(9, [fresh, partial(10, 16)]), PRODUCER.peer_id).accepted


# ------------------------------------------------------------ one guarded step (training/trainer.py)


def test_a_step_whose_loss_is_finite_but_whose_gradient_is_infinite_is_skipped() -> None:
    import torch

    from training.trainer import guarded_step

    w = torch.nn.Parameter(torch.tensor([0.0, 1.0, 4.0]))
    opt = torch.optim.AdamW([w], lr=0.1)
    loss = torch.sqrt(w).sum()  # 3.0: finite; d sqrt(w) / dw at 0 is +inf
    assert bool(torch.isfinite(loss))
    assert guarded_step(opt, [w], loss, grad_clip=1.0) is None
    assert w.tolist() == [0.0, 1.0, 4.0] and w.grad is None and not opt.state
    # the same step with a finite gradient is taken
    gn = guarded_step(opt, [w], torch.sqrt(w[1:]).sum(), grad_clip=1.0)
    assert gn is not None and math.isfinite(gn) and w.tolist()[1:] != [1.0, 4.0]


# ------------------------------------------------------------ newcomers (gossip/exchange.py)


def test_an_honest_producer_announcing_every_few_seconds_leaves_the_newcomer_bucket() -> None:
    gate = ShardGate()
    for k in range(10):  # an announce every 3 s from t = 0
        gate.announced("honest", 3.0 * k)
    # a flood of fresh keys spends the shard's shared newcomer bucket
    t = ESTABLISHED_S + 2.0
    refused = sum(gate.admit(f"fresh{i}", 0, t) is not None for i in range(int(NEWCOMER_BURST) + 20))
    assert refused >= 20
    assert all(gate.admit("honest", 0, t) is None for _ in range(100))
    assert gate.admit("fresh-late", 0, t + 0.25) is None  # the honest batches took no newcomer token
    # until ESTABLISHED_S after its first announce it is a newcomer like any other
    late = ShardGate()
    for k in range(4):
        late.announced("honest", 100.0 + 3.0 * k)
    for t in (100.0 + ESTABLISHED_S - 0.5, 100.0 + ESTABLISHED_S):
        while late.admit("fresh", 0, t) is None:  # the shared bucket emptied at t
            pass
        assert late.admit("honest", 0, t) == ("newcomer_budget" if t < 100.0 + ESTABLISHED_S else None), t


# ------------------------------------------------------------ verification CPU (gossip/cpubudget.py)


def test_keys_whose_batches_keep_being_refused_do_not_dilute_the_fair_share() -> None:
    """64 minted keys each get one costly batch verified, then keep sending while in debt: once their one
    spend is ACTIVE_S old they no longer count, though every later batch of theirs was refused."""
    budget = CpuBudget()
    keys = [f"minted{i}" for i in range(64)]
    for k in keys:  # one batch at the verifier's time limit each (a new key's first is admitted)
        assert budget.admit(k, 0.0) is None
        budget.spend(k, 2.0, 0.0)
    honest_spent = 0
    t = 0.5
    while t <= ACTIVE_S + 2.0:
        assert all(budget.admit(k, t) is not None for k in keys), t
        if budget.admit("honest", t) is None:
            budget.spend("honest", 0.01, t)
            honest_spent += 1
        t += 0.5
    assert honest_spent > 0
    # only the honest producer spent within ACTIVE_S: its share is the per-peer cap, not 1/65 of the node
    assert budget.share(t) == pytest.approx(min(budget.peer_rate, budget.node_rate))


def test_a_new_keys_bucket_starts_empty_even_while_the_node_is_busy() -> None:
    budget = CpuBudget()
    assert budget.admit("busy", 0.0) is None
    budget.spend("busy", 6.0, 0.0)  # the node's bucket (4 s) is in debt for seconds
    assert budget.admit("fresh", 0.5) is None  # one batch on an empty bucket
    budget.spend("fresh", 0.3, 0.5)
    assert budget.admit("fresh", 0.6) is not None  # then in debt: refused while the node is busy
    assert budget.admit("other-fresh", 0.6) is None  # another new key gets its one batch too


# ------------------------------------------------------------ supply counted for followers (node/roles.py)

_offer = st.builds(lambda i, claim, backed, cost, latency: (i, claim, backed, cost, latency),
                   st.integers(0, 10**6),
                   st.floats(0.0, 1e4, allow_nan=False),
                   st.one_of(st.none(), st.floats(-10.0, 1e4, allow_nan=False)),
                   st.floats(0.1, 10.0),
                   st.floats(0.0, 20.0))


@settings(max_examples=150, deadline=None)
@given(offers=st.lists(_offer, max_size=8), rollouts=st.integers(0, 256), step=st.floats(0.1, 60.0),
       trial=st.floats(0.0, 1.0))
def test_the_supply_counted_for_followers_never_exceeds_their_claims(offers: list, rollouts: int, step: float,
                                                                     trial: float) -> None:
    d = Demand(rollouts_per_step=rollouts, step_time_s=step, max_staleness=4)
    os_ = [Offer(f"p{i}-{n}", claim, latency, cost, backed) for n, (i, claim, backed, cost, latency) in enumerate(offers)]
    act = activate(d, os_, trial_share=trial)
    by_id = {o.peer_id: o for o in os_}
    active = [by_id[p] for p in act.active]
    assert act.supply <= sum(o.rollouts_per_s for o in active) * (1 + 1e-12)
    for p, counted in act.capped.items():
        assert 0.0 <= counted < by_id[p].rollouts_per_s
    # what no delivery backs counts for the trial share of the need at most, however many claim it
    backed = sum(min(o.rollouts_per_s, max(0.0, o.backed)) if o.backed is not None else o.rollouts_per_s
                 for o in active)
    assert act.supply <= backed + trial * required_rate(d) + 1e-9


def test_claims_no_delivery_backs_share_one_trial_credit() -> None:
    d = Demand(rollouts_per_step=64, step_time_s=2.0, max_staleness=4)
    need = required_rate(d)
    minted = [Offer(f"minted{i}", 1e9, 0.5, 1.0, backed=0.0) for i in range(8)]
    act = activate(d, minted, trial_share=0.25)
    assert act.supply == pytest.approx(0.25 * need) and not act.met
    assert sum(act.capped.values()) == pytest.approx(0.25 * need)
    # a follower whose delivery backs its claim is counted for all of it, beside the minted keys
    honest = Offer("honest", need, 0.5, 1.0, backed=need)
    act = activate(d, [*minted, honest], trial_share=0.25)
    assert "honest" in act.active and act.met and act.supply <= need + 0.25 * need + 1e-9
