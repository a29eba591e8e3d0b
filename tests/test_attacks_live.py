"""The attack catalogue (simulations/bench/attacks.py) against live `murmur node start` processes.

A trainer and a follower+validator run on 127.0.0.1; hostile libp2p hosts, one fresh valid key per
attack class, run every class once. Afterwards the honest nodes are alive, still training and still
applying patches, no honest peer lost score, and every key that committed a provable fault
(`attacks.PROVABLE`) lost score. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
import trio

from murmur.node.cli import launch
from murmur.simulations.bench import attacks

pytestmark = pytest.mark.slow

PROGRESS_S = 240.0
ANSWER_S = 60.0  # a loaded machine answers within seconds; a frozen node never does


@pytest.fixture
def model(tiny_model: Path) -> Path:
    return tiny_model


def _verdicts(sw: attacks.LiveSwarm, name: str) -> dict[str, list[tuple[str, str, int]]]:
    """What each honest node's ledger recorded of the rollout batches from class `name`'s key."""
    out = {}
    for n, h in sw.homes.items():
        with contextlib.closing(sqlite3.connect(f"file:{h / 'state.db'}?mode=ro", uri=True)) as db:
            out[n] = db.execute(
                "SELECT status, reason, count(*) FROM rollouts WHERE from_peer = ? GROUP BY 1, 2",
                (attacks.attack_key(name).peer_id,),
            ).fetchall()
    return out


def test_catalogue_against_live_nodes(tmp_path: Path, model: Path) -> None:
    sw = attacks.start_swarm(tmp_path / "swarm", model)
    try:
        honest = set(sw.peer_ids())
        assert len(honest) == 2
        tok = attacks.model_tokenizer_hash(model)
        results = trio.run(
            lambda: attacks.run_catalogue(
                sw.addrs(), attacks.SWARM, rounds=1, observe_s=20, tokenizer_hash=tok, model=str(model)
            )
        )
        assert sorted(results) == sorted(attacks.CATALOGUE)
        assert all(r["sent"] > 0 for r in results.values()), {
            name: r for name, r in results.items() if not r["sent"]
        }  # every attack reached the wire
        assert sw.alive(), {n: p.exited() for n, p in sw.procs.items()}

        # both nodes answer (a frozen event loop leaves the control socket silent), then keep making progress
        launch.wait_until(
            "both nodes answering", lambda: all(sw.status(n) is not None for n in sw.homes), sw.procs.values(), ANSWER_S
        )
        before = {n: sw.status(n) for n in sw.homes}
        launch.wait_until(
            "the trainer training and the follower applying patches",
            lambda: (
                sw.status("trainer") is not None
                and sw.status("follower") is not None
                and sw.status("trainer").steps > before["trainer"].steps
                and sw.status("follower").versions_applied > before["follower"].versions_applied
            ),
            sw.procs.values(),
            PROGRESS_S,
        )

        # no honest peer lost score; every key that committed a provable fault lost score
        attackers = {p for r in results.values() for p in r["attackers"]}
        lost, worst = attacks.penalties(sw, honest, attackers)
        charged = {name: worst.get(attacks.attack_key(name).peer_id, 0.0) for name in attacks.CATALOGUE}
        print("attacker scores by class:", charged)
        assert lost == 0.0, {
            n: {p: s.peer_faults.get(p) for p in honest if p in s.peer_charged}
            for n in sw.homes
            if (s := sw.status(n)) is not None
        }  # charges that healed count too
        uncharged = sorted(name for name in attacks.PROVABLE if charged[name] >= 0)
        assert not uncharged, ({name: _verdicts(sw, name) for name in uncharged}, charged)
        statuses = [s for n in sw.homes if (s := sw.status(n)) is not None]
        faults = {
            name: {r for s in statuses for r in s.peer_faults.get(attacks.attack_key(name).peer_id, {})}
            for name in attacks.FAULTS
        }
        wrong = [name for name, got in faults.items() if attacks.FAULTS[name] not in got]
        assert not wrong, {name: _verdicts(sw, name) for name in wrong}  # each forgery met the check it is named after
    except BaseException:
        ids = sw.peer_ids()
        for n, h in sw.homes.items():  # what each node was doing when the assertion failed
            log = (h / "stderr.log").read_text(errors="replace")
            charged = [x for x in log.splitlines() if any(p in x for p in ids) and ("penalty" in x or "spot" in x)]
            print(f"--- {n}: lines charging an honest peer ---\n" + "\n".join(charged[-40:]))
            print(f"--- {n} log tail ---\n" + log[-4000:])
        raise
    finally:
        sw.stop()
