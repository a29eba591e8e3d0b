"""Virtual-time simulator: real pipeline verdicts against adversaries, determinism, report, WAN model."""

from __future__ import annotations

import json
import resource

import pytest

from murmur.simulations import scenario as S
from murmur.simulations.virtual import VirtualSim, run_virtual
from murmur.simulations.wan import LinkModel, LinkSpec, broadcast_lower_bound, netem_args

SMALL = """
name = "small"
seed = 7
duration_s = 40.0
[[group]]
count = 4
upload_bytes_per_s = 1000000.0
latency_ms = 10.0
[[adversary]]
behaviour = "forged_reward"
rate_per_s = 2.0
[[adversary]]
behaviour = "invalid_signature"
rate_per_s = 2.0
[[adversary]]
behaviour = "replay"
rate_per_s = 2.0
[[adversary]]
behaviour = "stale_spam"
rate_per_s = 2.0
start_s = 20.0
[[adversary]]
behaviour = "corrupt_chunks"
[training]
step_s = 1.0
max_staleness = 2
[sync]
patch_bytes = 131072
chunk_bytes = 16384
broadcasts = 1
[report]
sample_every_s = 5.0
"""


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vsim")
    # the peak before the run (ru_maxrss, the counter the report reads): the kernel updates it lazily, so it
    # can lag the current RSS by a fraction of a MiB, and a current-RSS lower bound fails now and then
    rss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    s = run_virtual(S.loads(SMALL, "small.toml"), out)
    s["_test_rss_bounds_mb"] = (rss_before_mb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10)
    return out, s


def test_adversaries_rejected_by_the_real_pipeline(small_run) -> None:
    _, s = small_run
    assert s["adversarial_accepted"] == 0
    rej = s["rejections"]
    for reason in ("forged_reward", "bad_signature", "replay", "stale_version"):
        assert rej.get(reason, 0) > 0, rej
    # a proven forger is banned after its first batch: later ones are dropped unread
    assert rej.get("blacklisted", 0) > rej["forged_reward"]
    assert s["broadcasts"][0]["bans"] >= 1 and s["broadcasts"][0]["hashes_ok"]


def test_summary_measures_the_run(small_run) -> None:
    _, s = small_run
    assert s["nodes"] == 9 and s["wall_s"] > 0 and s["cpu_s"] > 0
    # MiB of this process: at least its peak before the run, at most its peak since (Linux: ru_maxrss in KiB)
    low, high = s["_test_rss_bounds_mb"]
    assert low - 0.1 <= s["peak_rss_mb"] <= high + 0.1, (low, s["peak_rss_mb"], high)
    assert s["sampler"]["taken"] == s["external_groups_consumed"] > 0


def test_peers_swarm_matches_isolated_in_the_calibrated_model(small_run) -> None:
    """Four trainers of their own lineages (the default roles here): the calibrated model values another
    lineage's group at about its training cost, as the compute-matched benchmark measured, so the swarm
    runs level with the isolated twins, neither clearly ahead (the sign flips with the seed)."""
    _, s = small_run
    assert s["external_groups_consumed"] > 0
    swarm, alone = s["swarm_cumulative_reward"], s["isolated_cumulative_reward"]
    assert abs(swarm - alone) <= 0.05 * alone, (swarm, alone)


def test_report_folder(small_run) -> None:
    out, s = small_run
    for f in (
        "index.html",
        "summary.json",
        "metrics.jsonl",
        "scenario.toml",
        "reward.png",
        "rejections.png",
        "scores.png",
        "broadcast.png",
        "bytes.png",
    ):
        assert (out / f).is_file(), f
    assert S.load(out / "scenario.toml") == S.loads(SMALL)
    kinds = {json.loads(line)["kind"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert {"reward", "rejection", "score", "broadcast", "bytes"} <= kinds
    scores = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    forger = [r["score"] for r in scores if r["kind"] == "score" and r["behaviour"] == "forged_reward"]
    assert forger and forger[-1] < -50.0


def test_same_seed_same_run() -> None:
    text = SMALL.replace("duration_s = 40.0", "duration_s = 25.0").replace("broadcasts = 1", "broadcasts = 0")
    a = VirtualSim(S.loads(text)).run()
    b = VirtualSim(S.loads(text)).run()
    for k in ("swarm_cumulative_reward", "isolated_cumulative_reward", "rejections", "steps", "events"):
        assert a[k] == b[k], k


def test_shared_verification_memo_changes_no_verdict() -> None:
    """The per-process memo (simulations/vcache.py) must leave every node's verdicts, scores and rewards as
    its own pipeline alone decides them: the same run without the memo gives the same summary and rows."""
    text = SMALL.replace("duration_s = 40.0", "duration_s = 30.0").replace("broadcasts = 1", "broadcasts = 0")
    plain = VirtualSim(S.loads(text), shared_verify=False)
    shared = VirtualSim(S.loads(text))
    a, b = plain.run(), shared.run()
    stats = b.pop("verification")
    for k in ("wall_s", "cpu_s", "load_avg", "build_s", "setup_s", "peak_rss_mb"):
        a.pop(k), b.pop(k)
    assert a == b
    for kind in ("rejection", "reward", "score", "staleness", "event"):
        assert plain.rows.get(kind) == shared.rows.get(kind), kind
    # the memo did work: deliveries reused verdicts, and each distinct signature was checked once (a batch
    # reaches only its shard's subscribers, a couple of nodes here, so reuse is modest)
    assert stats["batch_verify_memo_hits"] > 0 and stats["batch_verifications"] > 0
    assert stats["signature_memo_hits"] > 0 and stats["signature_checks"] > 0


def test_churn_and_followers_run() -> None:
    text = """
duration_s = 30.0
[[group]]
count = 3
[[group]]
count = 2
role = "follower"
follow = 0
[[event]]
at_s = 5.0
action = "restart"
node = 1
down_s = 5.0
[churn]
leaves_per_min = 6.0
down_s = 3.0
[training]
step_s = 1.0
[sync]
patch_bytes = 65536
chunk_bytes = 16384
broadcasts = 0
"""
    sim = VirtualSim(S.loads(text))
    s = sim.run()
    assert s["steps"] > 0
    lags = [r["lag"] for r in sim.rows.get("lag", [])]
    assert lags and min(lags) >= 0
    actions = [r["action"] for r in sim.rows["event"]]
    assert actions.count("leave") >= 1 and actions.count("join") >= 6  # 5 initial joins + the restart


def test_link_model_bandwidth_latency_queueing() -> None:
    m = LinkModel([LinkSpec(up_bps=1000.0, latency_s=0.05), LinkSpec(up_bps=1000.0, down_bps=500.0, latency_s=0.05)])
    t1 = m.send(0, 1, 1000, 0.0)  # 1 s up, but the receiver drains at 500 B/s: 2 s + latency
    assert t1 == pytest.approx(2.1)
    t2 = m.send(0, 1, 500, 0.0)  # queued behind the first on both queues
    assert t2 == pytest.approx(3.1)
    assert m.bytes_up[0] == 1500 and m.bytes_down[1] == 1500


def test_lower_bound_formula() -> None:
    # T* = (S/B)(1 + floor(log2 N)/M) + log2(N+1) RTT/2
    assert broadcast_lower_bound(1_000_000, 16, 1e6, 4) == pytest.approx(2.0)
    assert broadcast_lower_bound(1_000_000, 16, 1e6, 4, rtt_s=0.1) == pytest.approx(2.0 + 4.0875 * 0.05, rel=1e-3)
    assert broadcast_lower_bound(1_000_000, 0, 1e6, 4) == 0.0


def test_netem_args() -> None:
    a = netem_args(LinkSpec(up_bps=1e6, down_bps=2e6, latency_s=0.03, jitter_s=0.005, loss=0.01), "up")
    assert a == ["netem", "delay", "30.000ms", "5.000ms", "loss", "1.0000%", "rate", "8000000bit"]


def test_learning_defaults_are_the_fit_of_the_matched_benchmark() -> None:
    """docs/researcher.md: the [learning] defaults are what `simulations.calibrate --matched` fits to the
    compute-matched benchmark's recorded runs."""
    from pathlib import Path

    from murmur.simulations.calibrate import fit_matched

    runs = json.loads((Path(__file__).parent / "data" / "matched_runs.json").read_text())
    got = fit_matched(runs)
    d = S.Learning()
    assert (
        got["initial"],
        got["rate"],
        got["ceiling"],
        got["external_weight"],
        got["own_lineage_weight"],
        got["train_share"],
    ) == (d.initial, d.rate, d.ceiling, d.external_weight, d.own_lineage_weight, d.train_share)
    assert got["rmse_isolated"] < 0.02 and got["rmse_swarm"] < 0.02


def test_the_projection_to_other_generation_shares_is_modelled_and_moves_with_g() -> None:
    """`calibrate --project`: the fitted model run where generation is a larger share of a step; a pod
    saves generation, so its modelled speedup grows with g, and every row says it is modelled."""
    from pathlib import Path

    from murmur.simulations.calibrate import fit_matched, project

    fitted = fit_matched(json.loads((Path(__file__).parent / "data" / "matched_runs.json").read_text()))
    rows = project(fitted, 40.0, 0.39, shares=(0.5, 0.9), seeds=1, setups=({"nodes": 1, "followers": 3},))
    assert [r["generation_share"] for r in rows] == [0.5, 0.9] and all(r["modelled"] for r in rows)
    assert [r["pod_ceiling"] for r in rows] == [2.0, 10.0]
    assert rows[1]["speedup_virtual"] > rows[0]["speedup_virtual"] > 1.0


def test_heads_are_learned_from_messages() -> None:
    """No core reads another node's head from global state: it knows the heads of the lineages whose
    publishers reached it (gossip neighbours, the lineage it follows), never ahead of the publisher."""
    text = """
seed = 3
duration_s = 20.0
[[group]]
count = 10
[[group]]
count = 2
role = "follower"
follow = 0
[training]
step_s = 1.0
[gossip]
degree = 2
[sync]
patch_bytes = 65536
chunk_bytes = 16384
broadcasts = 0
"""
    sim = VirtualSim(S.loads(text))
    sim.run()
    truth = {n.lineage: n.version for n in sim.nodes if n.spec.role == "trainer"}
    strangers = 0
    for n in sim.nodes:
        known = {lin for lin in truth if n.core.head_of(lin) is not None}
        reached = {sim.nodes[j].lineage for j in n.ctrl if sim.nodes[j].spec.role == "trainer"}
        if n.spec.role == "trainer":
            reached.add(n.lineage)
        assert known <= reached
        assert all(n.core.head_of(lin) <= truth[lin] for lin in known)
        strangers += len(truth) - len(known)
        if n.spec.role == "trainer":
            assert n.sampler.head(n.lineage) == n.version == n.core.head_of(n.lineage)  # its own head, every step
    assert strangers > 0  # with degree 2, most lineages are unknown to most nodes
    lead = sim.nodes[0].lineage
    followers = [n for n in sim.nodes if n.spec.role == "follower"]
    assert all(n.core.head_of(lead) is not None for n in followers)  # the followed publisher reached them


def test_memo_keeps_only_what_is_in_flight() -> None:
    from murmur.simulations.vcache import Memo

    now = [0.0]
    m = Memo(1000, lambda: now[0], horizon_s=5.0)
    for i in range(50):
        now[0] = i * 0.5
        m.put(i, i)
    assert sorted(m) == list(range(39, 50))  # put at t >= 24.5 - 5
    small = Memo(3, lambda: 0.0, horizon_s=5.0)
    for i in range(10):
        small.put(i, i)
    assert sorted(small) == [7, 8, 9]


ALONE = """
seed = 5
duration_s = 60.0
[[group]]
count = 4
[training]
local_groups = 4
external_groups = 8
step_s = 1.0
[sync]
broadcasts = 0
[report]
plots = false
"""


def _alone(text: str) -> tuple[dict, dict]:
    sim = VirtualSim(S.loads(text, "alone.toml"))
    s = sim.run()
    return s["alone"], {n.spec.index: n for n in sim.nodes}


def test_training_on_the_swarms_groups_costs_the_trainer_its_own_time() -> None:
    """With `train_share`, a step that trains on external groups takes longer than `step_s`: a trainer
    whose swarm groups are worth nothing (external_weight 0) falls behind its compute-matched twin."""
    free, nodes = _alone(ALONE + "[learning]\nexternal_weight = 0.0\ntrain_share = 0.0\n")
    assert all(len(n.curve) >= 58 for n in nodes.values())  # one step per step_s
    costly, nodes = _alone(ALONE + "[learning]\nexternal_weight = 0.0\ntrain_share = 0.8\n")
    assert all(len(n.curve) < 45 for n in nodes.values())  # its steps trained on up to 12 groups, not 4
    assert all(len(n.alone.curve) > 55 for n in nodes.values())  # the twin trains on its 4 alone
    assert costly["final_skill_delta"] < 0 and not costly["reached"]  # it never gets where its twin ends
    assert costly["final_skill_delta"] < free["final_skill_delta"]


def test_the_swarm_reaches_the_alone_target_sooner_when_its_groups_pay() -> None:
    s, nodes = _alone(ALONE + "[learning]\nexternal_weight = 1.0\ntrain_share = 0.3\n")
    assert s["reached"] and s["speedup"] > 1.2 and s["final_skill_delta"] > 0
    assert len(s["skill"]) == len(s["alone_skill"]) == len(s["marks_s"]) == 21
    assert s["skill"][0] == s["alone_skill"][0]  # both start from the same skills
