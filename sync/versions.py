"""Lineages: a publisher turns each new state into a signed patch; followers apply them.

The contract a follower relies on: after `apply` returns, the live tensors
hash (sync.hashing.state_hash) to the publisher-signed `target_hash` of the
version it now holds, bit for bit; when `apply` raises `PatchError`, the live
tensors are exactly as they were.

How apply keeps that contract without a second copy of the model:
1. everything that can be checked before touching the model is checked
   (signature, publisher, lineage, base version and base hash, every chunk
   hash, the payload checksum, every tensor's name/dtype/shape, positions
   in range);
2. the old bit patterns at the changed positions are gathered into staging
   (that is the only copy: O(changed elements));
3. the new values are scattered into the live tensors in place, the touched
   tensors are rehashed (the per-tensor digest cache covers the rest) and
   the state hash is compared with the signed target hash;
4. on a mismatch, or any exception in steps 3, the staged old values are
   scattered back (positions are unique, so this restores every bit) and
   `PatchError` is raised.
So a failing patch is briefly visible in the live tensors during step 3:
callers that serve inference from the same tensors concurrently must hold
their own lock around `apply`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from murmur.gossip.identity import Identity
from murmur.gossip.wire import FORMAT_VERSION, PATCH_MANIFEST, PatchManifest, now_ms, seal
from murmur.sync import chunks as chunking
from murmur.sync.catchup import Plan, choose
from murmur.sync.codec import (
    DEFAULT_LEVEL,
    FORMAT,
    PatchHeader,
    TensorChange,
    _Packer,
    assemble,
    check_layout,
    count_non_finite,
    decode_patch,
    diff_tensor,
    encode_tensor,
)
from murmur.sync.errors import NonFiniteWeights, PatchError
from murmur.sync.hashing import StateHasher, bits_view, canonical_state, dtype_name, state_hash
from murmur.sync.ids import Relation, lineage_id
from murmur.sync.items import StoredItem, diff_kind
from murmur.sync.patchstore import LineageStore, open_manifest

SPARSE = "sparse-v1"
UNION = "union-v1"
ANCHOR = "anchor-v1"
CODECS = (SPARSE, UNION, ANCHOR)


@dataclass(frozen=True)
class Lineage:
    publisher: bytes
    base_model_hash: bytes
    name: str

    @property
    def id(self) -> bytes:
        return lineage_id(self.publisher, self.base_model_hash, self.name)


@dataclass
class Bundle:
    """A signed manifest and the chunks it lists: what the broadcast moves."""

    manifest: PatchManifest
    envelope: bytes
    chunks: list[bytes]

    @property
    def payload(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class Applied:
    """What an apply changed, so a caller can mirror it (e.g. into an fp32 model copy)."""

    version: int
    state_hash: bytes
    codec: str
    changed: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> int64 flat indices; all for anchors


def _layout(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}


def make_bundle(
    identity: Identity,
    lineage: Lineage,
    codec: str,
    base_version: int,
    target_version: int,
    base_hash: bytes,
    target_hash: bytes,
    payload: bytes,
    chunk_bytes: int,
    *,
    swarm: str,
) -> Bundle:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec}")
    if identity.public != lineage.publisher:
        raise ValueError("only the lineage publisher can sign its manifests")
    cb = chunking.effective_chunk_bytes(len(payload), chunk_bytes)
    parts = chunking.split(payload, cb)
    manifest = PatchManifest(
        v=FORMAT_VERSION,
        lineage=lineage.id,
        lineage_name=lineage.name,
        base_model_hash=lineage.base_model_hash,
        publisher=lineage.publisher,
        base_version=base_version,
        target_version=target_version,
        base_hash=base_hash,
        target_hash=target_hash,
        codec=codec,
        total_bytes=len(payload),
        chunk_bytes=cb,
        chunks=chunking.refs(parts),
        created_ms=now_ms(),
    )
    return Bundle(manifest, seal(identity, PATCH_MANIFEST, manifest, swarm=swarm), parts)


def encode_states(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    base_hash: bytes,
    target_hasher: StateHasher | None = None,
    level: int = DEFAULT_LEVEL,
) -> tuple[bytes, bytes, dict[str, TensorChange], dict[str, bytes]]:
    """(payload, target hash, changes, new per-tensor digests) for base -> target.

    With `target_hasher` holding the digests of `base`, only the changed
    tensors of `target` are hashed.
    """
    check_layout(base, target)
    packer = _Packer(level)
    entries, blobs, changes = [], [], {}
    for name in sorted(base):
        b, t = bits_view(base[name]), bits_view(target[name])
        idx = diff_tensor(b, t)
        if idx.size == 0:
            continue
        entry, streams, change = encode_tensor(
            name, dtype_name(base[name].dtype), tuple(base[name].shape), b, t, idx, packer
        )
        entries.append(entry)
        blobs.extend(streams)
        changes[name] = change
    if target_hasher is None:
        target_hasher = StateHasher(base)
    th, digests = target_hasher.preview(target, changes)
    return assemble(PatchHeader(FORMAT, base_hash, th, entries), blobs), th, changes, digests


def anchor_bytes(state: Mapping[str, torch.Tensor], lineage: Lineage, version: int, target_hash: bytes) -> bytes:
    """The anchor payload: a safetensors file of the state (transformers-loadable)."""
    from safetensors.torch import save

    meta = {
        "format": "pt",
        "murmur_lineage": lineage.id.hex(),
        "murmur_version": str(version),
        "murmur_state_hash": target_hash.hex(),
    }
    return save({n: t.detach().contiguous() for n, t in state.items()}, metadata=meta)


# ---------------------------------------------------------------- publisher


class LineagePublisher:
    """Owns a lineage: keeps the last published state and emits one signed patch per version.

    `state` is the base model (version 0) unless `version`/`base_model_hash`
    say otherwise (resuming). The publisher keeps its own copy of the last
    published state, updated in place from each patch (no full copy per step).
    """

    def __init__(
        self,
        identity: Identity,
        name: str,
        state: Mapping[str, torch.Tensor] | torch.nn.Module,
        home: Path | None = None,
        *,
        swarm: str,
        anchor_every: int = 16,
        chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
        retain_versions: int = 64,
        max_anchors: int = 4,
        config_json: Mapping[str, Any] | None = None,
        version: int = 0,
        base_model_hash: bytes | None = None,
        db: Any = None,
        level: int = DEFAULT_LEVEL,
    ) -> None:
        if anchor_every < 1:
            raise ValueError("anchor_every must be >= 1")
        self.identity = identity
        self.swarm = swarm  # the swarm its manifests are signed for
        src = canonical_state(state) if isinstance(state, torch.nn.Module) else dict(state)
        self.base = {n: t.detach().clone().contiguous() for n, t in src.items()}
        self.hasher = StateHasher(self.base)
        self.lineage = Lineage(identity.public, base_model_hash or self.hasher.hash, name)
        self.version = version
        self.anchor_every = anchor_every
        self.chunk_bytes = chunk_bytes
        self.retain_versions = retain_versions
        self.max_anchors = max_anchors
        self.config_json = dict(config_json) if config_json is not None else None
        self.level = level
        self.db = db
        if db is not None:
            db.add_lineage(self.lineage.id, name, identity.public, self.lineage.base_model_hash, Relation.OWN)
        self.store = LineageStore(home, self.lineage.id) if home is not None else None
        if self.store is not None:
            self.store.write_info(
                {
                    "id": self.lineage.id.hex(),
                    "name": name,
                    "publisher": identity.public.hex(),
                    "base_model_hash": self.lineage.base_model_hash.hex(),
                }
            )
            if self.version % anchor_every == 0 and self.version not in self.store.anchors():
                self._write_anchor()

    @classmethod
    def resume(cls, identity: Identity, home: Path, lineage: bytes, *, swarm: str, **kw: Any) -> LineagePublisher:
        """Reopen a lineage from its store at its head version."""
        store = LineageStore(home, lineage)
        info = store.read_info()
        head = store.head()
        if info is None or head is None:
            raise PatchError(f"no stored lineage {lineage.hex()} in {home}")
        state = store.load_state(head, swarm=swarm)
        return cls(
            identity,
            info["name"],
            state,
            home,
            swarm=swarm,
            version=head,
            base_model_hash=bytes.fromhex(info["base_model_hash"]),
            **kw,
        )

    @property
    def state_hash(self) -> bytes:
        return self.hasher.hash

    def publish(self, new_state: Mapping[str, torch.Tensor] | torch.nn.Module) -> Bundle:
        """Encode `new_state` as version+1 against the last published state, sign, store, return it."""
        new = canonical_state(new_state) if isinstance(new_state, torch.nn.Module) else new_state
        base_hash = self.hasher.hash
        payload, target_hash, changes, digests = encode_states(self.base, new, base_hash, self.hasher, self.level)
        for name, ch in changes.items():  # before anything is signed: followers would refuse it and charge us
            bad = count_non_finite(ch.new, dtype_name(self.base[name].dtype))
            if bad:
                raise NonFiniteWeights(f"version {self.version + 1} not published: {bad} non-finite values in {name}")
        bundle = make_bundle(
            self.identity,
            self.lineage,
            SPARSE,
            self.version,
            self.version + 1,
            base_hash,
            target_hash,
            payload,
            self.chunk_bytes,
            swarm=self.swarm,
        )
        for name, ch in changes.items():
            bits_view(self.base[name])[ch.idx] = ch.new
        self.hasher.commit(digests, target_hash)
        self.version += 1
        path = None
        if self.store is not None:
            path = str(self.store.put_patch(bundle.manifest, bundle.envelope, payload))
        if self.db is not None:
            self.db.add_version(
                self.lineage.id, self.version, target_hash, "patch", self.version - 1, bundle.envelope, path, held=True
            )
        if self.store is not None and self.version % self.anchor_every == 0:
            self._write_anchor()
        if self.store is not None:
            self.store.prune(self.retain_versions, self.max_anchors)
        return bundle

    def _write_anchor(self) -> Bundle:
        data = anchor_bytes(self.base, self.lineage, self.version, self.hasher.hash)
        bundle = make_bundle(
            self.identity,
            self.lineage,
            ANCHOR,
            self.version,
            self.version,
            b"",
            self.hasher.hash,
            data,
            self.chunk_bytes,
            swarm=self.swarm,
        )
        assert self.store is not None
        d = self.store.put_anchor(self.version, data, bundle.envelope, self.config_json)
        if self.db is not None:
            self.db.add_version(
                self.lineage.id,
                self.version,
                self.hasher.hash,
                "anchor",
                self.version,
                bundle.envelope,
                str(d),
                held=True,
            )
        return bundle

    # ------------------------------------------------------------ serving catch-up
    def _need_store(self) -> LineageStore:
        if self.store is None:
            raise PatchError("this publisher has no store (home=None)")
        return self.store

    def stored(self, item: StoredItem) -> Bundle:
        """The bundle of a stored patch, union or anchor."""
        store = self._need_store()
        env, payload = (
            store.read_anchor(item.target) if item.kind == "anchor" else store.read_patch(item.base, item.target)
        )
        manifest = open_manifest(env, swarm=self.swarm)
        return Bundle(manifest, env, chunking.split(payload, manifest.chunk_bytes))

    def union(self, a: int, b: int | None = None) -> Bundle:
        """One patch from version a to b (default: head), built from the store and kept there."""
        store = self._need_store()
        b = self.version if b is None else b
        if not 0 <= a < b <= self.version:
            raise PatchError(f"bad union range {a}..{b} (head {self.version})")
        if store.has_patch(a, b):
            return self.stored(StoredItem(diff_kind(a, b), a, b, 0))
        base = store.load_state(a, swarm=self.swarm)
        target = self.base if b == self.version else store.load_state(b, swarm=self.swarm)
        bh = state_hash(base)
        payload, th, _, _ = encode_states(base, target, bh, None, self.level)
        bundle = make_bundle(
            self.identity,
            self.lineage,
            UNION if b > a + 1 else SPARSE,
            a,
            b,
            bh,
            th,
            payload,
            self.chunk_bytes,
            swarm=self.swarm,
        )
        store.put_patch(bundle.manifest, bundle.envelope, payload)
        return bundle

    def catch_up(self, have: int | None, build_union: bool = True) -> tuple[Plan, list[Bundle]]:
        """The cheapest plan from `have` to the head, and its bundles in apply order.

        With `build_union`, a union have->head is built first (if absent) so the
        chooser can compare it with the chain and the anchors by real sizes.
        """
        store = self._need_store()
        if build_union and have is not None and self.version - have > 1 and not store.has_patch(have, self.version):
            try:
                self.union(have)
            except PatchError:
                pass  # the window was pruned: chain or anchor will do
        plan = choose(have, self.version, store.items())
        return plan, [self.stored(s) for s in plan.steps]


# ---------------------------------------------------------------- follower


class LineageFollower:
    """Tracks a lineage: applies its patches and anchors to live tensors, all-or-nothing.

    `state` holds the live tensors (e.g. `canonical_state(model)`, which shares
    memory with the model) at `version`, whose hash is `expected_hash` when
    given (checked once here). The follower assumes nobody else writes the
    tensors between applies: it keeps per-tensor digests and rehashes only
    what a patch touches. `verify_state()` rehashes everything.
    """

    def __init__(
        self,
        lineage: Lineage,
        state: Mapping[str, torch.Tensor] | torch.nn.Module,
        version: int = 0,
        expected_hash: bytes | None = None,
        home: Path | None = None,
        db: Any = None,
        keep_patches: bool = True,
        *,
        swarm: str,
    ) -> None:
        self.lineage = lineage
        self.swarm = swarm  # manifests signed for another swarm are refused
        self.live = canonical_state(state) if isinstance(state, torch.nn.Module) else dict(state)
        for t in self.live.values():
            bits_view(t)  # dtype/contiguity check up front
        self.hasher = StateHasher(self.live)
        if expected_hash is not None and expected_hash != self.hasher.hash:
            raise PatchError(f"held state does not match the hash of version {version}")
        if version == 0 and expected_hash is None and self.hasher.hash != lineage.base_model_hash:
            raise PatchError("held state is not the lineage's base model")
        self.version = version
        self.layout = _layout(self.live)
        self.store = LineageStore(home, lineage.id) if home is not None else None
        self.keep_patches = keep_patches
        self.db = db
        if db is not None:
            db.add_lineage(lineage.id, lineage.name, lineage.publisher, lineage.base_model_hash, Relation.FOLLOW)

    @property
    def state_hash(self) -> bytes:
        return self.hasher.hash

    def verify_state(self) -> bool:
        """Full rehash of the live tensors against the held version's hash."""
        return state_hash(self.live) == self.hasher.hash

    def check_manifest(self, envelope: bytes) -> PatchManifest:
        """Signature, publisher and lineage checks; raises PatchError naming the problem."""
        # the signature again, as defence in depth: the network process verified it when the manifest arrived
        # (sync/transfers.py, authoritative), but what is applied here is read back from the lineage store
        m = open_manifest(envelope, swarm=self.swarm)
        if m.publisher != self.lineage.publisher:
            raise PatchError("manifest signed by a key that is not the lineage publisher")
        if m.lineage != self.lineage.id or lineage_id(m.publisher, m.base_model_hash, m.lineage_name) != m.lineage:
            raise PatchError("manifest is for another lineage")
        if m.codec not in CODECS:
            raise PatchError(f"unknown patch codec {m.codec!r}")
        if m.codec == ANCHOR:
            if m.base_version != m.target_version or m.base_hash:
                raise PatchError("anchor manifest with a base")
            if m.target_version < self.version:
                raise PatchError(f"stale anchor: version {m.target_version} is behind the held {self.version}")
        else:
            if m.codec == SPARSE and m.target_version != m.base_version + 1:
                raise PatchError("sparse-v1 patch must advance exactly one version")
            if m.codec == UNION and m.target_version <= m.base_version:
                raise PatchError("union patch does not advance")
            if m.base_version != self.version or m.base_hash != self.hasher.hash:
                raise PatchError(
                    f"wrong base: patch is {m.base_version}->{m.target_version}, "
                    f"held version is {self.version}"
                    + ("" if m.base_version != self.version else " with a different hash")
                )
        return m

    def apply(self, envelope: bytes, chunks: Sequence[bytes | memoryview | None]) -> Applied:
        """Apply a signed patch, union or anchor; all-or-nothing (see the module docstring)."""
        m = self.check_manifest(envelope)
        return self._apply(m, envelope, chunking.join_verified(m, chunks))

    def apply_stored(self, envelope: bytes, payload: bytes) -> Applied:
        """`apply` of an item as a lineage store holds it, its payload whole (each chunk's hash still checked)."""
        m = self.check_manifest(envelope)
        return self._apply(m, envelope, chunking.join_verified(m, chunking.split(payload, m.chunk_bytes)))

    def _apply(self, m: PatchManifest, envelope: bytes, payload: bytes) -> Applied:
        applied = self._apply_anchor(m, payload) if m.codec == ANCHOR else self._apply_patch(m, payload)
        self._record(m, envelope, payload)
        return applied

    def _apply_patch(self, m: PatchManifest, payload: bytes) -> Applied:
        header, staged = decode_patch(payload, self.layout)
        if header.base_hash != m.base_hash or header.target_hash != m.target_hash:
            raise PatchError("payload hashes disagree with the manifest")
        views = {s.name: bits_view(self.live[s.name]) for s in staged}
        old = {s.name: views[s.name][s.idx] for s in staged}  # staging: old bits at changed positions
        new = {s.name: s.new_values(old[s.name]) for s in staged}
        for s in staged:  # before any write: a signed patch that makes a weight NaN is refused whole
            bad = count_non_finite(new[s.name], s.dtype, was=old[s.name])
            if bad:
                raise NonFiniteWeights(
                    f"patch {m.base_version}->{m.target_version} makes {bad} values of {s.name} non-finite"
                )
        positions = {s.name: s.idx for s in staged}
        done: list[str] = []
        try:
            for s in staged:
                views[s.name][s.idx] = new[s.name]
                done.append(s.name)
            th, digests = self.hasher.preview(self.live, done)
            if th != m.target_hash:
                raise PatchError(f"target hash mismatch after applying {m.base_version}->{m.target_version}")
        except BaseException:
            for name in done:
                views[name][positions[name]] = old[name]
            raise
        self.hasher.commit(digests, th)
        self.version = m.target_version
        return Applied(self.version, th, m.codec, {s.name: torch.from_numpy(s.idx) for s in staged})

    def _apply_anchor(self, m: PatchManifest, payload: bytes) -> Applied:
        from safetensors.torch import load

        try:
            loaded = load(payload)
        except Exception as e:  # safetensors raises its own error types on garbage
            raise PatchError(f"anchor is not a valid safetensors file: {e}") from None
        if _layout(loaded) != self.layout:
            raise PatchError("anchor tensors do not match the model's names, dtypes or shapes")
        hasher = StateHasher(loaded)
        if hasher.hash != m.target_hash:
            raise PatchError(f"anchor {m.target_version} does not match its signed hash")
        for n, t in loaded.items():  # non-finite only where the held state is too (a model's own masks)
            if t.is_floating_point():
                bad = int((~torch.isfinite(t) & torch.isfinite(self.live[n])).sum())
                if bad:
                    raise NonFiniteWeights(f"anchor {m.target_version} makes {bad} values of {n} non-finite")
        with torch.no_grad():
            for n, t in loaded.items():
                self.live[n].copy_(t)
        self.hasher = hasher
        self.version = m.target_version
        return Applied(self.version, hasher.hash, m.codec, {n: torch.arange(t.numel()) for n, t in self.live.items()})

    def _record(self, m: PatchManifest, envelope: bytes, payload: bytes) -> None:
        path = None
        if self.store is not None and self.keep_patches:
            if m.codec == ANCHOR:
                path = str(self.store.put_anchor(m.target_version, payload, envelope))
            else:
                path = str(self.store.put_patch(m, envelope, payload))
        if self.db is not None:
            kind = {SPARSE: "patch", UNION: "union", ANCHOR: "anchor"}[m.codec]
            self.db.add_version(
                self.lineage.id, m.target_version, m.target_hash, kind, m.base_version, envelope, path, held=True
            )

    def catch_up_plan(self, head: int, items: Sequence[StoredItem]) -> Plan:
        """Cheapest plan from the held version to `head` over what peers offer (`items`)."""
        return choose(self.version, head, items)


def save_anchor_dir(
    directory: Path,
    state: Mapping[str, torch.Tensor],
    config_json: Mapping[str, Any] | None,
    metadata_lineage: Lineage | None = None,
    version: int = 0,
) -> Path:
    """Write a transformers-loadable folder (model.safetensors + config.json) from a state."""
    from murmur.sync.atomic import atomic_write

    directory = Path(directory)
    lin = metadata_lineage or Lineage(b"\0" * 32, b"\0" * 32, "local")
    atomic_write(directory / "model.safetensors", anchor_bytes(state, lin, version, state_hash(state)))
    if config_json is not None:
        atomic_write(directory / "config.json", json.dumps(dict(config_json), indent=1).encode())
    return directory


__all__ = [
    "Lineage",
    "Bundle",
    "Applied",
    "LineagePublisher",
    "LineageFollower",
    "make_bundle",
    "encode_states",
    "anchor_bytes",
    "save_anchor_dir",
    "SPARSE",
    "UNION",
    "ANCHOR",
]
