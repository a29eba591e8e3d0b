"""Publisher/follower: bit-exact versions, all-or-nothing apply, unions and the catch-up chooser."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from murmur.gossip.errors import DecodeError
from murmur.gossip.wire import PATCH_MANIFEST, PatchManifest, open_envelope, seal
from murmur.sync.catchup import choose
from murmur.sync.chunks import refs, split
from murmur.sync.errors import PatchError
from murmur.sync.hashing import bits_view, state_hash
from murmur.sync.ids import lineage_id
from murmur.sync.patchstore import StoredItem
from murmur.sync.versions import (
    ANCHOR,
    SPARSE,
    UNION,
    Lineage,
    LineageFollower,
    LineagePublisher,
    encode_states,
    make_bundle,
)

SWARM = "test"

torch.set_num_threads(1)


class Trainer:
    """An fp32 master whose bf16/fp32 copy is published: a few real-looking sparse updates per step."""

    def __init__(self, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.master = {
            "layer.0.weight": torch.randn(96, 64, generator=self.g) * 0.02,
            "layer.0.bias": torch.zeros(64),
            "norm.weight": torch.ones(64),
            "embed.weight": torch.randn(200, 32, generator=self.g) * 0.02,
        }

    def state(self) -> dict[str, torch.Tensor]:
        return {n: (t.clone() if n.endswith("bias") else t.to(torch.bfloat16)) for n, t in self.master.items()}

    def step(self, lr: float = 2e-5) -> dict[str, torch.Tensor]:
        for n, t in self.master.items():
            if not n.startswith("norm"):
                t.add_(torch.sign(torch.randn(t.shape, generator=self.g)) * lr)
        return self.state()


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: bits_view(t).copy() for n, t in state.items()}


def assert_untouched(state: dict[str, torch.Tensor], snap: dict[str, np.ndarray]) -> None:
    for n, t in state.items():
        assert np.array_equal(bits_view(t), snap[n]), n


@pytest.fixture
def setup(identity):
    tr = Trainer()
    pub = LineagePublisher(identity, "test-lineage", tr.state(), None, chunk_bytes=1024, swarm=SWARM)
    live = tr.state()
    fol = LineageFollower(pub.lineage, live, 0, swarm=SWARM)
    return tr, pub, fol, live


def test_lineage_id_binds_publisher_model_and_name(identity, other_identity) -> None:
    base = b"\x01" * 32
    a = lineage_id(identity.public, base, "x")
    assert len(a) == 32
    assert a != lineage_id(other_identity.public, base, "x")
    assert a != lineage_id(identity.public, b"\x02" * 32, "x")
    assert a != lineage_id(identity.public, base, "y")


def test_follower_tracks_publisher_bit_exactly(setup) -> None:
    tr, pub, fol, live = setup
    for v in range(1, 8):
        new = tr.step()
        b = pub.publish(new)
        assert b.manifest.codec == SPARSE and b.manifest.target_version == v
        assert len(b.chunks) > 1
        applied = fol.apply(b.envelope, b.chunks)
        assert applied.version == v == fol.version
        assert applied.state_hash == b.manifest.target_hash == state_hash(new) == state_hash(live)
        assert "norm.weight" not in applied.changed
    assert fol.verify_state()


def _one_patch(setup):
    tr, pub, fol, live = setup
    return pub.publish(tr.step()), fol, live


def test_wrong_base_leaves_state_untouched(setup) -> None:
    tr, pub, fol, live = setup
    pub.publish(tr.step())  # the follower misses version 1
    b2 = pub.publish(tr.step())
    snap = snapshot(live)
    with pytest.raises(PatchError, match="wrong base"):
        fol.apply(b2.envelope, b2.chunks)
    assert_untouched(live, snap)
    assert fol.version == 0


def test_missing_corrupt_and_truncated_chunks_are_rejected(setup) -> None:
    b, fol, live = _one_patch(setup)
    snap = snapshot(live)
    missing = list(b.chunks)
    missing[1] = None
    with pytest.raises(PatchError, match="chunk 1 is missing"):
        fol.apply(b.envelope, missing)
    with pytest.raises(PatchError, match="missing chunk"):
        fol.apply(b.envelope, b.chunks[:-1])
    corrupt = list(b.chunks)
    corrupt[0] = bytes([corrupt[0][0] ^ 1]) + corrupt[0][1:]
    with pytest.raises(PatchError, match="chunk 0 is corrupt"):
        fol.apply(b.envelope, corrupt)
    truncated = list(b.chunks)
    truncated[-1] = truncated[-1][:-1]
    with pytest.raises(PatchError, match="truncated"):
        fol.apply(b.envelope, truncated)
    assert_untouched(live, snap)
    assert fol.apply(b.envelope, b.chunks).version == 1


def test_truncated_payload_in_a_signed_manifest_is_rejected(setup, identity) -> None:
    """Even a publisher-signed manifest over a cut payload must not apply."""
    b, fol, live = _one_patch(setup)
    m = b.manifest
    bad = make_bundle(
        identity,
        fol.lineage,
        SPARSE,
        m.base_version,
        m.target_version,
        m.base_hash,
        m.target_hash,
        b.payload[:-40],
        1024,
        swarm=SWARM,
    )
    snap = snapshot(live)
    with pytest.raises(PatchError, match="truncated|checksum"):
        fol.apply(bad.envelope, bad.chunks)
    assert_untouched(live, snap)


def test_manifest_from_the_wrong_key_is_rejected(setup, other_identity) -> None:
    b, fol, live = _one_patch(setup)
    snap = snapshot(live)
    # a forger signs the same manifest contents under its own key
    forged = PatchManifest(**{f: getattr(b.manifest, f) for f in b.manifest.__struct_fields__})
    forged.publisher = other_identity.public
    env = seal(other_identity, PATCH_MANIFEST, forged, swarm=SWARM)
    with pytest.raises(PatchError, match="not the lineage publisher"):
        fol.apply(env, b.chunks)
    # or keeps the publisher field but cannot produce the publisher's signature
    env2 = bytearray(b.envelope)
    env2[-5] ^= 0xFF
    with pytest.raises(PatchError, match="signature|manifest"):
        fol.apply(bytes(env2), b.chunks)
    assert_untouched(live, snap)


def test_a_stored_manifest_the_network_would_refuse_is_refused_by_the_follower_too(setup) -> None:
    """A manifest's signature is checked where it reaches the node (sync/transfers.py opens it before taking
    any chunk: the authoritative check); the follower checks it again, as defence in depth, before applying
    what the lineage store holds. An envelope the first refuses is refused by the second, the state untouched."""
    b, fol, live = _one_patch(setup)
    env = bytearray(b.envelope)
    env[-5] ^= 0xFF  # in the signature
    with pytest.raises(DecodeError, match="signature"):
        open_envelope(bytes(env), expect=PATCH_MANIFEST, swarm=SWARM)
    snap = snapshot(live)
    with pytest.raises(PatchError, match="signature"):
        fol.apply_stored(bytes(env), b.payload)
    assert_untouched(live, snap)
    assert fol.apply_stored(b.envelope, b.payload).version == 1


def test_target_hash_mismatch_reverts_in_place_changes(setup, identity) -> None:
    """A signed patch whose payload does not produce its target hash: applied, detected, reverted."""
    tr, pub, fol, live = setup
    new = tr.step()
    payload, _, _, _ = encode_states(pub.base, new, pub.state_hash)
    # sign the payload against a lie: payload header and manifest agree, the result does not
    from murmur.sync.codec import PatchHeader, assemble, read_header

    header, off = read_header(payload)
    lie = b"\x07" * 32
    body = payload[off:-16]
    forged_payload = assemble(PatchHeader(header.v, header.base_hash, lie, header.tensors), [body])
    bad = make_bundle(identity, fol.lineage, SPARSE, 0, 1, pub.state_hash, lie, forged_payload, 1024, swarm=SWARM)
    snap = snapshot(live)
    with pytest.raises(PatchError, match="target hash mismatch"):
        fol.apply(bad.envelope, bad.chunks)
    assert_untouched(live, snap)
    assert fol.version == 0 and fol.verify_state()


def test_manifest_for_another_lineage_is_rejected(setup, identity) -> None:
    tr, pub, fol, live = setup
    other = LineagePublisher(identity, "other-name", tr.state(), None, swarm=SWARM)
    b = other.publish(tr.step())
    with pytest.raises(PatchError, match="another lineage"):
        fol.apply(b.envelope, b.chunks)


def test_union_equals_chain(setup) -> None:
    tr, pub, fol, live = setup
    start = {n: t.clone() for n, t in live.items()}
    start_hash = pub.state_hash
    chain_bytes = 0
    for _ in range(6):
        chain_bytes += pub.publish(tr.step()).manifest.total_bytes
    payload, th, _, _ = encode_states(start, pub.base, start_hash)
    assert th == pub.state_hash
    union = make_bundle(pub.identity, pub.lineage, UNION, 0, 6, start_hash, th, payload, 1024, swarm=SWARM)
    applied = fol.apply(union.envelope, union.chunks)
    assert applied.version == 6 and state_hash(live) == pub.state_hash
    assert union.manifest.total_bytes < chain_bytes


def test_publisher_store_serves_union_anchor_and_chain(identity, tmp_path) -> None:
    tr = Trainer(1)
    pub = LineagePublisher(
        identity,
        "stored",
        tr.state(),
        tmp_path,
        anchor_every=4,
        chunk_bytes=2048,
        config_json={"model_type": "test"},
        swarm=SWARM,
    )
    base0 = tr.state()
    for _ in range(10):
        pub.publish(tr.step())
    assert pub.store.anchors() == [0, 4, 8]
    # a follower at 5 gets the cheapest plan; whatever it is, it lands on the head bit-exactly
    fol = LineageFollower(pub.lineage, pub.store.load_state(5, swarm=SWARM), 5, expected_hash=None, swarm=SWARM)
    plan, bundles = pub.catch_up(5)
    assert plan.steps and plan.steps[-1].target == 10
    chain = sum(i.bytes for i in pub.store.items() if i.kind == "patch" and i.base >= 5)
    assert plan.total_bytes <= chain
    for b in bundles:
        fol.apply(b.envelope, b.chunks)
    assert fol.version == 10 and fol.state_hash == pub.state_hash
    # a fresh node starts from nothing: an anchor first
    plan0, bundles0 = pub.catch_up(None)
    assert plan0.steps[0].kind == "anchor"
    fresh = LineageFollower(pub.lineage, base0, 0, swarm=SWARM)
    for b in bundles0:
        fresh.apply(b.envelope, b.chunks)
    assert fresh.version == 10 and state_hash(base0) == pub.state_hash
    assert bundles0[0].manifest.codec == ANCHOR


def test_anchor_with_wrong_layout_is_rejected(identity, tmp_path) -> None:
    tr = Trainer(2)
    pub = LineagePublisher(identity, "anc", tr.state(), tmp_path, anchor_every=2, swarm=SWARM)
    pub.publish(tr.step())
    pub.publish(tr.step())
    b = pub.stored(StoredItem("anchor", 2, 2, 0))
    live = Trainer(2).state()
    live["extra"] = torch.zeros(3)
    fol = LineageFollower(
        Lineage(identity.public, pub.lineage.base_model_hash, "anc"),
        live,
        0,
        expected_hash=state_hash(live),
        swarm=SWARM,
    )
    snap = snapshot(live)
    with pytest.raises(PatchError, match="do not match"):
        fol.apply(b.envelope, b.chunks)
    assert_untouched(live, snap)


# ------------------------------------------------------------------ chooser


def _items(n: int, patch: int, anchors: dict[int, int], unions: dict[tuple[int, int], int]) -> list[StoredItem]:
    out = [StoredItem("patch", v, v + 1, patch) for v in range(n)]
    out += [StoredItem("anchor", v, v, s) for v, s in anchors.items()]
    out += [StoredItem("union", a, b, s) for (a, b), s in unions.items()]
    return out


def test_chooser_picks_the_cheapest() -> None:
    items = _items(20, 100, {0: 5000, 16: 1000}, {(10, 20): 500})
    assert choose(19, 20, items).kind == "chain"
    assert choose(19, 20, items).total_bytes == 100
    p = choose(10, 20, items)
    assert p.kind == "union" and p.total_bytes == 500
    p = choose(2, 20, items)  # 8 patches + union 10..20 = 1300 < anchor 16 + 4 patches = 1400 < 18 patches
    assert p.kind == "chain+union" and p.total_bytes == 1300
    p = choose(2, 20, _items(20, 100, {0: 5000, 16: 1000}, {}))
    assert p.kind == "anchor+chain" and p.total_bytes == 1400
    p = choose(None, 20, items)
    assert p.steps[0].kind == "anchor" and p.total_bytes == 1400
    assert choose(20, 20, items).kind == "none"
    with pytest.raises(PatchError):
        choose(None, 20, _items(20, 100, {}, {}))
    with pytest.raises(PatchError):
        choose(5, 20, [i for i in _items(20, 100, {}, {}) if i.base != 7])


def test_chooser_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = 12
        anchors = {int(v): int(rng.integers(500, 3000)) for v in rng.choice(n + 1, 2, replace=False)}
        unions = {}
        for _ in range(4):
            a, b = sorted(int(x) for x in rng.choice(n + 1, 2, replace=False))
            unions[(a, b)] = int(rng.integers(100, 900))
        items = _items(n, int(rng.integers(50, 300)), anchors, unions)
        have = int(rng.integers(0, n))
        plan = choose(have, n, items)

        def best(
            v: int, n: int = n, items: list = items
        ) -> float:  # brute force: cheapest cost to reach n from holding v
            if v == n:
                return 0
            return min(
                [i.bytes + best(i.target) for i in items if i.kind != "anchor" and i.base == v], default=float("inf")
            )

        brute = min([best(have)] + [a + best(v) for v, a in anchors.items()])
        assert plan.total_bytes == brute
        assert sum(s.bytes for s in plan.steps) == plan.total_bytes


def test_refs_and_split_round_trip() -> None:
    data = bytes(range(256)) * 40
    parts = split(data, 1000)
    assert b"".join(parts) == data and [r.size for r in refs(parts)][-1] == len(data) % 1000
