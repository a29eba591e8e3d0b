"""The attack catalogue (simulations/bench/attacks.py) against live `murmur node start` processes.

A trainer and a follower+validator run on 127.0.0.1; hostile libp2p hosts, one fresh valid key per
attack class, run every class once. Afterwards the honest nodes are alive, still training and still
applying patches, no honest peer lost score, and the attackers' scores fell. Every wait is bounded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from simulations.bench import attacks
from tests.nodeproc import build_tiny_model

pytestmark = pytest.mark.slow

PROGRESS_S = 240.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"), dict(os.environ, OMP_NUM_THREADS="1"))


def test_catalogue_against_live_nodes(tmp_path: Path, model: Path) -> None:
    sw = attacks.start_swarm(tmp_path / "swarm", model)
    try:
        honest = set(sw.peer_ids())
        assert len(honest) == 2
        results = trio.run(lambda: attacks.run_catalogue(sw.addrs(), sw.peer_ids(), attacks.SWARM, rounds=1))
        assert sorted(results) == sorted(attacks.CATALOGUE)
        assert all(r["sent"] > 0 for r in results.values()), results  # every attack reached the wire
        assert sw.alive(), {n: p.poll() for n, p in sw.procs.items()}

        # still training and applying patches after the attacks
        before = {n: sw.status(n) for n in sw.homes}
        assert all(s is not None for s in before.values())
        attacks.wait_until("the trainer training and the follower applying patches",
                           lambda: (sw.status("trainer") is not None and sw.status("follower") is not None
                                    and sw.status("trainer").steps > before["trainer"].steps
                                    and sw.status("follower").versions_applied > before["follower"].versions_applied),
                           list(sw.procs.values()), PROGRESS_S)

        # no honest peer lost score; every attacker that a node has a record of lost score there
        attackers = {p for r in results.values() for p in r["attackers"]}
        lost, worst = attacks.penalties(sw, honest, attackers)
        assert lost == 0.0, {n: sw.status(n).peer_scores for n in sw.homes}
        assert worst and all(score < 0 for score in worst.values()), worst
        stream = attacks.attack_key("stream_garbage").peer_id
        assert worst.get(stream, 0.0) < 0  # the pre-signature garbage cost its sender
    finally:
        sw.stop()
