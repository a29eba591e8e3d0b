"""`python -m murmur.simulations.calibrate --matched`: the fit recovers the parameters that made a curve, and
the virtual simulator run on a measured setup reports the alone comparison."""

from __future__ import annotations

from murmur.simulations.calibrate import fit_matched, matched_curve, virtual_speedup


def _bench(rate: float, ceil: float, weight: float, nodes: int = 4, followers: int = 0) -> dict:
    u_iso, u_sw, share = 100.0, 140.0, 0.5
    per = []
    for start in (0.30, 0.34):
        per.append(
            {
                "curves": {
                    "cpu_s": [0.0, 6.0, 12.0, 18.0, 24.0],
                    "isolated": matched_curve(start, rate, ceil, u_iso, 4),
                    "swarm": matched_curve(start, rate, ceil, u_sw, 4, share, weight),
                },
                "updates_per_node": {"isolated": [u_iso] * nodes, "swarm": [u_sw] * nodes},
                "external_groups_per_node": [share * 8 * u_sw] * nodes,
                "steps_per_node": {"isolated": [40] * nodes, "swarm": [30] * nodes},
                "generation_share": {"isolated": 0.4, "swarm": 0.3},
            }
        )
    return {
        "per_seed": per,
        "trainer": {"local_groups": 16},
        "followers": followers,
        "nodes": nodes,
        "speedup": 1.0,
        "with_adversary": False,
    }


def test_the_fit_recovers_the_parameters_that_made_the_curves() -> None:
    got = fit_matched([_bench(0.01, 0.6, 0.5), _bench(0.01, 0.6, 0.5, nodes=8)])
    assert (got["rate"], got["ceiling"], got["external_weight"]) == (0.01, 0.6, 0.5)
    assert got["rmse_isolated"] < 1e-3 and got["rmse_swarm"] < 1e-3
    # f = 8 * 100 / (16 * 40) = 1.25 informative per generated group (synthetic); T·I/G = 0.6 / (0.4 * 1.25)
    assert abs(got["train_share"] - 1.2 / 2.2) < 1e-3
    worth_less = fit_matched([_bench(0.01, 0.6, 0.2)])
    assert worth_less["external_weight"] == 0.2
    # a trainer's followers' groups are its own lineage's: they fit their own weight, not the peers'
    both = fit_matched([_bench(0.01, 0.6, 0.2), _bench(0.01, 0.6, 1.5, nodes=1, followers=3)])
    assert (both["external_weight"], both["own_lineage_weight"]) == (0.2, 1.5)


def test_the_virtual_simulator_runs_a_measured_setup() -> None:
    fitted = {"rate": 0.01, "ceiling": 0.6, "external_weight": 1.0, "train_share": 0.3}
    run = {"nodes": 2, "followers": 0, "steps_iso": 20, "start": 0.3}
    got = virtual_speedup(fitted, run, seeds=1)
    assert got["speedup_virtual"] > 1.0 and got["final_delta_virtual"] > 0
    useless = virtual_speedup({**fitted, "external_weight": 0.0, "train_share": 0.8}, run, seeds=1)
    assert useless["final_delta_virtual"] < 0


def test_a_trainers_followers_are_valued_by_the_own_lineage_weight() -> None:
    run = {"nodes": 1, "followers": 2, "steps_iso": 30, "start": 0.3}
    base = {"rate": 0.01, "ceiling": 0.6, "train_share": 0.8}
    worthless = virtual_speedup({**base, "external_weight": 2.0, "own_lineage_weight": 0.0}, run, seeds=1)
    assert worthless["final_delta_virtual"] < 0  # trained on, paid for, worth nothing
    worth = virtual_speedup({**base, "external_weight": 0.0, "own_lineage_weight": 2.0}, run, seeds=1)
    assert worth["final_delta_virtual"] > 0
