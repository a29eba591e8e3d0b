from __future__ import annotations

import sqlite3

import pytest

from murmur.node.store import MIGRATIONS, Store, StoreError
from murmur.sync.ids import Relation


def test_schema_and_wal(tmp_path):
    s = Store(tmp_path / "state.db")
    assert s.schema_version == len(MIGRATIONS)
    assert s.query("PRAGMA journal_mode")[0][0] == "wal"
    s.put("k", {"v": 1})
    s.see_peer("12D3KooWx", b"k" * 32, ["/ip4/127.0.0.1/tcp/1"])
    s.close()
    # reopening migrates nothing and keeps data
    s = Store(tmp_path / "state.db")
    assert s.schema_version == len(MIGRATIONS)
    assert s.get("k") == {"v": 1}
    assert [p["peer_id"] for p in s.peers()] == ["12D3KooWx"]
    s.close()


def test_ledger_peers_lineages_tasksets(tmp_path):
    s = Store(tmp_path / "state.db")
    s.see_peer("12D3KooWx", b"k" * 32, ["/ip4/127.0.0.1/tcp/1"])
    s.see_peer("12D3KooWx")
    assert s.peers()[0]["addrs"] == ["/ip4/127.0.0.1/tcp/1"]
    s.add_lineage(b"L" * 32, "main", b"p" * 32, b"b" * 32, Relation.FOLLOW)
    s.add_version(b"L" * 32, 1, b"h1", "patch", 0, held=True)
    s.add_version(b"L" * 32, 2, b"h2", "patch", 1, held=False)
    assert s.head_version(b"L" * 32) == 1
    assert s.head_version(b"L" * 32, held_only=False) == 2
    assert s.add_task_set(b"T" * 32, "arith", 1, b"c" * 32, b"env")
    assert not s.add_task_set(b"T" * 32, "arith", 1, b"c" * 32, b"env")
    s.record_rollouts(
        [
            dict(rollout_id=b"r1", direction="received", status="accepted", producer=b"p", tokens=5, payload=b"x"),
            dict(rollout_id=b"r2", direction="received", status="rejected", reason="forged_reward", producer=b"q"),
            dict(rollout_id=b"r3", direction="produced", status="produced", producer=b"me"),
        ]
    )
    assert s.ledger_counts() == {"accepted": 1, "rejected:forged_reward": 1, "produced": 1}
    assert s.accepted_payloads(10) == [b"x"]
    assert s.contributions() == [dict(producer=b"p", accepted=1, tokens=5)]


def test_bad_ledger_row_rolls_back(tmp_path):
    s = Store(tmp_path / "state.db")
    with pytest.raises(sqlite3.IntegrityError):
        s.record_rollouts(
            [
                dict(rollout_id=b"ok", direction="received", status="accepted"),
                dict(rollout_id=b"bad", direction="sideways", status="accepted"),
            ]
        )
    assert s.ledger_counts() == {}


def test_not_a_database(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="state.db"):
        Store(path)


def test_newer_schema_refused(tmp_path):
    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer"):
        Store(path)


def test_the_stored_relations_are_the_relation_enum(tmp_path):
    """The lineages table's CHECK admits exactly `Relation`'s values (the runtime reads them back as it)."""
    s = Store(tmp_path / "state.db")
    for i, rel in enumerate(Relation):
        s.add_lineage(bytes([i]) * 32, "l", b"p" * 32, b"b" * 32, rel)
    assert {Relation(r["relation"]) for r in s.lineages()} == set(Relation)
    with pytest.raises(sqlite3.IntegrityError):
        s.add_lineage(b"x" * 32, "l", b"p" * 32, b"b" * 32, "watch")
    s.close()
