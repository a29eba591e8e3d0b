"""No non-finite weight crosses a lineage (issue 26): a publisher never signs a version whose new
values are NaN or +-inf, and a follower refuses a signed patch or anchor that would make one of its
weights so, keeping the state it held bit for bit (the publisher signed it: its provable fault)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from murmur.sync.codec import count_non_finite
from murmur.sync.errors import NonFiniteWeights
from murmur.sync.hashing import bits_view, state_hash
from murmur.sync.versions import (
    ANCHOR,
    SPARSE,
    LineageFollower,
    LineagePublisher,
    anchor_bytes,
    encode_states,
    make_bundle,
)
from tests.test_lineage import Trainer, assert_untouched, snapshot

SWARM = "test"

torch.set_num_threads(1)


def poisoned(state: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in state.items()}
    out["layer.0.weight"].view(-1)[17] = value
    out["layer.0.bias"][3] = value  # fp32 as well as bf16
    return out


@pytest.fixture
def lineage(identity):
    tr = Trainer()
    pub = LineagePublisher(identity, "poison", tr.state(), None, chunk_bytes=1024, swarm=SWARM)
    live = tr.state()
    return tr, pub, LineageFollower(pub.lineage, live, 0, swarm=SWARM), live


def test_non_finite_bit_patterns_are_counted_per_dtype() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        t = torch.tensor([0.0, -1.5, 3e-3, math.nan, math.inf, -math.inf, 65504.0], dtype=dtype)
        name = str(dtype).split(".")[1]
        assert count_non_finite(bits_view(t), name) == 3, name
        was = bits_view(torch.tensor([1.0, 1.0, 1.0, math.nan, 1.0, 1.0, 1.0], dtype=dtype))
        assert count_non_finite(bits_view(t), name, was=was) == 2, name
    assert count_non_finite(bits_view(torch.tensor([-1, 2**31 - 1], dtype=torch.int32)), "int32") == 0


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_signed_patch_carrying_non_finite_values_is_refused_and_the_state_kept(lineage, identity, value) -> None:
    tr, pub, fol, live = lineage
    b1 = pub.publish(tr.step())
    fol.apply(b1.envelope, b1.chunks)
    held, snap = fol.state_hash, snapshot(live)
    # the publisher's key signs a patch to a NaN state: correct chunks, correct target hash
    bad_state = poisoned(tr.step(), value)
    payload, th, _, _ = encode_states(pub.base, bad_state, pub.state_hash)
    assert th == state_hash(bad_state)
    bad = make_bundle(identity, fol.lineage, SPARSE, 1, 2, pub.state_hash, th, payload, 1024, swarm=SWARM)
    with pytest.raises(NonFiniteWeights, match="non-finite"):
        fol.apply(bad.envelope, bad.chunks)
    assert_untouched(live, snap)
    assert fol.version == 1 and fol.state_hash == held and fol.verify_state()
    assert all(bool(torch.isfinite(t).all()) for t in live.values())
    # the honest next version still applies on the kept state
    b2 = pub.publish(tr.step())
    assert fol.apply(b2.envelope, b2.chunks).version == 2


def test_a_signed_anchor_carrying_non_finite_values_is_refused(lineage, identity) -> None:
    tr, pub, fol, live = lineage
    bad_state = poisoned(tr.step(), math.nan)
    th = state_hash(bad_state)
    data = anchor_bytes(bad_state, fol.lineage, 5, th)
    bad = make_bundle(identity, fol.lineage, ANCHOR, 5, 5, b"", th, data, 1 << 16, swarm=SWARM)
    snap = snapshot(live)
    with pytest.raises(NonFiniteWeights, match="anchor 5"):
        fol.apply(bad.envelope, bad.chunks)
    assert_untouched(live, snap)
    assert fol.version == 0 and fol.verify_state()


def test_a_publisher_never_signs_a_non_finite_version(lineage) -> None:
    tr, pub, fol, live = lineage
    with pytest.raises(NonFiniteWeights, match="not published"):
        pub.publish(poisoned(tr.step(), math.nan))
    assert pub.version == 0 and np.array_equal(
        bits_view(pub.base["layer.0.weight"]), bits_view(Trainer().state()["layer.0.weight"])
    )
    b = pub.publish(tr.step())  # the next finite state is version 1, against the last published one
    assert b.manifest.target_version == 1
    assert fol.apply(b.envelope, b.chunks).version == 1


def test_the_attack_bench_scans_every_state_a_node_holds(identity, tmp_path) -> None:
    """`murmur bench attacks`' honest_models_finite: a publisher's replayed head and anchors, and a
    follower checkpoint, scanned; one NaN anywhere makes it false."""
    from safetensors.torch import save_file

    from murmur.simulations.bench.attacks import models_finite

    tr = Trainer(4)
    pub = LineagePublisher(identity, "scan", tr.state(), tmp_path, anchor_every=2, swarm=SWARM)
    for _ in range(3):
        pub.publish(tr.step())
    ok, n = models_finite(tmp_path, SWARM)
    assert ok and n >= 3  # the head replayed, plus the anchors at 0 and 2
    assert models_finite(tmp_path, "another-swarm") == (True, n - 1)  # its manifests do not open there
    ck = tmp_path / "follow" / "ab" / "state.safetensors"
    ck.parent.mkdir(parents=True)
    save_file(poisoned(tr.state(), math.nan), str(ck))
    assert models_finite(tmp_path, SWARM) == (False, n + 1)
