"""On-disk store of one lineage's anchors and patches in the node home.

Layout (docs/patches.md, "Storage layout"):

    <home>/lineages/<lineage id hex>/
        lineage.json                         id, name, publisher, base model hash (hex)
        anchors/<version:012d>/model.safetensors   loadable by transformers
        anchors/<version:012d>/config.json         when the publisher provides one
        anchors/<version:012d>/manifest.env        signed anchor-v1 manifest (written last)
        patches/<base:012d>-<target:012d>.bin      sparse-v1 / union-v1 payload
        patches/<base:012d>-<target:012d>.env      its signed manifest (written last)
        partial/<manifest content id hex>/<i>.chunk  chunks of a download in progress

Every file is written atomically (temp, fsync, rename) and the signed
manifest is written after its payload, so an entry exists only when complete:
a crash leaves at worst an orphan payload that the next prune removes.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from murmur.gossip.errors import DecodeError
from murmur.gossip.wire import PATCH_MANIFEST, PatchManifest, content_id, open_envelope
from murmur.sync.atomic import atomic_write
from murmur.sync.errors import PatchError
from murmur.sync.items import StoredItem, diff_kind

if TYPE_CHECKING:
    import torch

ANCHOR_FILE = "model.safetensors"
WRITE_GRACE_S = 120.0  # a temp file or manifest-less payload younger than this may be a write in progress
_PATCH_RE = re.compile(r"^(\d{12})-(\d{12})\.env$")


def open_manifest(envelope: bytes, *, swarm: str) -> PatchManifest:
    """Verify a manifest envelope signed for `swarm`; any failure is a PatchError."""
    try:
        _, body = open_envelope(envelope, expect=PATCH_MANIFEST, swarm=swarm)
    except DecodeError as e:
        raise PatchError(f"bad patch manifest: {e}") from None
    return body


class LineageStore:
    def __init__(self, home: Path, lineage: bytes) -> None:
        self.lineage = lineage
        self.root = Path(home) / "lineages" / lineage.hex()
        (self.root / "anchors").mkdir(parents=True, exist_ok=True)
        (self.root / "patches").mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ metadata
    def write_info(self, info: Mapping[str, Any]) -> None:
        atomic_write(self.root / "lineage.json", json.dumps(dict(info), indent=1).encode())

    def read_info(self) -> dict[str, Any] | None:
        p = self.root / "lineage.json"
        return json.loads(p.read_text()) if p.exists() else None

    # ------------------------------------------------------------ patches
    def _patch_paths(self, base: int, target: int) -> tuple[Path, Path]:
        stem = self.root / "patches" / f"{base:012d}-{target:012d}"
        return stem.with_suffix(".bin"), stem.with_suffix(".env")

    def put_patch(self, manifest: PatchManifest, envelope: bytes, payload: bytes) -> Path:
        if manifest.codec not in ("sparse-v1", "union-v1"):
            raise ValueError(f"not a patch codec: {manifest.codec}")
        binp, envp = self._patch_paths(manifest.base_version, manifest.target_version)
        atomic_write(binp, payload)
        atomic_write(envp, envelope)
        return binp

    def has_patch(self, base: int, target: int) -> bool:
        return self._patch_paths(base, target)[1].exists()

    def read_patch(self, base: int, target: int) -> tuple[bytes, bytes]:
        """(manifest envelope, payload); PatchError when absent."""
        binp, envp = self._patch_paths(base, target)
        try:
            return envp.read_bytes(), binp.read_bytes()
        except FileNotFoundError:
            raise PatchError(f"no stored patch {base}->{target}") from None

    # ------------------------------------------------------------ anchors
    def anchor_dir(self, version: int) -> Path:
        return self.root / "anchors" / f"{version:012d}"

    def put_anchor(
        self, version: int, file_bytes: bytes, envelope: bytes, config_json: Mapping[str, Any] | None = None
    ) -> Path:
        d = self.anchor_dir(version)
        atomic_write(d / ANCHOR_FILE, file_bytes)
        if config_json is not None:
            atomic_write(d / "config.json", json.dumps(dict(config_json), indent=1).encode())
        atomic_write(d / "manifest.env", envelope)
        return d

    def read_anchor(self, version: int) -> tuple[bytes, bytes]:
        d = self.anchor_dir(version)
        try:
            return (d / "manifest.env").read_bytes(), (d / ANCHOR_FILE).read_bytes()
        except FileNotFoundError:
            raise PatchError(f"no stored anchor at version {version}") from None

    def anchors(self) -> list[int]:
        out = []
        for d in (self.root / "anchors").iterdir():
            if d.name.isdigit() and (d / "manifest.env").exists():
                out.append(int(d.name))
        return sorted(out)

    # ------------------------------------------------------------ catalog
    def items(self) -> list[StoredItem]:
        """Everything held, with payload sizes: the input of the catch-up chooser."""
        out = [StoredItem("anchor", v, v, (self.anchor_dir(v) / ANCHOR_FILE).stat().st_size) for v in self.anchors()]
        for p in (self.root / "patches").iterdir():
            m = _PATCH_RE.match(p.name)
            if not m:
                continue
            base, target = int(m.group(1)), int(m.group(2))
            binp = p.with_suffix(".bin")
            if binp.exists():
                out.append(StoredItem(diff_kind(base, target), base, target, binp.stat().st_size))
        return sorted(out, key=lambda i: (i.target, i.base, i.kind))

    def head(self) -> int | None:
        targets = [i.target for i in self.items()]
        return max(targets) if targets else None

    # ------------------------------------------------------------ downloads in progress
    def partial_dir(self, envelope: bytes) -> Path:
        return self.root / "partial" / content_id(envelope).hex()

    # ------------------------------------------------------------ replay
    def load_state(self, version: int, *, swarm: str) -> dict[str, torch.Tensor]:
        """The state at `version`: the newest anchor at or below it plus the stored patch chain
        (its manifests signed for `swarm`).

        The result is checked against the publisher-signed hash of `version`.
        """
        anchors = [a for a in self.anchors() if a <= version]
        if not anchors:
            raise PatchError(f"no anchor at or below version {version}")
        # Local imports: the network process stores patches as bytes and never needs torch.
        from safetensors.torch import load_file

        from murmur.sync.codec import decode_patch
        from murmur.sync.hashing import bits_view, state_hash

        start = anchors[-1]
        env, _ = self.read_anchor(start)
        want = open_manifest(env, swarm=swarm).target_hash
        state = load_file(str(self.anchor_dir(start) / ANCHOR_FILE))
        layout = {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}
        for v in range(start, version):
            env, payload = self.read_patch(v, v + 1)
            want = open_manifest(env, swarm=swarm).target_hash
            _, staged = decode_patch(payload, layout)
            for s in staged:
                view = bits_view(state[s.name])
                view[s.idx] = s.new_values(view[s.idx])
        if state_hash(state) != want:
            raise PatchError(f"replayed state at version {version} does not match its signed hash")
        return state

    # ------------------------------------------------------------ retention
    def prune(self, retain_versions: int, max_anchors: int = 4) -> list[str]:
        """Drop what catch-up no longer needs; returns the removed file names.

        Kept: the newest anchor at or below `head - retain_versions` (the
        floor), every newer anchor (at most `max_anchors`, newest first; the
        floor moves up when that cap bites), and every patch or union whose
        base is at or after the floor, so every kept version can be replayed
        from a kept anchor.
        Orphan payloads (no manifest: an interrupted write) and temp files are
        removed too once older than `WRITE_GRACE_S`: a younger one may be a
        store in progress in another thread or process (the live node stores
        completed transfers concurrently).
        """
        import time

        now = time.time()
        head = self.head()
        removed: list[str] = []
        if head is None:
            return removed
        window_start = max(0, head - retain_versions)
        anchors = self.anchors()
        # Without any anchor nothing can be replayed from here: only the window serves peers' catch-up.
        floor = max([a for a in anchors if a <= window_start], default=anchors[0] if anchors else window_start)
        keep_anchors = [a for a in anchors if a >= floor][-max(1, max_anchors) :]
        floor = keep_anchors[0] if keep_anchors else floor
        for a in anchors:
            if a not in keep_anchors:
                shutil.rmtree(self.anchor_dir(a), ignore_errors=True)
                removed.append(f"anchors/{a:012d}")
        for p in sorted((self.root / "patches").iterdir()):
            if p.name.startswith("."):
                if _older_than(p, now, WRITE_GRACE_S):
                    p.unlink(missing_ok=True)
                continue
            m = re.match(r"^(\d{12})-(\d{12})\.(bin|env)$", p.name)
            if not m:
                continue
            base = int(m.group(1))
            orphan = m.group(3) == "bin" and not p.with_suffix(".env").exists() and _older_than(p, now, WRITE_GRACE_S)
            if orphan or base < floor:
                p.unlink(missing_ok=True)
                removed.append(f"patches/{p.name}")
        return removed


def _older_than(p: Path, now: float, seconds: float) -> bool:
    try:
        return now - p.stat().st_mtime > seconds
    except FileNotFoundError:
        return False
