"""The ledger's disk budget on a real SQLite file: rows and payloads pruned, totals kept, no full scans."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from murmur.node import store as store_mod
from murmur.node.store import LedgerBudget, Store
from murmur.sync.ids import Relation


def _rows(n: int, start: int = 0, status: str = "accepted", ts_ms: int | None = None) -> list[dict]:
    out = []
    for i in range(start, start + n):
        e = dict(
            rollout_id=i.to_bytes(8, "big"),
            direction="received",
            status=status,
            reason="" if status == "accepted" else "forged_reward",
            producer=bytes([i % 3]) * 4,
            tokens=10,
            payload=b"p" * 1000,
        )
        if ts_ms is not None:
            e["ts_ms"] = ts_ms
        out.append(e)
    return out


def test_ledger_pruned_to_budget_with_totals_kept(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db", LedgerBudget(max_rows=1000, payload_rows=100, max_age_s=1e9))
    for k in range(30):
        s.record_rollouts(_rows(100, start=k * 100))
        s.record_rollouts(_rows(10, start=100_000 + k * 10, status="rejected"))
    for _ in range(5):  # each call does bounded work; a few reach the steady state
        s.prune_ledger()
    assert s.ledger_rows() <= 1000
    assert s.pruned >= 3300 - 1000
    assert s.ledger_counts() == {"accepted": 3000, "rejected:forged_reward": 300}
    contrib = {c["producer"]: c["accepted"] for c in s.contributions()}
    assert sum(contrib.values()) == 3000 and len(contrib) == 3
    with_payload = s.query("SELECT COUNT(*) FROM rollouts WHERE payload IS NOT NULL")[0][0]
    assert with_payload <= 100
    newest = s.query("SELECT payload FROM rollouts ORDER BY seq DESC LIMIT 1")[0][0]
    assert newest == b"p" * 1000  # the newest keep their signed bytes


def test_ledger_prunes_old_rows_by_age(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db", LedgerBudget(max_rows=10**6, payload_rows=10**6, max_age_s=3600))
    old = int(time.time() * 1000) - 7200_000
    s.record_rollouts(_rows(50, ts_ms=old))
    s.record_rollouts(_rows(20, start=50))
    assert s.prune_ledger() == 50
    assert s.ledger_rows() == 20
    assert s.ledger_counts()["accepted"] == 70


def test_prune_work_is_bounded_per_call(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db", LedgerBudget(max_rows=10, payload_rows=0, max_age_s=1e9))
    s.record_rollouts(_rows(store_mod.PRUNE_BATCH * 2 + 50))
    s.prune_ledger()  # record_rollouts already pruned once, each call at most one batch
    assert s.ledger_rows() >= 10
    while s.ledger_rows() > 10:
        assert s.prune_ledger() <= store_mod.PRUNE_BATCH
    assert s.ledger_rows() == 10


def test_migration_backfills_totals_from_an_old_ledger(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(store_mod.MIGRATIONS[0] + ";PRAGMA user_version=1;")
    db.execute(
        "INSERT INTO rollouts(rollout_id, direction, status, reason, producer, tokens, ts_ms) "
        "VALUES(x'01', 'received', 'accepted', '', x'aa', 7, 1)"
    )
    db.execute(
        "INSERT INTO rollouts(rollout_id, direction, status, reason, ts_ms) "
        "VALUES(x'02', 'received', 'rejected', 'graylisted', 1)"
    )
    db.close()
    s = Store(path)
    assert s.schema_version == len(store_mod.MIGRATIONS)
    assert s.ledger_counts() == {"accepted": 1, "rejected:graylisted": 1}
    assert s.contributions() == [dict(producer=b"\xaa", accepted=1, tokens=7)]


def test_counts_do_not_scan_the_ledger(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    s.record_rollouts(_rows(10))
    plan = s.query("EXPLAIN QUERY PLAN SELECT status, reason, n FROM ledger_totals")
    assert "rollouts" not in str(plan)
    plan = s.query("EXPLAIN QUERY PLAN " + store_mod._SEQ_RANGE)
    assert not any(str(row[3]).startswith("SCAN rollouts") for row in plan), plan
    assert s.disk_bytes() > 0


def test_version_rows_are_bounded_per_lineage(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    lid = b"\x01" * 32
    s.add_lineage(lid, "l", b"\x02" * 32, b"\x03" * 32, Relation.OWN)
    for v in range(store_mod.VERSIONS_KEPT + 600):
        s.add_version(lid, v, b"h" * 32, "patch", v - 1, manifest=b"m" * 400)
    n = s.query("SELECT COUNT(*) FROM versions WHERE lineage_id=?", (lid,))[0][0]
    assert n <= store_mod.VERSIONS_KEPT + 256
    assert s.head_version(lid, held_only=False) == store_mod.VERSIONS_KEPT + 599


def _file_bytes(s: Store) -> int:
    """The database file once its write-ahead log is folded in and truncated."""
    s.query("PRAGMA wal_checkpoint(TRUNCATE)")
    return s.disk_bytes()


def test_a_flood_of_fresh_keys_stays_within_the_peer_budget_and_spares_known_peers(tmp_path: Path) -> None:
    """Every key heard once was a row with its whole signed announce, never deleted: 2,000 fresh keys with
    16 KiB announces grew the file by about 30 MiB. The peer table holds its budget (rows and bytes) on a
    real SQLite file: a stranger (never connected) keeps no announce and a few addresses, and past the
    budget strangers' rows go first, never those of peers that were connected or whose rollouts were
    accepted."""
    budget = store_mod.PeerBudget(max_rows=200, max_bytes=96 * 1024)
    s = Store(tmp_path / "state.db", peer_budget=budget)
    announce = b"a" * 15_000
    addrs = [f"/ip4/10.0.{i}.1/tcp/4001/" + "x" * 200 for i in range(16)]
    connected = [f"12D3KooWconnected{i:035d}" for i in range(5)]
    for pid in connected:
        s.see_peer(pid, bytes([1, len(pid)]) * 16, addrs[:2], announce, connected=True)
    producer = bytes([7]) * 32  # a stranger whose rollouts this node accepted: a verified history
    s.record_rollouts([dict(rollout_id=b"r1", direction="received", status="accepted", producer=producer, tokens=8)])
    s.see_peer("12D3KooWproducer", producer, addrs, announce)
    before = _file_bytes(s)
    for i in range(2000):  # each fresh key announces once, heard through another peer
        s.see_peer(f"12D3KooWfresh{i:039d}", i.to_bytes(32, "big"), addrs, announce)
    s.prune_peers()
    growth = _file_bytes(s) - before
    rows = {r[0]: r for r in s.query("SELECT peer_id, announce IS NOT NULL, connected FROM peers")}
    assert len(rows) <= budget.max_rows and s.peer_bytes <= budget.max_bytes
    assert growth <= 2 * budget.max_bytes, f"state.db grew by {growth} bytes"
    assert all(rows[p][1:] == (1, 1) for p in connected)  # connected peers keep their rows and announces
    assert rows["12D3KooWproducer"][1] == 0  # a verified producer's row stays, without a stranger's announce
    assert sum(p.startswith("12D3KooWfresh") for p in rows) < budget.max_rows
    assert s.peers_evicted >= 2000 - budget.max_rows
    # reconnecting a stranger keeps its announce from then on; a later stranger's flood evicts it no sooner
    s.see_peer("12D3KooWfresh" + "0" * 38 + "9", None, addrs[:1], None, connected=True)
    for i in range(2000, 2400):
        s.see_peer(f"12D3KooWfresh{i:039d}", i.to_bytes(32, "big"), addrs, announce)
    s.prune_peers()
    left = {r[0] for r in s.query("SELECT peer_id FROM peers")}
    assert {*connected, "12D3KooWproducer"} <= left
    s.close()


def test_a_peer_table_grown_before_the_budget_is_cut_to_it_when_opened(tmp_path: Path) -> None:
    """A state.db of an earlier version holds every announce ever heard: opening it migrates the table
    (announces dropped, since no row says who was connected) and holds it to the budget at once."""
    path = tmp_path / "state.db"
    with sqlite3.connect(path) as db:
        for number, script in enumerate(store_mod.MIGRATIONS[:2], start=1):
            db.executescript(script + f";\nPRAGMA user_version={number};")
        db.executemany(
            "INSERT INTO peers(peer_id, public_key, addrs, first_seen_ms, last_seen_ms, announce) "
            "VALUES(?, ?, '[]', ?, ?, ?)",
            [(f"p{i}", bytes(32), i, i, b"a" * 10_000) for i in range(300)],
        )
    db.close()
    s = Store(path, peer_budget=store_mod.PeerBudget(max_rows=100))
    assert s.schema_version == len(store_mod.MIGRATIONS)
    left = s.query("SELECT peer_id, announce FROM peers")
    assert len(left) == 100 and all(a is None for _, a in left)
    assert {p for p, _ in left} == {f"p{i}" for i in range(200, 300)}  # the most recently seen kept
    s.close()


def _honest_rows(n: int, seed: int) -> list[dict]:
    """What a trainer records for accepted batches of 8: a few producers, forwarders and lineages, one
    task set, the batch's signed bytes on its first row."""
    import os
    import random

    rng = random.Random(seed)
    producers = [bytes([seed, k]) * 16 for k in range(4)]
    peers = [f"12D3KooW{seed}{k}" + "x" * 40 for k in range(3)]
    lineages = [bytes([k, seed]) * 16 for k in range(2)]
    out = []
    for i in range(n):
        out.append(
            dict(
                rollout_id=os.urandom(32),
                direction="received",
                status="accepted",
                producer=rng.choice(producers),
                from_peer=rng.choice(peers),
                lineage=rng.choice(lineages),
                version=rng.randint(0, 500),
                task_set=b"t" * 32,
                generator="rev",
                task_seed=rng.randint(0, 10**6),
                reward=1.0,
                tokens=rng.randint(3, 40),
                payload=os.urandom(rng.randint(800, 3000)) if i % 8 == 0 else None,
            )
        )
    return out


def test_honest_ledger_rows_cost_little_disk(tmp_path: Path) -> None:
    """A node records every rollout it accepts: a trainer taking 80 a second writes 14,000 rows in three
    minutes. Rows that repeated their 32-byte keys and peer ids, kept two indexes nothing reads and had
    their signed bytes stripped in place (leaving holes no later row fills) cost 600 bytes each on disk."""
    s = Store(tmp_path / "state.db")
    s.record_rollouts(_honest_rows(8, seed=1))
    s.query("PRAGMA wal_checkpoint(TRUNCATE)")
    before = s.disk_bytes()
    rows = _honest_rows(16_000, seed=2)
    for k in range(0, len(rows), 8):
        s.record_rollouts(rows[k : k + 8])
    s.query("PRAGMA wal_checkpoint(TRUNCATE)")
    per_row = (s.disk_bytes() - before) / len(rows)
    assert per_row < 200, f"{per_row:.0f} bytes a ledger row"
    newest = s.query(
        "SELECT producer, from_peer, lineage, task_set, generator, payload FROM rollouts ORDER BY seq DESC LIMIT 8"
    )[::-1]
    assert [r[:5] for r in newest] == [
        (e["producer"], e["from_peer"], e["lineage"], e["task_set"], e["generator"]) for e in rows[-8:]
    ]
    assert newest[0][5] == rows[-8]["payload"] and newest[1][5] is None


def test_names_no_row_uses_are_swept(tmp_path: Path) -> None:
    """Each fresh producer key adds a name; once the budget has pruned its rows, a sweep deletes it, so
    keys that came and went do not pile up."""
    s = Store(tmp_path / "state.db", LedgerBudget(max_rows=100, payload_rows=10, max_age_s=1e9))
    for k in range(3 * store_mod.NAMES_SWEEP_EVERY):
        s.record_rollouts(
            [
                dict(
                    rollout_id=k.to_bytes(4, "big"),
                    direction="received",
                    status="rejected",
                    reason="forged_reward",
                    producer=k.to_bytes(32, "big"),
                    from_peer=f"peer{k}",
                )
            ]
        )
    for _ in range(3):
        s.prune_ledger()
    names = s.query("SELECT COUNT(*) FROM ledger_names")[0][0]
    assert names <= 2 * (100 + store_mod.NAMES_SWEEP_EVERY), names
    assert s.ledger_counts() == {"rejected:forged_reward": 3 * store_mod.NAMES_SWEEP_EVERY}
    last = s.query("SELECT producer, from_peer FROM rollouts ORDER BY seq DESC LIMIT 1")[0]
    assert last == (
        (3 * store_mod.NAMES_SWEEP_EVERY - 1).to_bytes(32, "big"),
        f"peer{3 * store_mod.NAMES_SWEEP_EVERY - 1}",
    )


def test_migration_to_the_compact_ledger_keeps_every_row(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    db = sqlite3.connect(path, isolation_level=None)
    for number, script in enumerate(store_mod.MIGRATIONS[:3], start=1):
        db.executescript(script + f";\nPRAGMA user_version={number};")
    db.execute(
        "INSERT INTO rollouts(rollout_id, direction, status, reason, producer, from_peer, lineage, version, "
        "task_set, generator, task_seed, reward, tokens, ts_ms, payload) "
        "VALUES(x'01', 'received', 'accepted', '', x'aa', 'peerA', x'bb', 3, x'cc', 'rev', 9, 1.0, 7, 5, x'ff')"
    )
    db.execute("INSERT INTO rollouts(rollout_id, direction, status, ts_ms) VALUES(x'02', 'produced', 'produced', 6)")
    db.close()
    s = Store(path)
    assert s.schema_version == len(store_mod.MIGRATIONS)
    rows = s.query(
        "SELECT seq, rollout_id, direction, status, reason, producer, from_peer, lineage, version, "
        "task_set, generator, task_seed, reward, tokens, ts_ms, payload FROM rollouts ORDER BY seq"
    )
    assert rows == [
        (1, b"\x01", "received", "accepted", "", b"\xaa", "peerA", b"\xbb", 3, b"\xcc", "rev", 9, 1.0, 7, 5, b"\xff"),
        (2, b"\x02", "produced", "produced", "", None, "", None, None, None, None, None, None, None, 6, None),
    ]
    assert s.accepted_payloads(10) == [b"\xff"]
    s.record_rollouts([dict(rollout_id=b"\x03", direction="received", status="accepted", producer=b"\xaa")])
    assert s.query("SELECT MAX(seq) FROM rollouts")[0][0] == 3
