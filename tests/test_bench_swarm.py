"""`murmur bench swarm` machinery: scenario file, signed task set, and a 2-round run of all three arms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from murmur.gossip.errors import ConfigError
from murmur.simulations.bench import swarm as bench_swarm

REQUIRED = (
    "rounds",
    "isolated_cumulative_reward",
    "swarm_cumulative_reward",
    "adversarial_cumulative_reward",
    "gain_swarm",
    "gain_adversarial",
    "adversarial_accepted",
)


def test_packaged_scenario_is_the_issue_setup() -> None:
    sc, _ = bench_swarm.load_scenario()
    assert sc.nodes == 4
    assert (sc.isolated.local_groups, sc.isolated.external_groups) == (8, 0)
    assert (sc.swarm.local_groups, sc.swarm.external_groups) == (4, 4)
    # same rollouts per update in both arms: the comparison's fairness rests on this
    assert sc.isolated.local_groups + sc.isolated.external_groups == sc.swarm.local_groups + sc.swarm.external_groups
    assert sc.trainer.loss_norm == "informative"  # the node's default normalisation (node.config)
    a = sc.adversary
    assert a.forged_reward and a.bad_signature and a.garbage and a.bad_task


def test_task_set_is_signed_deterministic_and_verifiable() -> None:
    from murmur.training.tasksets import TaskRegistry, task_set_id

    sc, _ = bench_swarm.load_scenario()
    env = bench_swarm.bench_task_set(sc)
    assert env == bench_swarm.bench_task_set(sc)  # same id in every run and on every node
    reg = TaskRegistry(bench_swarm.SWARM)
    m = reg.add(env, {bench_swarm.COORDINATOR.public})
    assert {g.name for g in m.generators} == {g.name for g in sc.task_set.generators}
    assert task_set_id(env, swarm=bench_swarm.SWARM) in reg
    from murmur.gossip.errors import SignatureError

    with pytest.raises(SignatureError):
        TaskRegistry(bench_swarm.SWARM).add(env, set())  # not trusted without the coordinator


def test_scenario_rejects_unknown_keys_and_bad_adversary(tmp_path: Path) -> None:
    text = (
        bench_swarm.resources.files("murmur.simulations").joinpath("scenarios", "bench_swarm.toml").read_text("utf-8")
    )
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("inbox_groups = 64", "inbox_groups = 64\nturbo = true"))
    with pytest.raises(ConfigError, match="turbo"):
        bench_swarm.load_scenario(bad)
    bad.write_text(text.replace('loss_norm = "informative"', 'loss_norm = "tokens"'))
    with pytest.raises(ConfigError, match="loss_norm"):
        bench_swarm.load_scenario(bad)
    bad.write_text(text.replace("node = 3", "node = 9"))
    with pytest.raises(ConfigError, match="adversary"):
        bench_swarm.load_scenario(bad)
    with pytest.raises(ConfigError):
        bench_swarm.load_scenario(tmp_path / "missing.toml")


def _small_scenario(tmp_path: Path) -> Path:
    """Small and fast (2-step warm-up, groups of 4), same code path as the full benchmark."""
    text = (
        bench_swarm.resources.files("murmur.simulations").joinpath("scenarios", "bench_swarm.toml").read_text("utf-8")
    )
    small = tmp_path / "small.toml"
    small.write_text(
        text.replace("model_warmup_steps = 60", "model_warmup_steps = 2").replace("group_size = 8", "group_size = 4")
    )
    return small


@pytest.fixture(scope="module")
def seed0_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One model home for this module's seed-0 runs, which would each build the same seed-0 model."""
    return str(tmp_path_factory.mktemp("home"))


def test_two_rounds_all_arms_through_the_real_pipeline(tmp_path: Path, seed0_home: str) -> None:
    small = _small_scenario(tmp_path)
    out = bench_swarm.run(rounds=2, seed=0, home=seed0_home, scenario=str(small))
    json.dumps(out)  # the CLI prints it as one JSON line
    for k in REQUIRED:
        assert k in out, k
    assert out["rounds"] == 2
    assert out["adversarial_accepted"] == 0
    # the adversary sent every kind of bad message, and none of it was accepted
    assert out["adversary_messages"] == 2 * 4  # garbage, bad task, forged reward, bad signature per step
    v = out["adversarial_verdicts"]
    assert v.get("malformed", 0) >= 1 and v.get("bad_task", 0) >= 1
    assert v.get("forged_reward", 0) + v.get("bad_signature", 0) >= 1
    # honest traffic got through: 2 rounds x 4 senders x 3 receivers, one batch each
    assert out["swarm_verdicts"] == {"accepted": 24}
    assert out["external_groups_per_step"]["isolated"] == 0
    # every accepted group reached a receiver's sampler (24 batches x 4 tasks), kept or dropped with a count
    sw = out["sampler"]["swarm"]
    assert sw["added"] + sw["uninformative"] + sw["too_small"] == 24 * 4
    assert out["external_groups_per_step"]["swarm"] == round(sw["taken"] / (4 * 2), 3)
    assert out["sampler"]["isolated"]["added"] == 0
    for m in ("isolated", "swarm", "adversarial"):
        assert len(out["curves"][m]) == 2
        assert all(0.0 <= x <= 1.0 for x in out["curves"][m])
    assert len(out["per_node_cumulative"]["adversarial"]) == 3  # honest nodes only
    # (c)'s honest nodes are compared with the same nodes in (a), not with all four
    iso = out["per_node_cumulative"]["isolated"]
    same = [r for k, r in enumerate(iso) if k != 3]
    assert out["isolated_cumulative_reward_honest_nodes"] == pytest.approx(sum(same) / 3, abs=2e-3)
    base = out["isolated_cumulative_reward_honest_nodes"]
    if base > 0:  # the inputs are rounded to 3 decimals, hence the relative tolerance
        assert out["gain_adversarial"] == pytest.approx(out["adversarial_cumulative_reward"] / base - 1, rel=0.02)
    else:
        assert out["gain_adversarial"] is None


def test_seeds_run_in_their_own_processes_and_reproduce_single_runs(tmp_path: Path) -> None:
    """Two seeds side by side in one model home; each is bit-identical to a run of that seed alone."""
    small, home = str(_small_scenario(tmp_path)), str(tmp_path / "home")
    out = bench_swarm.run_seeds(2, rounds=3, seed=5, home=home, scenario=small, workers=2)
    json.dumps(out)
    for k in REQUIRED:
        assert k in out, k
    assert out["seeds"] == [5, 6] and out["adversarial_accepted"] == 0
    alone = bench_swarm.run(rounds=3, seed=6, home=home, scenario=small)
    got = out["per_seed"][1]
    for k in ("isolated_cumulative_reward", "swarm_cumulative_reward", "adversarial_cumulative_reward"):
        assert got[k] == alone[k], k  # bit-identical to a run of that seed alone
        assert out[k] == pytest.approx(sum(r[k] for r in out["per_seed"]) / 2, abs=1e-3)
    gains = [r["gain_swarm"] for r in out["per_seed"] if r["gain_swarm"] is not None]
    if gains:
        assert out["gain_swarm"] == pytest.approx(sum(gains) / len(gains), abs=1e-4)
    with pytest.raises(ValueError):
        bench_swarm.run_seeds(0)
    with pytest.raises(ConfigError):
        bench_swarm.run_seeds(2, scenario=str(tmp_path / "missing.toml"))


def test_nodes_override_keeps_per_node_compute_and_the_adversary_slot(tmp_path: Path, seed0_home: str) -> None:
    base, _ = bench_swarm.load_scenario()
    for n, adv in ((2, 1), (4, 3), (8, 3)):
        sc, _ = bench_swarm.load_scenario(nodes=n)
        assert sc.nodes == n and sc.adversary.node == adv
        assert (sc.trainer, sc.isolated, sc.swarm, sc.rounds) == (base.trainer, base.isolated, base.swarm, base.rounds)
    for bad in (1, bench_swarm.MAX_NODES + 1):
        with pytest.raises(ConfigError, match="nodes"):
            bench_swarm.load_scenario(nodes=bad)
    out = bench_swarm.run(rounds=1, seed=0, home=seed0_home, scenario=str(_small_scenario(tmp_path)), nodes=2)
    assert out["nodes"] == 2 and out["adversary_node"] == 1
    assert out["swarm_verdicts"] == {"accepted": 2}  # one batch each way
    assert len(out["per_node_cumulative"]["adversarial"]) == 1 and out["adversarial_accepted"] == 0
