"""State store: one SQLite database (WAL) in the node home.

Holds what must survive kill -9: peers seen, lineages and their versions,
task sets, and the rollout ledger (every rollout produced, received, accepted
or rejected with its reason) that later serves contribution accounting.

The ledger has a budget (`LedgerBudget`): the newest rows are kept, older ones
are deleted, and only the newest accepted rows keep their signed bytes. Totals
per status/reason and per producer live in their own small tables, updated in
the same transaction as each insert, so counts survive pruning and reading them
never scans the ledger. Pruning works in bounded batches from the oldest row.
The peer table has its own budget (`PeerBudget`, rows and bytes): keys are free,
so a row per key heard would let strangers grow the file without end. A peer's
signed announce is kept only once it has been connected to this node; a
stranger (heard through others) keeps its id, key and a few addresses. Past the
budget the least recently seen rows go first, strangers before peers that were
connected or whose rollouts this node accepted (`producer_totals`).
The schema is versioned (PRAGMA user_version) and migrated forward in order.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from murmur.gossip.errors import MurmurError
from murmur.sync.ids import Relation

DB_FILE = "state.db"


class StoreError(MurmurError):
    """The state database cannot be opened or migrated."""


MIGRATIONS: list[str] = [
    # 1: initial schema
    """
    CREATE TABLE peers (
        peer_id TEXT PRIMARY KEY,
        public_key BLOB,
        addrs TEXT NOT NULL DEFAULT '[]',
        first_seen_ms INTEGER NOT NULL,
        last_seen_ms INTEGER NOT NULL,
        score REAL NOT NULL DEFAULT 0,
        banned_until_ms INTEGER NOT NULL DEFAULT 0,
        announce BLOB
    );
    CREATE TABLE lineages (
        lineage_id BLOB PRIMARY KEY,
        name TEXT NOT NULL,
        publisher BLOB NOT NULL,
        base_model_hash BLOB NOT NULL,
        relation TEXT NOT NULL CHECK (relation IN ('own', 'follow', 'seen')),
        created_ms INTEGER NOT NULL
    );
    CREATE TABLE versions (
        lineage_id BLOB NOT NULL REFERENCES lineages(lineage_id),
        version INTEGER NOT NULL,
        state_hash BLOB NOT NULL,
        kind TEXT NOT NULL CHECK (kind IN ('patch', 'anchor', 'union')),
        base_version INTEGER NOT NULL,
        manifest BLOB,
        path TEXT,
        held INTEGER NOT NULL DEFAULT 0,
        created_ms INTEGER NOT NULL,
        PRIMARY KEY (lineage_id, version, kind, base_version)
    );
    CREATE TABLE task_sets (
        task_set_id BLOB PRIMARY KEY,
        name TEXT NOT NULL,
        version INTEGER NOT NULL,
        coordinator BLOB NOT NULL,
        envelope BLOB NOT NULL,
        received_ms INTEGER NOT NULL
    );
    CREATE TABLE rollouts (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        rollout_id BLOB NOT NULL,
        direction TEXT NOT NULL CHECK (direction IN ('produced', 'received')),
        status TEXT NOT NULL CHECK (status IN ('produced', 'accepted', 'rejected')),
        reason TEXT NOT NULL DEFAULT '',
        producer BLOB,
        from_peer TEXT NOT NULL DEFAULT '',
        lineage BLOB,
        version INTEGER,
        task_set BLOB,
        generator TEXT,
        task_seed INTEGER,
        reward REAL,
        tokens INTEGER,
        ts_ms INTEGER NOT NULL,
        payload BLOB
    );
    CREATE INDEX rollouts_status ON rollouts(status, ts_ms);
    CREATE INDEX rollouts_id ON rollouts(rollout_id);
    CREATE TABLE kv (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    """,
    # 2: ledger totals kept beside the (pruned) ledger
    """
    CREATE TABLE ledger_totals (
        status TEXT NOT NULL,
        reason TEXT NOT NULL,
        n INTEGER NOT NULL,
        PRIMARY KEY (status, reason)
    );
    INSERT INTO ledger_totals SELECT status, reason, COUNT(*) FROM rollouts GROUP BY status, reason;
    CREATE TABLE producer_totals (
        producer BLOB PRIMARY KEY,
        accepted INTEGER NOT NULL,
        tokens INTEGER NOT NULL
    );
    INSERT INTO producer_totals SELECT COALESCE(producer, x''), COUNT(*), COALESCE(SUM(tokens), 0)
        FROM rollouts WHERE status='accepted' GROUP BY COALESCE(producer, x'');
    """,
    # 3: whether a peer was ever connected to this node (only those keep their announce)
    """
    ALTER TABLE peers ADD COLUMN connected INTEGER NOT NULL DEFAULT 0;
    UPDATE peers SET announce=NULL;
    """,
    # 4: a compact ledger. A row names its producer, forwarder, lineage, task set and generator by a small id
    # (a few distinct values fill thousands of rows); signed bytes live in their own table, so dropping them
    # frees whole pages for reuse instead of leaving holes in the rows' pages; no index that no query uses.
    # `rollouts` stays as a view with the old columns.
    """
    CREATE TABLE ledger_names (id INTEGER PRIMARY KEY, value NOT NULL UNIQUE);
    INSERT OR IGNORE INTO ledger_names(value)
        SELECT producer FROM rollouts WHERE producer IS NOT NULL
        UNION SELECT from_peer FROM rollouts WHERE from_peer != ''
        UNION SELECT lineage FROM rollouts WHERE lineage IS NOT NULL
        UNION SELECT task_set FROM rollouts WHERE task_set IS NOT NULL
        UNION SELECT generator FROM rollouts WHERE generator IS NOT NULL;
    CREATE TABLE ledger (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        rollout_id BLOB NOT NULL,
        direction TEXT NOT NULL CHECK (direction IN ('produced', 'received')),
        status TEXT NOT NULL CHECK (status IN ('produced', 'accepted', 'rejected')),
        reason TEXT NOT NULL DEFAULT '',
        producer INTEGER,
        from_peer INTEGER,
        lineage INTEGER,
        version INTEGER,
        task_set INTEGER,
        generator INTEGER,
        task_seed INTEGER,
        reward REAL,
        tokens INTEGER,
        ts_ms INTEGER NOT NULL
    );
    CREATE TABLE ledger_payloads (seq INTEGER PRIMARY KEY, payload BLOB NOT NULL);
    INSERT INTO ledger SELECT r.seq, r.rollout_id, r.direction, r.status, r.reason,
        (SELECT id FROM ledger_names WHERE value = r.producer), (SELECT id FROM ledger_names WHERE value = r.from_peer),
        (SELECT id FROM ledger_names WHERE value = r.lineage), r.version,
        (SELECT id FROM ledger_names WHERE value = r.task_set), (SELECT id FROM ledger_names WHERE value = r.generator),
        r.task_seed, r.reward, r.tokens, r.ts_ms FROM rollouts r;
    INSERT INTO ledger_payloads SELECT seq, payload FROM rollouts WHERE payload IS NOT NULL;
    DROP TABLE rollouts;
    CREATE VIEW rollouts AS SELECT l.seq, l.rollout_id, l.direction, l.status, l.reason, p.value AS producer,
        COALESCE(f.value, '') AS from_peer, n.value AS lineage, l.version, t.value AS task_set, g.value AS generator,
        l.task_seed, l.reward, l.tokens, l.ts_ms, lp.payload
        FROM ledger l LEFT JOIN ledger_names p ON p.id = l.producer LEFT JOIN ledger_names f ON f.id = l.from_peer
        LEFT JOIN ledger_names n ON n.id = l.lineage LEFT JOIN ledger_names t ON t.id = l.task_set
        LEFT JOIN ledger_names g ON g.id = l.generator LEFT JOIN ledger_payloads lp ON lp.seq = l.seq;
    """,
]
_NAMED = ("producer", "from_peer", "lineage", "task_set", "generator")  # ledger columns stored as `ledger_names` ids

# Two subqueries so SQLite answers each from the primary key's ends (MIN and MAX together would scan).
_SEQ_RANGE = "SELECT (SELECT MIN(seq) FROM ledger), (SELECT MAX(seq) FROM ledger)"
VERSIONS_KEPT = 4096  # version rows kept per lineage (far beyond any retained patch window)
PRUNE_EVERY = 256  # inserted rows between budget checks
PRUNE_BATCH = 5000  # rows deleted (or stripped of payload) per check: bounded work per call
NAMES_SWEEP_EVERY = 1024  # new `ledger_names` rows between sweeps of the names no ledger row uses
NAMES_CACHED = 4096  # name -> id lookups kept in memory


STRANGER_ADDRS = 4  # addresses kept for a peer never connected (discovery redials at most a few)
PEER_PRUNE_EVERY = 32  # new peer rows between peer-budget checks
PEER_ROW_OVERHEAD = 64  # bytes a peer row costs beyond its values (record header, the primary key's index)


class PeerBudget(msgspec.Struct, frozen=True, kw_only=True):
    """How much of the peer table stays on disk."""

    max_rows: int = 4096
    max_bytes: int = 8 * 2**20  # the rows' values plus `PEER_ROW_OVERHEAD` each


class LedgerBudget(msgspec.Struct, frozen=True, kw_only=True):
    """How much of the rollout ledger stays on disk (totals are kept regardless)."""

    max_rows: int = 200_000  # newest ledger rows kept
    payload_rows: int = 2_000  # newest rows that keep their signed bytes
    max_age_s: float = 7 * 86400.0  # rows older than this are deleted


def _now_ms() -> int:
    return int(time.time() * 1000)


class Store:
    """Thread-safe wrapper around one SQLite connection; every write is one transaction."""

    def __init__(self, path: Path, budget: LedgerBudget | None = None, peer_budget: PeerBudget | None = None) -> None:
        self.path = Path(path)
        self.budget = budget or LedgerBudget()
        self.peer_budget = peer_budget or PeerBudget()
        self.peer_bytes = 0  # the peer table's bytes as of its last budget check
        self.peers_evicted = 0  # peer rows deleted by the budget since open
        self._new_peers = 0
        self.pruned = 0  # ledger rows deleted by the budget since open
        self._since_prune = 0
        self._payload_floor = 0  # rows at or below this seq have had their payload stripped
        self._names: dict[Any, int] = {}  # a cache of `ledger_names`
        self._names_added = 0  # names added since the last sweep
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{self.path}: cannot open state database: {e}") from None
        self._lock = threading.RLock()
        self.migrate()
        self.prune_peers()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def migrate(self) -> None:
        try:
            current = self.schema_version
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{self.path}: not a state database: {e}") from None
        if current > len(MIGRATIONS):
            raise StoreError(f"{self.path}: schema version {current} is newer than this murmur ({len(MIGRATIONS)})")
        for number in range(current + 1, len(MIGRATIONS) + 1):
            with self._lock:
                try:
                    self._db.executescript(
                        "BEGIN IMMEDIATE;" + MIGRATIONS[number - 1] + f";\nPRAGMA user_version={number};\nCOMMIT;"
                    )
                except sqlite3.DatabaseError as e:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise StoreError(f"{self.path}: migration {number} failed: {e}") from None

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------ kv
    def get(self, key: str, default: Any = None) -> Any:
        rows = self.query("SELECT value FROM kv WHERE key=?", (key,))
        return json.loads(rows[0][0]) if rows else default

    def put(self, key: str, value: Any) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT INTO kv(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, json.dumps(value)),
            )

    # ------------------------------------------------------------ peers
    def see_peer(
        self,
        peer_id: str,
        public_key: bytes | None = None,
        addrs: list[str] | None = None,
        announce: bytes | None = None,
        connected: bool = False,
    ) -> None:
        """Record a peer heard or connected. Its `announce` is kept only if it is or was once `connected`
        (directly to this node); a stranger's row keeps at most `STRANGER_ADDRS` addresses."""
        now = _now_ms()
        if not connected:
            addrs = (addrs or [])[:STRANGER_ADDRS]
        with self.tx() as db:
            cur = db.execute(
                """INSERT INTO peers(peer_id, public_key, addrs, first_seen_ms, last_seen_ms, announce, connected)
                   VALUES(?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT(peer_id) DO UPDATE SET last_seen_ms=excluded.last_seen_ms,
                     public_key=COALESCE(excluded.public_key, peers.public_key),
                     addrs=CASE WHEN excluded.addrs='[]' THEN peers.addrs ELSE excluded.addrs END,
                     connected=MAX(peers.connected, excluded.connected),
                     announce=CASE WHEN MAX(peers.connected, excluded.connected)
                       THEN COALESCE(excluded.announce, peers.announce) END
                   RETURNING first_seen_ms = last_seen_ms""",
                (
                    peer_id,
                    public_key,
                    json.dumps(addrs or []),
                    now,
                    now,
                    announce if connected else None,
                    int(connected),
                ),
            )
            new = bool(cur.fetchone()[0])
        if new:
            self._new_peers += 1
            if self._new_peers >= PEER_PRUNE_EVERY:
                self.prune_peers()

    def prune_peers(self) -> int:
        """Enforce the peer budget; returns rows deleted. Strangers go first, then peers that were connected
        or whose rollouts were accepted, least recently seen first within each. Reads every row's size: the
        table is bounded, so the work is too."""
        self._new_peers = 0
        b = self.peer_budget
        with self.tx() as db:
            rows = db.execute(
                f"""SELECT peer_id, connected OR EXISTS(SELECT 1 FROM producer_totals
                                                       WHERE producer = peers.public_key AND accepted > 0),
                           last_seen_ms, {PEER_ROW_OVERHEAD} + LENGTH(peer_id) * 2 + COALESCE(LENGTH(public_key), 0)
                                         + LENGTH(addrs) + COALESCE(LENGTH(announce), 0)
                    FROM peers"""
            ).fetchall()
            total = sum(r[3] for r in rows)
            over_rows = len(rows) - b.max_rows
            gone: list[tuple[str]] = []
            for pid, _keep, _seen, size in sorted(rows, key=lambda r: (r[1], r[2])):
                if over_rows <= 0 and total <= b.max_bytes:
                    break
                gone.append((pid,))
                over_rows -= 1
                total -= size
            db.executemany("DELETE FROM peers WHERE peer_id=?", gone)
        self.peer_bytes = total
        self.peers_evicted += len(gone)
        return len(gone)

    def set_peer_score(self, peer_id: str, score: float, banned_until_ms: int = 0) -> None:
        with self.tx() as db:
            db.execute("UPDATE peers SET score=?, banned_until_ms=? WHERE peer_id=?", (score, banned_until_ms, peer_id))

    def peers(self) -> list[dict[str, Any]]:
        rows = self.query(
            "SELECT peer_id, addrs, last_seen_ms, score, banned_until_ms FROM peers ORDER BY last_seen_ms DESC"
        )
        return [
            dict(peer_id=r[0], addrs=json.loads(r[1]), last_seen_ms=r[2], score=r[3], banned_until_ms=r[4])
            for r in rows
        ]

    # ------------------------------------------------------------ lineages and versions
    def add_lineage(
        self, lineage_id: bytes, name: str, publisher: bytes, base_model_hash: bytes, relation: Relation
    ) -> None:
        with self.tx() as db:
            db.execute(
                """INSERT INTO lineages VALUES(?, ?, ?, ?, ?, ?)
                   ON CONFLICT(lineage_id) DO UPDATE SET relation=CASE WHEN lineages.relation='seen'
                     THEN excluded.relation ELSE lineages.relation END""",
                (lineage_id, name, publisher, base_model_hash, relation, _now_ms()),
            )

    def lineages(self) -> list[dict[str, Any]]:
        rows = self.query("SELECT lineage_id, name, publisher, base_model_hash, relation FROM lineages")
        return [dict(lineage_id=r[0], name=r[1], publisher=r[2], base_model_hash=r[3], relation=r[4]) for r in rows]

    def add_version(
        self,
        lineage_id: bytes,
        version: int,
        state_hash: bytes,
        kind: str,
        base_version: int,
        manifest: bytes | None = None,
        path: str | None = None,
        held: bool = False,
    ) -> None:
        with self.tx() as db:
            db.execute(
                """INSERT INTO versions VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT DO UPDATE SET held=MAX(versions.held, excluded.held),
                     path=COALESCE(excluded.path, versions.path),
                     manifest=COALESCE(excluded.manifest, versions.manifest)""",
                (lineage_id, version, state_hash, kind, base_version, manifest, path, int(held), _now_ms()),
            )
            if version % 256 == 0:  # the primary key's range: bounded work, a bounded table per lineage
                db.execute(
                    "DELETE FROM versions WHERE lineage_id=? AND version<?", (lineage_id, version - VERSIONS_KEPT)
                )

    def head_version(self, lineage_id: bytes, held_only: bool = True) -> int | None:
        sql = "SELECT MAX(version) FROM versions WHERE lineage_id=?" + (" AND held=1" if held_only else "")
        row = self.query(sql, (lineage_id,))
        return row[0][0]

    def versions(self, lineage_id: bytes) -> list[dict[str, Any]]:
        rows = self.query(
            "SELECT version, state_hash, kind, base_version, manifest, path, held FROM versions WHERE lineage_id=? ORDER BY version, kind",
            (lineage_id,),
        )
        return [
            dict(version=r[0], state_hash=r[1], kind=r[2], base_version=r[3], manifest=r[4], path=r[5], held=bool(r[6]))
            for r in rows
        ]

    def forget_versions_before(self, lineage_id: bytes, version: int, keep_anchors: bool = True) -> None:
        with self.tx() as db:
            sql = "DELETE FROM versions WHERE lineage_id=? AND version<?" + (
                " AND kind!='anchor'" if keep_anchors else ""
            )
            db.execute(sql, (lineage_id, version))

    # ------------------------------------------------------------ task sets
    def add_task_set(self, task_set_id: bytes, name: str, version: int, coordinator: bytes, envelope: bytes) -> bool:
        """True when new."""
        with self.tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO task_sets VALUES(?, ?, ?, ?, ?, ?)",
                (task_set_id, name, version, coordinator, envelope, _now_ms()),
            )
            return cur.rowcount == 1

    def task_sets(self) -> list[dict[str, Any]]:
        rows = self.query(
            "SELECT task_set_id, name, version, coordinator, envelope, received_ms FROM task_sets ORDER BY received_ms, rowid"
        )
        return [
            dict(task_set_id=r[0], name=r[1], version=r[2], coordinator=r[3], envelope=r[4], received_ms=r[5])
            for r in rows
        ]

    # ------------------------------------------------------------ rollout ledger
    def record_rollouts(self, entries: Iterable[dict[str, Any]]) -> int:
        """Append ledger rows in one transaction. Keys: rollout_id, direction, status, and optional
        reason, producer, from_peer, lineage, version, task_set, generator, task_seed, reward, tokens, payload."""
        now = _now_ms()
        entries = list(entries)
        totals: dict[tuple[str, str], int] = {}
        producers: dict[bytes, list[int]] = {}
        for e in entries:
            key = (e["status"], e.get("reason", ""))
            totals[key] = totals.get(key, 0) + 1
            if e["status"] == "accepted":
                acc = producers.setdefault(bytes(e.get("producer") or b""), [0, 0])
                acc[0] += 1
                acc[1] += int(e.get("tokens") or 0)
        with self.tx() as db:
            ids = self._name_ids(db, {e[c] for e in entries for c in _NAMED if e.get(c) not in (None, "")})
            for e in entries:
                named = [ids.get(e.get(c)) if e.get(c) not in (None, "") else None for c in _NAMED]
                seq = db.execute(
                    """INSERT INTO ledger(rollout_id, direction, status, reason, producer, from_peer, lineage, version,
                       task_set, generator, task_seed, reward, tokens, ts_ms) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?)""",
                    (
                        e["rollout_id"],
                        e["direction"],
                        e["status"],
                        e.get("reason", ""),
                        named[0],
                        named[1],
                        named[2],
                        e.get("version"),
                        named[3],
                        named[4],
                        e.get("task_seed"),
                        e.get("reward"),
                        e.get("tokens"),
                        e.get("ts_ms", now),
                    ),
                ).lastrowid
                if e.get("payload") is not None:
                    db.execute("INSERT INTO ledger_payloads VALUES(?, ?)", (seq, e["payload"]))
            db.executemany(
                """INSERT INTO ledger_totals VALUES(?, ?, ?)
                              ON CONFLICT DO UPDATE SET n = n + excluded.n""",
                [(st, rs, n) for (st, rs), n in totals.items()],
            )
            db.executemany(
                """INSERT INTO producer_totals VALUES(?, ?, ?) ON CONFLICT DO UPDATE SET
                              accepted = accepted + excluded.accepted, tokens = tokens + excluded.tokens""",
                [(p, a, t) for p, (a, t) in producers.items()],
            )
        self._since_prune += len(entries)
        if self._since_prune >= PRUNE_EVERY:
            self._since_prune = 0
            self.prune_ledger()
        return len(entries)

    def _name_ids(self, db: sqlite3.Connection, values: set[Any]) -> dict[Any, int]:
        """The `ledger_names` id of each value, adding the new ones (inside the caller's transaction)."""
        out: dict[Any, int] = {}
        for v in values:
            known = self._names.get(v)
            if known is None:
                row = db.execute("SELECT id FROM ledger_names WHERE value = ?", (v,)).fetchone()
                if row is None:
                    row = db.execute("INSERT INTO ledger_names(value) VALUES(?) RETURNING id", (v,)).fetchone()
                    self._names_added += 1
                known = int(row[0])
                if len(self._names) >= NAMES_CACHED:
                    self._names.clear()
                self._names[v] = known
            out[v] = known
        return out

    def prune_ledger(self, now_ms: int | None = None) -> int:
        """Enforce the ledger budget on the oldest rows, at most `PRUNE_BATCH` of each kind; returns rows deleted.
        Every `NAMES_SWEEP_EVERY` new names, the names no row uses any more are deleted (one pass over the
        ledger, which the budget bounds)."""
        b = self.budget
        now_ms = _now_ms() if now_ms is None else now_ms
        with self.tx() as db:
            lo, top = db.execute(_SEQ_RANGE).fetchone()
            if top is None:
                return 0
            # Sequence numbers are dense and ts_ms grows with them: both cuts walk the primary key from the oldest row.
            cut = min(top - b.max_rows, lo + PRUNE_BATCH - 1)
            aged = db.execute(
                "SELECT MAX(seq) FROM (SELECT seq FROM ledger WHERE seq < ? AND ts_ms < ? ORDER BY seq)",
                (lo + PRUNE_BATCH, now_ms - int(b.max_age_s * 1000)),
            ).fetchone()[0]
            cut = max(cut, aged or 0)
            deleted = db.execute("DELETE FROM ledger WHERE seq <= ?", (cut,)).rowcount if cut >= lo else 0
            base = max(self._payload_floor, cut, lo - 1)
            strip_to = min(top - b.payload_rows, base + PRUNE_BATCH)
            db.execute("DELETE FROM ledger_payloads WHERE seq <= ?", (max(strip_to, cut),))
            if strip_to > base:
                self._payload_floor = strip_to
            if self._names_added >= NAMES_SWEEP_EVERY:
                self._names_added = 0
                self._names.clear()
                used = " UNION ".join(f"SELECT {c} FROM ledger WHERE {c} IS NOT NULL" for c in _NAMED)
                db.execute(f"DELETE FROM ledger_names WHERE id NOT IN ({used})")
        self.pruned += deleted
        return deleted

    def ledger_rows(self) -> int:
        """Rows in the ledger now (MAX-MIN on the primary key: no scan)."""
        lo, hi = self.query(_SEQ_RANGE)[0]
        return 0 if lo is None else int(hi - lo + 1)

    def disk_bytes(self) -> int:
        """The database with its write-ahead log."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            try:
                total += Path(str(self.path) + suffix).stat().st_size
            except OSError:
                pass
        return total

    def ledger_counts(self) -> dict[str, int]:
        rows = self.query("SELECT status, reason, n FROM ledger_totals")
        out: dict[str, int] = {}
        for status, reason, n in rows:
            key = f"{status}:{reason}" if reason else status
            out[key] = out.get(key, 0) + n
        return out

    def accepted_payloads(self, limit: int) -> list[bytes]:
        """The signed batches of the newest `limit` accepted rows that still keep a payload, oldest first."""
        rows = self.query(
            """SELECT p.payload FROM ledger_payloads p JOIN ledger l ON l.seq = p.seq WHERE l.status = 'accepted'
               ORDER BY p.seq DESC LIMIT ?""",
            (limit,),
        )
        return [r[0] for r in reversed(rows)]

    def contributions(self) -> list[dict[str, Any]]:
        """Accepted rollouts and tokens per producer: the basis of contribution accounting."""
        rows = self.query("SELECT producer, accepted, tokens FROM producer_totals")
        return [dict(producer=r[0] or None, accepted=r[1], tokens=r[2]) for r in rows]


def open_store(home: Path, budget: LedgerBudget | None = None, peer_budget: PeerBudget | None = None) -> Store:
    return Store(Path(home) / DB_FILE, budget, peer_budget)
