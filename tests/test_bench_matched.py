"""`murmur bench swarm --matched`: the reach and interval arithmetic by hand, and a tiny paired run
through the real trainers and pipelines in which every node of both arms spends the same CPU."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from murmur.simulations import curves
from murmur.simulations.bench import matched as bm
from murmur.training.pod import PodYield

WARM = 40  # warm-up steps after which murmur-tiny makes informative groups and uninformative ones


def test_first_reach_by_hand() -> None:
    xs = [0.0, 2.0, 4.0, 6.0]
    assert curves.first_reach(xs, [0.1, 0.2, 0.4, 0.5], 0.3) == 3.0  # between the checkpoints around it
    assert curves.first_reach(xs, [0.5, 0.2, 0.4, 0.5], 0.3) == 3.0  # the start does not count
    assert curves.first_reach(xs, [0.1, 0.4, 0.4, 0.5], 0.3) == 2.0  # reached at the first checkpoint
    assert curves.first_reach(xs, [0.1, 0.2, 0.2, 0.2], 0.3) is None
    assert curves.auc([0.0, 1.0, 2.0], [0.0, 1.0, 1.0]) == 0.75


def test_bootstrap_interval_contains_the_mean_and_narrows_with_agreement() -> None:
    lo, hi = bm.bootstrap_ci([1.0, 1.2, 0.8, 1.1, 0.9], random.Random(0))
    assert lo <= 1.0 <= hi and hi - lo < 0.4
    lo2, hi2 = bm.bootstrap_ci([1.0] * 5, random.Random(0))
    assert lo2 == hi2 == 1.0


def test_a_tiny_paired_run_spends_equal_cpu_per_node(tmp_path: Path) -> None:
    r = bm.run_seed(2, 0, 0.6, 2, 2, home=str(tmp_path), warmup_steps=2)
    json.dumps(r)
    for arm in ("isolated", "swarm"):
        cpus = r["cpu_per_node"][arm]
        assert len(cpus) == 2 and min(cpus) >= 0.6  # each node stepped until it had spent the budget
        assert len(r["curves"][arm]) == 3  # the start and two equal-CPU checkpoints
    assert r["curves"]["cpu_s"] == [0.0, 0.3, 0.6]
    assert r["curves"]["isolated"][0] == r["curves"]["swarm"][0]  # paired: the same nodes start both arms
    assert r["speedup"] > 0 and r["used_over_verified"] is not None and 0 <= r["used_over_verified"] <= 1
    assert all(len(r["updates_per_node"][arm]) == 2 for arm in ("isolated", "swarm"))
    for arm in ("isolated", "swarm"):  # the last checkpoint, per family, means over the nodes
        assert set(r["final_wellformed"][arm]) == {"lookup", "rev", "sort"}
        assert r["final_by_family"][arm]["all"] == r["curves"][arm][-1]
        assert all(0 <= v <= 1 for v in r["final_wellformed"][arm].values())


def test_same_start_gives_every_node_one_warm_up_and_its_own_sampling(tmp_path: Path) -> None:
    def weights(same: bool) -> list[list[float]]:
        ns, _, _ = bm.make_nodes(3, 0, tmp_path, 2, "short", 2, 16, False, same_start=same)
        return [[float(v.float().sum()) for v in n.engine.model.state_dict().values()] for n in ns]

    same, own = weights(True), weights(False)
    assert same[0] == same[1] == same[2] == own[0]  # node 0's warm-up
    assert own[1] != own[0] and own[2] != own[0]
    assert (
        len({n.trainer.cfg.seed for n in bm.make_nodes(3, 0, tmp_path, 2, "short", 2, 16, False, same_start=True)[0]})
        == 3
    )


def test_a_trainer_with_followers_verifies_and_pools_their_informative_groups_on_its_own_cpu(tmp_path: Path) -> None:
    # warmed up enough that some groups are informative and some not
    r = bm.run_seed(2, 0, 0.6, 2, 2, home=str(tmp_path), warmup_steps=WARM, followers=2)
    assert len(r["cpu_per_node"]["swarm"]) == 1 and r["cpu_per_node"]["swarm"][0] >= 0.6  # the trainer only
    assert r["curves"]["isolated"][0] == r["curves"]["swarm"][0]  # paired: the same trainer alone
    # every trainer step, each follower generated I groups and sent only the informative ones (a node's sealer
    # keeps the rest local), all of which verified and entered the pool
    steps = r["steps_per_node"]["swarm"][0]
    g = r["groups"]["swarm"]
    # its followers' I a step each, and the trainer's own: I less what their informative groups stand for
    # (pod_yield), never below its floor
    i, floor = bm.TRAINER["local_groups"], PodYield(bm.TRAINER["local_groups"]).floor
    assert 2 * steps * i + steps * floor <= g["generated"] <= (1 + 2) * steps * i
    assert 0 < g["sent"] < 2 * steps * i  # some were uninformative (a barely warm model)
    assert r["sampler"]["added"] == g["sent"] and r["sampler"]["uninformative"] == 0
    assert r["verified_per_node"][0] == g["sent"] * bm.TRAINER["group_size"]
    assert 0 < g["trained"] <= r["groups"]["isolated"]["generated"] + g["sent"]
    assert r["groups"]["isolated"]["sent"] == 0  # alone, it sends nothing


def test_peers_on_the_shared_schedule_pool_their_answers_and_the_arm_counts_the_pooled_groups(tmp_path: Path) -> None:
    """Two peers drawing every prompt from the shared schedule answer the same prompts, in the same order, so
    each one's groups join the other's own groups of the same task: the arm counts them (off the schedule
    none meets: the adversary test above)."""
    on = bm.run_arm(True, 2, 0, 0.6, 1, 2, tmp_path, warmup_steps=WARM, schedule_share=1.0)
    g = on["groups"]
    assert 0 < g["pooled"] <= g["trained"] and 0 <= g["rescued"] <= g["pooled"]


def test_a_pods_trainer_with_select_groups_trains_at_most_that_many_groups_a_step(tmp_path: Path) -> None:
    m = bm.TRAINER["minibatch_groups"]  # one update a step at most: the rest of a step's groups are not trained
    r = bm.run_arm(
        True, 1, 0, 0.6, 1, 2, tmp_path, warmup_steps=WARM, followers=1, select_groups=m, follower_oversample=1.5
    )
    g, steps = r["groups"], r["steps_per_node"][0]
    assert r["updates_per_node"][0] <= steps and g["trained"] == m * r["updates_per_node"][0]
    i, floor = bm.TRAINER["local_groups"], PodYield(bm.TRAINER["local_groups"]).floor
    follower = steps * int(1.5 * i)  # the follower's 1.5 I a step; the trainer's own from its floor to I
    assert follower + steps * floor <= g["generated"] <= follower + steps * i and 0 < g["sent"] <= g["generated"]
    ns, _, _ = bm.make_nodes(1, 0, tmp_path, WARM, "short", 2, 16, True, select_groups=3)
    assert ns[0].trainer.cfg.select_groups == 3  # the arm's trainers run it
    ns, _, _ = bm.make_nodes(1, 0, tmp_path, WARM, "short", 2, 16, True, foreign={"foreign_share_max": 0.0})
    assert ns[0].trainer.cfg.foreign_share_max == 0.0  # and the foreign keys' values (--foreign)


def test_the_adversarys_rows_pass_every_check_and_its_forged_batches_do_not(tmp_path: Path) -> None:
    from murmur.gossip.validation import Pipeline, PipelineConfig, Reason
    from murmur.gossip.wire import now_ms
    from murmur.simulations.bench.swarm import SWARM
    from murmur.simulations.bench.useless import CLAIMED_LOGPROB, claim_low_logprobs, forge, informative, misschedule
    from murmur.training.engine_hf import HFEngine
    from murmur.training.rollouts import logprobs_from_bytes
    from murmur.training.schedule import ScheduleBook, round_at
    from murmur.training.tasksets import TaskRegistry, train_generators
    from murmur.training.tiny import ensure_tiny
    from murmur.training.tokencheck import for_model
    from murmur.training.tokenizer import TINY_NAME
    from murmur.training.verifiers import score

    reg = TaskRegistry(SWARM)
    reg.add_builtin()
    engine = HFEngine.from_path(ensure_tiny(tmp_path, seed=1, warmup_steps=2), device="cpu", seed=1)
    adv = bm._Adversary(0, engine)
    gens = train_generators(reg.get(reg.builtin_id))
    rows = bm._follower_rollouts(engine, gens, reg.builtin_id, reg.resolve, random.Random(0), adv.node.lineage, 1, 8)
    size = bm.TRAINER["group_size"]
    kept = informative(rows)
    assert all(len({r.reward for r in kept[k : k + size]}) > 1 for k in range(0, len(kept), size))
    dropped = [
        rows[k : k + size] for k in range(0, len(rows), size) if len({r.reward for r in rows[k : k + size]}) == 1
    ]
    assert len(kept) + size * len(dropped) == len(rows)
    claimed = claim_low_logprobs(kept or rows[:size])
    assert all(set(logprobs_from_bytes(r.logprobs)) == {CLAIMED_LOGPROB} for r in claimed)
    pipe = Pipeline(
        PipelineConfig(
            swarm=SWARM,
            max_staleness=4,
            rate_per_s=1e6,
            burst=10**6,
            max_completion_tokens=bm.TRAINER["max_new_tokens"],
        ),
        clock=time.time,
        resolve_task=reg.resolve,
        reward=score,
        head_version=lambda _: 1,
        task_set_trusted=reg.__contains__,
        check_tokens=for_model(TINY_NAME),
        schedule=ScheduleBook.of(reg),
    )
    peer = adv.node.ident.peer_id
    assert pipe.check(bm._seal(adv.node, claimed)[0], peer).reason is Reason.ACCEPTED  # nothing provably wrong
    assert pipe.check(bm._seal(adv.node, forge(claimed, size))[0], peer).reason is Reason.FORGED_REWARD
    sybil = bm._Adversary(1, engine).node  # the forger's key is banned now; each bad batch goes out under a fresh one
    late = misschedule(claim_low_logprobs(kept or rows[:size]), round_at(now_ms()))
    assert pipe.check(bm._seal(sybil, late)[0], sybil.ident.peer_id).reason is Reason.MISSCHEDULED


def test_in_a_swarm_with_the_adversary_no_provably_bad_row_is_trained_on(tmp_path: Path) -> None:
    r = bm.run_seed(3, 0, 1.2, 1, 2, home=str(tmp_path), warmup_steps=2, adversary=True)
    json.dumps(r)
    adv = r["adversary"]
    assert len(r["cpu_per_node"]["swarm"]) == 2 and len(r["cpu_per_node"]["isolated"]) == 2  # N - 1 honest nodes
    assert r["curves"]["isolated"][0] == r["curves"]["swarm"][0]  # paired on the honest nodes
    # a forge turn with no informative group sends nothing; turns alternate a forged reward and a false claim
    # of the schedule, the forged reward first
    assert 1 <= adv["forged_batches"] and adv["misscheduled_batches"] <= adv["forged_batches"]
    assert adv["forged_batches"] + adv["misscheduled_batches"] <= adv["batches"] // 4
    assert adv["rejected"] == 2 * adv["forged_batches"]  # every forgery refused by both honest nodes
    assert adv["rejected_misscheduled"] == 2 * adv["misscheduled_batches"]  # and every false schedule claim
    assert adv["provably_bad_rows_taken"] == 0
    assert 0 < r["generation_share"]["isolated"] < 1
    # off the shared schedule (share 0) peers' tasks are drawn freely: none meets an own group's
    assert r["groups"]["swarm"]["pooled"] == 0 and r["groups"]["swarm"]["trained"] > 0


def test_the_worked_regime_trains_on_the_worked_set_and_reports_its_generation_share(tmp_path: Path) -> None:
    # the pod arm alone (the paired runs above cover the arms' pairing): one trainer step, one follower batch
    r = bm.run_arm(True, 1, 0, 0.3, 1, 2, tmp_path, warmup_steps=2, followers=1, answers="worked")
    assert r["eval_tasks"] == 2 and set(r["final_wellformed"]) == {"chain"}  # chain-eval's first 2 seeds
    assert r["groups"]["generated"] >= 2 * bm.TRAINER["local_groups"]  # the trainer's step and the follower's batch
    assert r["verified_per_node"][0] == r["groups"]["sent"] * bm.TRAINER["group_size"]  # all it sent verified
    assert 0 < r["generation_share"] <= 1  # measured from the trainer's steps: a share of their CPU
    # the follower's completions are as long as the regime's (up to 80 tokens, over the short regime's 8) and
    # the trainer's pipeline, whose token budget is the regime's, accepts them: one batch sealed whole (the arm
    # sends informative groups only, which a model warmed up 2 steps may not make)
    from murmur.training.tasksets import train_generators

    ns, _, _ = bm.make_nodes(1, 0, tmp_path, 2, "worked", 2, 16, True)
    t = ns[0].trainer
    rows = bm._follower_rollouts(
        ns[0].engine,
        train_generators(t.registry.get(t.task_set)),
        t.task_set,
        t.registry.resolve,
        random.Random(0),
        ns[0].lineage,
        0,
        1,
        bm.WORKED_NEW_TOKENS,
    )
    assert max(len(r.completion_ids) for r in rows) > bm.TRAINER["max_new_tokens"]
    fol = bm._Node(50, bm._ident(0, 50), ns[0].lineage, None, None, None, None)
    assert ns[0].pipeline is not None and ns[0].pipeline.check(bm._seal(fol, rows)[0], fol.ident.peer_id).accepted
    assert bm.trainer_shape("worked")["max_new_tokens"] == bm.WORKED_NEW_TOKENS > bm.TRAINER["max_new_tokens"]


def test_the_page_shows_each_arms_mean_curve_with_its_interval_and_who_trained_on_what(tmp_path: Path) -> None:
    from murmur.simulations.bench.matched_page import accuracy_bands, write_page

    per = [bm.run_seed(2, s, 0.6, 2, 2, home=str(tmp_path / "home"), warmup_steps=2) for s in (0, 1)]
    result = bm.summarise(
        per, nodes=2, followers=0, adversary=False, cpu_s=0.6, answers="short", checkpoints=2, seed=0, warmup=2
    )
    assert result["seeds"] == [0, 1] and result["speedup"] == round((per[0]["speedup"] + per[1]["speedup"]) / 2, 4)
    for arm in ("isolated", "swarm"):
        b = accuracy_bands(result, arm)
        assert b["cpu_s"] == per[0]["curves"]["cpu_s"]
        for k in range(len(b["cpu_s"])):
            ys = [r["curves"][arm][k] for r in per]
            assert abs(b["mean"][k] - sum(ys) / 2) < 1e-9
            assert min(ys) - 1e-9 <= b["lo"][k] <= b["mean"][k] <= b["hi"][k] <= max(ys) + 1e-9
    page = write_page(result, tmp_path / "out")
    text = page.read_text()
    for name in ("accuracy.png", "generation_share.png", "result.json"):
        assert f'"{name}"' in text
        assert (tmp_path / "out" / name).stat().st_size > 1000 or name == "result.json"
    assert json.loads((tmp_path / "out" / "result.json").read_text()) == json.loads(json.dumps(result))
    assert f"Speedup to the alone arm's final accuracy: {result['speedup']}" in text
    assert f"{per[1]['updates_per_node']['isolated']} → {per[1]['updates_per_node']['swarm']}" in text
    g = per[1]["groups"]["swarm"]
    assert f"{g['generated']} / {g['sent']} / {g['trained']}" in text  # the swarm arm's groups, per seed
    assert result["groups"]["swarm"]["generated"] == sum(r["groups"]["swarm"]["generated"] for r in per)


def test_default_roles_form_pods_by_the_nodes_own_rule_at_equal_cpu_beside_the_adversary(tmp_path: Path) -> None:
    """Nothing forced: every node starts as a trainer and the node's rule (`node.core.roles.want_mode` with its
    dwell and its trial) moves some to generate for a published lineage short of rollouts; a follower's rollouts reach its
    trainer through its pipeline, and every node still spends the same CPU. One node in four is the
    adversary: every node that trains verifies its batches, and no row of a provably bad batch (a forged
    reward or a false schedule claim) enters an update."""
    from murmur.simulations.bench.matched_auto import DWELL_SHARE

    cpu_s = 1.5
    r = bm.run_seed(4, 0, cpu_s, 2, 2, home=str(tmp_path), warmup_steps=2, default_roles=True, adversary=True)
    json.dumps(r)
    roles = r["roles"]
    assert len(roles["final"]) == 3 and len(r["cpu_per_node"]["isolated"]) == 3  # N - 1 honest nodes
    assert sorted(set(roles["final"])) == ["follower", "trainer"], roles
    for i, mode in enumerate(roles["final"]):
        if mode == "follower":
            assert roles["follower_rollouts"][i] > 0
            assert any(i in f for f in roles["pods"].values())
    # every node that left its lineage took the other on trial, measuring both on its own CPU; a refused trial
    # is a switch back at once, and otherwise the dwell holds: at most one switch per dwell after the first choice
    for i, hist in enumerate(roles["history"]):
        assert roles["trials"][i] == sum(mode == "follower" for _, mode, _ in hist) >= roles["refused"][i]
        assert roles["refused"][i] == sum("measured" in why for _, _, why in hist)
        assert roles["switches"][i] - roles["refused"][i] <= 1 + int(1 / DWELL_SHARE)
    trainers = [i for i, mode in enumerate(roles["final"]) if mode == "trainer"]
    assert sum(r["verified_per_node"][i] for i in trainers) > 0
    for arm in ("isolated", "swarm"):
        assert all(cpu_s <= c < cpu_s + 1.5 for c in r["cpu_per_node"][arm]), r["cpu_per_node"]
    adv = r["adversary"]
    assert adv["batches"] >= 4 and adv["provably_bad_rows_taken"] == 0
    # each bad batch reached at least one trainer, and every trainer that met one refused it
    assert adv["rejected"] >= adv["forged_batches"] >= 1
    assert adv["rejected_misscheduled"] >= adv["misscheduled_batches"]
