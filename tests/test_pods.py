"""Pods by default: a node whose roles are not configured trains or generates by the swarm's need
(node.core.roles.want_mode / PodRule, wired through node.core.machine), in explicit time."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from murmur.gossip.identity import Identity
from murmur.node import pipe
from murmur.node.core import machine as C
from murmur.node.core import roles as R
from murmur.node.core import supervision as SV
from murmur.node.core.rewards import RewardBook, informative_rewards
from murmur.node.pipe import WorkerState
from murmur.sync.ids import Relation, lineage_id
from murmur.training.sampler import Group
from tests.test_core import BASE, W, announce, demand, key, make_core, manifest, of
from tests.test_sealing import rollout

D = R.Demand(rollouts_per_step=32, step_time_s=2.0, max_staleness=4)  # needs 1.2 * 32 / 2 = 19.2 rollouts/s
ME = R.Offer("me", rollouts_per_s=16.0, rollout_latency_s=0.5)
OWN = (0.3, b"\x10" * 32)  # its own lineage's verified reward, and id


def opt(
    lid: bytes = b"\x20" * 32,
    supply: float = 0.0,
    reward: float | None = 0.5,
    standby: bool = False,
    d: R.Demand = D,
) -> R.PodOption:
    return R.PodOption(lid, d, supply, standby, reward)


# ---------------------------------------------------------------- the rule


def test_a_node_follows_while_a_lineage_is_short_and_trains_once_every_demand_is_met() -> None:
    mode, why, lineage = R.want_mode("trainer", [opt(supply=5.0)], ME, OWN)
    assert lineage == b"\x20" * 32
    assert mode == "follower" and "14.2 rollouts/s short" in why
    assert R.want_mode("trainer", [opt(supply=19.2)], ME, OWN)[0] == "trainer"  # met
    assert R.want_mode("trainer", [], ME, OWN)[0] == "trainer"  # nothing published: train
    # a follower keeps generating while its lineage is short without it (the core takes its own share out)
    assert R.want_mode("follower", [opt(supply=16.0)], ME, None)[0] == "follower"
    assert R.want_mode("follower", [opt(supply=20.0)], ME, None)[0] == "trainer"
    # the largest unmet demand names the lineage it would serve
    assert "lineage 30303030" in R.want_mode("trainer", [opt(supply=10.0), opt(b"\x30" * 32)], ME, OWN)[1]
    # (among lineages whose work scores alike)


def test_a_trainer_leaves_its_lineage_only_for_a_gap_worth_its_while() -> None:
    small = 0.9 * R.FOLLOW_SHARE * ME.rollouts_per_s
    assert R.want_mode("trainer", [opt(supply=19.2 - small)], ME, OWN)[0] == "trainer"
    assert R.want_mode("follower", [opt(supply=19.2 - small)], ME, None)[0] == "follower"  # it stays for it


def test_only_lineages_it_can_serve_count() -> None:
    assert R.want_mode("trainer", [opt(standby=True)], ME, OWN)[0] == "trainer"  # told to stand by
    slow = R.Offer("me", 16.0, rollout_latency_s=30.0)  # 1 + ceil(30 / 2) versions stale > 4
    assert R.want_mode("trainer", [opt()], slow, OWN)[0] == "trainer"
    unmeasured = R.Demand(32, 0.0, 4)  # a trainer that has not measured a step asks for nothing yet
    assert R.want_mode("trainer", [opt(d=unmeasured)], ME, OWN)[0] == "trainer"


def test_a_trainer_follows_only_a_lineage_whose_verified_work_scores_above_its_own_and_keeps_a_pod_it_leads() -> None:
    assert R.want_mode("trainer", [opt(reward=0.2)], ME, OWN)[0] == "trainer"
    assert R.want_mode("trainer", [opt(reward=None)], ME, OWN)[0] == "trainer"  # work it never verified
    assert R.want_mode("trainer", [opt(b"\x01" * 32, reward=0.3)], ME, OWN)[0] == "trainer"  # tie: by id
    assert R.want_mode("trainer", [opt(b"\x20" * 32, reward=0.3)], ME, OWN)[0] == "follower"
    assert R.want_mode("trainer", [opt(reward=0.0)], ME, (None, OWN[1]))[0] == "follower"  # its own unseen
    # of the short lineages it could follow, the best scoring, however short the others are
    best = opt(b"\x40" * 32, supply=15.0, reward=0.8)
    assert R.want_mode("trainer", [opt(reward=0.5), best], ME, OWN).lineage == best.lineage
    # of two trainers that see each other short, exactly one leaves its lineage: the one whose work scores lower
    a, b = (0.4, b"\x0a" * 32), (0.6, b"\x0b" * 32)
    a_sees, b_sees = opt(b[1], reward=b[0]), opt(a[1], reward=a[0])
    assert R.want_mode("trainer", [a_sees], ME, a)[0] == "follower"
    assert R.want_mode("trainer", [b_sees], ME, b)[0] == "trainer"
    mode, why, _ = R.want_mode("trainer", [opt()], ME, OWN, own_supply=12.0)
    assert mode == "trainer" and "followers" in why


def test_the_first_decision_waits_for_the_observation_and_a_switch_for_the_dwell() -> None:
    rule = R.PodRule("trainer", 0.0, observe_s=60.0, dwell_s=300.0)
    follow = ("follower", "short")
    train = ("trainer", "met")
    assert rule.step(59.0, follow) is None and rule.mode == "trainer" and "in 1 s" in rule.reason
    assert rule.step(60.0, follow) == "follower" and rule.switches == 1
    assert rule.step(359.0, train) is None and rule.mode == "follower"
    assert rule.step(360.0, train) == "trainer" and rule.reason == "met"
    jittered = R.PodRule("trainer", 0.0, observe_s=60.0, dwell_s=300.0, jitter=0.99)
    assert jittered.step(60.0, follow) is None  # its own share of ROLE_JITTER later than a node with none
    assert jittered.step(60.0 * (1 + R.ROLE_JITTER), follow) == "follower"


def test_a_flapping_announcer_cannot_switch_a_node_more_often_than_the_dwell_allows() -> None:
    rule = R.PodRule("trainer", 0.0, observe_s=60.0, dwell_s=300.0)
    t, switches = 0.0, 0
    while t < 3600.0:  # the swarm's need flips at every announce, for an hour
        wanted = R.want_mode(rule.mode, [opt(supply=0.0 if int(t / 2) % 2 else 100.0)], ME, OWN)
        switches += rule.step(t, wanted) is not None
        t += 2.0
    assert switches == rule.switches
    assert 2 <= switches <= 1 + math.floor((3600.0 - 60.0) / 300.0)


def test_a_node_refuses_to_follow_weights_it_measured_worse_than_its_own() -> None:
    own = R.Quality(0.55, 90)
    # a lineage a standard error of the difference behind still passes: the two readings may be one model
    assert R.not_worse(R.Quality(0.50, 90), own)
    assert not R.not_worse(R.Quality(0.20, 90), own)  # the adverse case: a fast-stepping, worse lineage
    assert not R.not_worse(R.Quality(0.50, 2000), R.Quality(0.55, 2000))  # more tasks, a smaller margin
    assert R.not_worse(R.Quality(0.0, 0), own) and R.not_worse(own, R.Quality(0.9, 0))  # nothing measured
    assert R.not_worse(R.Quality(math.nan, 90), own) is False  # a reading that is no number passes nothing
    # the refused lineage drops out of the choice for a dwell; the next short one is chosen instead
    rule = R.PodRule("trainer", 0.0, observe_s=60.0, dwell_s=300.0)
    bad, good = b"\x30" * 32, b"\x20" * 32
    wanted = R.want_mode("trainer", [opt(good, supply=10.0), opt(bad)], ME, OWN)
    assert wanted.lineage == bad and rule.next_at <= 60.0  # the observation is over: it may switch
    assert rule.refuse(bad, 60.0, "its weights measured 0.20 < my 0.55") is None  # a trainer stays one
    assert (
        R.want_mode("trainer", [opt(good, supply=10.0), opt(bad)], ME, OWN, refused=rule.refused(61.0)).lineage == good
    )
    assert rule.refused(359.0) == {bad} and rule.refused(360.0) == set()  # until a dwell has passed
    assert R.want_mode("trainer", [opt(bad)], ME, OWN, refused={bad}).mode == "trainer"


def test_a_follower_on_trial_goes_back_to_its_own_lineage_at_once_when_the_weights_it_took_measure_worse() -> None:
    rule = R.PodRule("trainer", 0.0, observe_s=60.0, dwell_s=300.0)
    assert rule.step(60.0, R.Wanted("follower", "short", b"\x30" * 32)) == "follower"
    # the trial's return waits for no dwell, and counts as a switch: after it, the dwell holds again
    assert rule.refuse(b"\x30" * 32, 70.0, "worse") == "trainer" and rule.mode == "trainer"
    assert rule.switches == 2 and "worse" in rule.reason
    assert rule.step(80.0, R.Wanted("follower", "short", b"\x20" * 32)) is None and rule.next_at == 370.0
    assert rule.refuse(b"\x20" * 32, 90.0, "worse") is None  # a trainer refusing a lineage stays put


def test_configured_roles_win() -> None:
    assert not R.chooses_mode(["trainer"], ["trainer"])
    assert not R.chooses_mode([], ["follower", "validator"])  # too little memory to train: no choice
    assert R.chooses_mode([], ["trainer", "validator"])
    assert R.switch_roles(["trainer", "validator"], "follower") == ["follower", "validator"]
    assert R.switch_roles(["follower"], "trainer") == ["trainer"]


# ---------------------------------------------------------------- the core


class Publisher:
    """Another trainer's lineage, as this node hears it: signed announces (its demand and supply) and, unless
    `manifests` is off, signed manifests, a version every `every` seconds."""

    def __init__(
        self, ident: Identity, name: str = "lin", manifests: bool = True, every: float = 2.0, rollouts: int = 32
    ) -> None:
        self.ident, self.name, self.manifests, self.every, self.rollouts = ident, name, manifests, every, rollouts
        self.last = -math.inf
        self.lid = lineage_id(ident.public, BASE, name)
        self.head, self.seq = 20, 0

    def publish(self, core: C.NodeCore, now: float, supply: float = 0.0) -> None:
        self.seq += 1
        if now - self.last >= self.every:  # a new signed version
            self.last = now
            self.head += 1
        if self.manifests:
            core.handle(C.ManifestHeard(manifest(self.ident, self.name, self.head - 1, self.head)))
        core.handle(
            announce(self.ident, self.seq, [demand(self.lid, self.name, self.head, 2.0, self.rollouts, supply=supply)])
        )


def auto_core(roles=("trainer",), seed: int = 1, **kw) -> tuple[C.NodeCore, object]:
    core, clock = make_core(roles=roles, seed=seed, choose_mode=True, role_observe_s=60.0, role_dwell_s=300.0, **kw)
    me = key(seed)
    core.handle(
        W(
            "ready",
            {"base": BASE.hex(), "lineage": lineage_id(me.public, BASE, "mine").hex(), "name": "mine", "version": 2},
        )
    )
    # it generates 16 rollouts/s, as much as a trainer asks for (1.2 * 32 rollouts a 2 s version is 19.2/s)
    core.handle(W("perf", {"gen_tokens_per_s": 16.0 * core.tokens_per_rollout, "rollout_latency_s": 0.5}))
    return core, clock


def run(core: C.NodeCore, clock, pubs: list[Publisher], seconds: float, supply=lambda t: 0.0) -> list:
    acts: list = []
    end = clock.t + seconds
    while clock.t < end:
        clock.t += 2.0
        for p in pubs:
            p.publish(core, clock.t, supply(clock.t))
        acts += core.handle(C.Tick())
    return acts


def test_the_core_switches_its_worker_to_follow_a_short_lineage_keeping_what_it_holds() -> None:
    core, clock = auto_core(roles=("trainer", "validator"))
    own = core.own
    p = Publisher(key(9))
    acts = run(core, clock, [p], 40.0)
    assert of(acts, C.RestartWorker) == [] and core.roles == ["trainer", "validator"]  # still observing
    acts = run(core, clock, [p], 60.0)
    assert of(acts, C.RestartWorker) == [C.RestartWorker(0.0, ("follower", "validator"))]
    assert core.roles == ["follower", "validator"] and core.stats()["role_switches"] == 1
    assert [a.fields["roles"] for a in of(acts, C.Log) if a.msg == "role"] == [["follower", "validator"]]
    assert "short" in core.role_reason and core.serving == p.lid
    assert core.own == own and core.lineages[own].relation == Relation.OWN  # its lineage's history stays
    # the old worker, still busy with its step, reports its state, then is killed at the end of its grace: that
    # exit is the planned restart, not a crash (no second restart, no backoff)
    core.handle(C.FromWorker(pipe.State(WorkerState.TRAINING)))
    assert of(core.handle(C.WorkerExited(-15)), C.RestartWorker) == []
    assert core.stats()["worker_restarts"] == 0
    core.handle(C.WorkerStarted())
    core.handle(W("ready", {"base": BASE.hex(), "version": 0}))
    clock.t += C.ANNOUNCE_EVERY_S
    acts = core.handle(C.Tick())
    env = C.wire.decode_envelope(of(acts, C.Publish)[0].data, swarm="t")
    a = C.wire.decode_struct(env.body, C.wire.NodeAnnounce, 1 << 16)
    assert a.owned == [] and a.roles == ["follower", "validator"]  # it asks no one to generate for it now
    # once the lineage's trainer signs enough supply without us, it trains again, after the dwell
    acts = run(core, clock, [p], 200.0, supply=lambda t: 100.0)
    assert of(acts, C.RestartWorker) == []
    acts = run(core, clock, [p], 200.0, supply=lambda t: 100.0)
    assert of(acts, C.RestartWorker) == [C.RestartWorker(0.0, ("trainer", "validator"))]
    assert core.serving is None and core.committed is None


def scored(core: C.NodeCore, clock, p: Publisher, theirs: float, own: float = 0.4) -> None:
    """`p`'s lineage published, and its rollouts, signed by its publisher, verified scoring `theirs`; our own
    lineage's, sealed by the core from our worker, scoring `own` (groups of five, informative)."""
    run(core, clock, [p], 4.0)
    core.handle(C.RolloutsVerified(p.ident.peer_id, ((p.lid, 64),), rewards=((p.lid, (theirs,) * 64),)))
    right = round(own * 5)
    core.handle(W("rollouts", [rollout(core.own, seed=s, reward=float(i < right)) for s in range(8) for i in range(5)]))
    assert core.verified_rewards.mean(p.lid) == pytest.approx(theirs)
    assert core.verified_rewards.mean(core.own) == pytest.approx(own)


def _left_for(p: Publisher, own_acc: float, theirs: float = 0.5) -> tuple[C.NodeCore, object]:
    """A core that measured its own lineage at `own_acc` (90 tasks) and verified `p`'s rollouts scoring
    `theirs` against its own 0.4, then left its lineage to follow `p`, whose first version it now holds."""
    core, clock = auto_core()
    scored(core, clock, p, theirs)
    core.handle(
        W(
            "step",
            {"step": 1, "version": 2, "reward_mean": 0.5, "loss": 0.1, "n_external_groups": 0, "step_s": 2.0}
            | {"heldout": own_acc, "heldout_tasks": 90},
        )
    )
    acts = run(core, clock, [p], 100.0)
    assert of(acts, C.RestartWorker) == [C.RestartWorker(0.0, ("follower",))]
    core.handle(C.WorkerStarted())
    core.handle(W("ready", {"base": BASE.hex(), "version": 0}))
    core.handle(W("applied", {"lineage": p.lid.hex(), "version": p.head}))
    assert core.committed == p.lid
    return core, clock


def test_a_core_on_trial_of_worse_weights_goes_back_to_its_own_lineage_and_passes_that_lineage_over() -> None:
    # the attack: a publisher whose verified rollouts score best (it sends only its best groups) draws the node
    # to try its lineage; the weights themselves, measured by the node, send it back
    p = Publisher(key(9))
    core, clock = _left_for(p, 0.60, theirs=0.9)
    # the first held-out reading of what it holds: far below its own lineage's
    acts = core.handle(W("gen", {"reward_mean": 0.3, "version": p.head, "heldout": 0.20, "heldout_tasks": 90}))
    assert of(acts, C.RestartWorker) == [C.RestartWorker(0.0, ("trainer",))]
    assert core.stats()["trials_refused"] == 1 and core.stats()["role_switches"] == 2
    assert "measured 0.20 < my own 0.60" in core.role_reason
    # the lineage stays short of rollouts, yet it is no option for this node for a dwell
    acts = run(core, clock, [p], 250.0)
    assert of(acts, C.RestartWorker) == [] and core.roles == ["trainer"]


def test_a_core_on_trial_of_weights_as_good_as_its_own_keeps_following() -> None:
    p = Publisher(key(9))
    core, clock = _left_for(p, 0.60)
    acts = core.handle(W("gen", {"reward_mean": 0.3, "version": p.head, "heldout": 0.57, "heldout_tasks": 90}))
    assert of(acts, C.RestartWorker) == [] and core.roles == ["follower"]
    # the trial is over: a later, worse reading (the lineage may dip) moves nothing before the dwell
    acts = core.handle(W("gen", {"reward_mean": 0.3, "version": p.head, "heldout": 0.10, "heldout_tasks": 90}))
    assert of(acts, C.RestartWorker) == [] and core.stats()["trials_refused"] == 0


def test_a_trainer_core_stays_when_the_lineage_it_could_follow_scores_below_its_own() -> None:
    p = Publisher(key(9))
    core, clock = auto_core()
    scored(core, clock, p, 0.1)
    # a stranger's rollouts labelled with our lineage (or p's) move neither score: only a publisher's own count
    for lid in (core.own, p.lid):
        core.handle(C.RolloutsVerified(key(5).peer_id, ((lid, 64),), rewards=((lid, (1.0,) * 64),)))
    assert core.verified_rewards.mean(p.lid) == pytest.approx(0.1)
    assert core.verified_rewards.mean(core.own) == pytest.approx(0.4)
    acts = run(core, clock, [p], 200.0)
    assert of(acts, C.RestartWorker) == [] and core.roles == ["trainer"]
    assert "short of rollouts: train my own" in core.role_reason


def test_the_reward_book_keeps_a_window_of_sane_rewards_for_a_bounded_number_of_lineages() -> None:
    book = RewardBook(max_lineages=2, window=4)
    book.add(b"a", [1.0, 0.0, math.nan, math.inf, -1.0, 7.0])  # only numbers a verifier can give count
    assert book.mean(b"a") == 0.5 and book.mean(b"z") is None
    book.add(b"a", [1.0, 1.0, 1.0, 1.0])
    assert book.mean(b"a") == 1.0  # the latest window only
    book.add(b"b", [0.0])
    book.add(b"c", [0.0])  # a third lineage: the one updated longest ago goes
    assert book.mean(b"a") is None and len(book.rows) == 2

    def rollout(reward: float):  # what the book reads of a verified rollout
        return SimpleNamespace(reward=reward)

    groups = [
        Group((b"t", "g", 1), b"l", 0, (rollout(1.0), rollout(0.0))),
        Group((b"t", "g", 2), b"l", 0, (rollout(1.0), rollout(1.0)), uniform=True),  # kept for a schedule
    ]
    assert informative_rewards(groups) == {b"l": [1.0, 0.0]}


def test_configured_roles_never_switch() -> None:
    core, clock = make_core(roles=("trainer",))
    core.handle(
        W(
            "ready",
            {
                "base": BASE.hex(),
                "lineage": lineage_id(key(1).public, BASE, "mine").hex(),
                "name": "mine",
                "version": 2,
            },
        )
    )
    acts = run(core, clock, [Publisher(key(9))], 600.0)
    assert of(acts, C.RestartWorker) == [] and core.roles == ["trainer"] and core.role_reason == ""


def test_a_lying_announcer_attracts_no_node() -> None:
    """Announces alone (no signed manifest: nothing published) claiming a huge demand and a rising head pull
    no node; neither does a follower's own claim of throughput, which no trainer signed."""
    core, clock = auto_core()
    liar = Publisher(key(9), manifests=False)
    acts = run(core, clock, [liar], 900.0, supply=lambda t: 0.0)
    assert of(acts, C.RestartWorker) == [] and core.roles == ["trainer"]
    assert "no published lineage" in core.role_reason
    # published, claiming a version every 2 s of 100 rollouts (60 rollouts/s), but signing one a minute: what it
    # may ask for is bounded by that cadence, too little to take a trainer from its own lineage
    core, clock = auto_core()
    slow = Publisher(key(9), every=60.0, rollouts=100)
    acts = run(core, clock, [slow], 900.0, supply=lambda t: 0.0)
    assert of(acts, C.RestartWorker) == [] and core.roles == ["trainer"]
    fast = Publisher(key(9), every=2.0, rollouts=100)  # the same claim, backed by its cadence: it pulls the node
    core, clock = auto_core()
    assert of(run(core, clock, [fast], 900.0), C.RestartWorker)


def test_a_lying_announcer_stands_no_follower_by() -> None:
    """A key that is not the lineage's publisher signing a huge supply for it is refused: the follower keeps
    generating for the lineage its trainer says is short."""
    core, clock = auto_core()
    p = Publisher(key(9))
    run(core, clock, [p], 100.0)
    assert core.roles == ["follower"]
    forger, boaster = key(8), key(7)
    heard: list = []

    def forged(t: float) -> float:
        heard.extend(core.handle(announce(forger, int(t), [demand(p.lid, "lin", p.head + 1, supply=1e6)])))
        heard.extend(core.handle(announce(boaster, int(t), serving=p.lid, roles=("follower",), gen_tps=1e9)))
        return 0.0

    acts = run(core, clock, [p], 900.0, supply=forged)
    assert of(acts, C.RestartWorker) == [] and core.roles == ["follower"]
    assert {a.peer for a in of(heard, C.Penalise)} == {forger.peer_id}  # the forged claim costs its signer


def test_a_flapping_publisher_cannot_switch_the_core_more_often_than_its_dwell() -> None:
    core, clock = auto_core()
    p = Publisher(key(9))
    hour = 3600.0
    acts = run(core, clock, [p], hour, supply=lambda t: 0.0 if int(t / 2) % 2 else 100.0)
    switches = len(of(acts, C.RestartWorker))
    stretch = core.pods.stretch
    assert switches == core.stats()["role_switches"] >= 1
    assert switches <= 1 + math.floor((hour - 60.0 * stretch) / (300.0 * stretch))
    assert core.stats()["worker_restarts"] == 0  # planned restarts are not failures


def test_a_planned_restart_leaves_the_crash_backoff_as_it_was() -> None:
    sup = SV.WorkerSupervisor(0.0)
    out: list = []
    sup.restart_for(1.0, out)
    assert sup.on_exit(0, 1.5, out) is False and sup.restarts == 0
    sup.on_started(2.0)
    assert sup.on_exit(1, 3.0, out) is True and sup.restarts == 1
    assert of(out, C.RestartWorker) == [C.RestartWorker(SV.RESTART_BACKOFF_S[0])]


# ---------------------------------------------------------------- the simulator runs the same rule

PODS = """
name = "pods"
seed = 3
duration_s = 150.0
[[group]]
count = 6
role = "auto"
[training]
step_s = 2.0
[sync]
patch_bytes = 131072
chunk_bytes = 16384
broadcasts = 1
[report]
plots = false
"""


def test_identical_nodes_with_default_roles_form_pods_in_the_simulator(tmp_path) -> None:
    from murmur.simulations import scenario as S
    from murmur.simulations.virtual import run_virtual

    s = run_virtual(S.loads(PODS, "pods.toml"), tmp_path)
    pods = s["pods"]
    assert pods["auto_nodes"] == 6 and pods["role_switches"] >= 1
    assert 0 <= pods["trials_refused"] <= pods["role_switches"] // 2  # each one a switch out and one back
    # not six lone lineages: at least one trainer whose followers generate for it, every node in a role
    assert 1 <= pods["pods"] and pods["trainers"] < 6
    assert pods["trainers"] + pods["followers_per_trainer"] * pods["trainers"] + pods["followers_unattached"] == 6
    assert pods["largest_pod"] >= 1 and s["cores"]["followers_serving"] >= 1
