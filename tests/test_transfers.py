"""The multi-patch broadcast core as plain calls: for each rule, the events in and the actions it must (not) produce.

Real signed manifests, no streams: `sync.transfers.BroadcastCore` is what `sync.broadcast.BroadcastNode`
drives over libp2p (tests/test_broadcast.py runs that live).
"""

from __future__ import annotations

import hashlib
import random

import msgspec
import pytest

from murmur.gossip.errors import DecodeError
from murmur.gossip.identity import Identity
from murmur.gossip.wire import content_id, decode_envelope, encode
from murmur.simulations.bench.broadcast import make_patch
from murmur.sync.swarm import (
    Cancel,
    Chunk,
    Have,
    HaveChunk,
    Manifest,
    ManifestRequest,
    Penalise,
    Request,
    Send,
    ServeReady,
    SwarmConfig,
    bits_from_indices,
)
from murmur.sync.transfers import (
    Added,
    BroadcastCore,
    Complete,
    Disconnect,
    Evicted,
    Load,
    Stored,
    Transfer,
    UploadSlot,
    Wake,
)

SWARM = "test"

CHUNK = 8192
PUBLISHER = Identity.from_seed(hashlib.blake2b(b"transfers-test", digest_size=32).digest())
# queues long enough that one peer can hold requests in several chunks of several patches
ROOMY = SwarmConfig(max_queue_per_peer=8, max_queue_total=8)


def patch(version: int, nchunks: int = 4, short: int = 0) -> tuple[bytes, bytes, list[bytes]]:
    """(pid, signed manifest envelope, chunks) of a patch of `nchunks` chunks, the last `short` bytes short."""
    data = random.Random(version).randbytes(nchunks * CHUNK - short)
    env, chunks = make_patch(PUBLISHER, data, CHUNK, version=version, swarm=SWARM)
    return content_id(env), env, chunks


def of(actions: list, typ: type) -> list:
    return [a for a in actions if isinstance(a, typ)]


def sent(actions: list, typ: type) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and isinstance(a.frame, typ)]


def follow(core: BroadcastCore, env: bytes, held: dict[int, bytes] | None = None, now: float = 0.0) -> list:
    """Offer a manifest and read `held` from 'disk': the driver's part of following a patch."""
    pid = content_id(env)
    load = core.offer(env, now)
    assert load == [Load(pid, core.loading[pid][1])]
    return core.follow(pid, held or {}, now, 1000.0 + now)


def seeder(core: BroadcastCore, version: int) -> tuple[bytes, list[bytes]]:
    """The core holds every chunk of a patch (a completed follower: an ordinary seeder, no super-seeding)."""
    pid, env, chunks = patch(version)
    acts = follow(core, env, dict(enumerate(chunks)))
    assert of(acts, Complete) == [Complete(pid)]
    return pid, chunks


# ---------------------------------------------------------------- the transfer table


def test_full_table_evicts_the_oldest_unfinished_transfer_and_counts_it() -> None:
    core = BroadcastCore(max_transfers=3, swarm=SWARM)
    pids = []
    for v in (1, 2, 3):
        pid, env, _ = patch(v)
        acts = follow(core, env)
        assert of(acts, Evicted) == [] and of(acts, Added) == [Added(pid)]  # room left: nothing goes
        pids.append(pid)
    pid4, env4, _ = patch(4)
    acts = follow(core, env4)
    assert of(acts, Evicted) == [Evicted(pids[0])]  # the oldest
    assert list(core.transfers) == [pids[1], pids[2], pid4]
    assert core.counters["transfers_evicted"] == 1


def test_full_table_drops_a_finished_transfer_first_uncounted() -> None:
    core = BroadcastCore(max_transfers=3, swarm=SWARM)
    pid1, env1, _ = patch(1)
    follow(core, env1)
    done, _ = seeder(core, 2)  # younger, but finished
    pid3, env3, _ = patch(3)
    follow(core, env3)
    acts = follow(core, patch(4)[1])
    assert of(acts, Evicted) == [Evicted(done)]
    assert pid1 in core.transfers and pid3 in core.transfers
    assert core.counters["transfers_evicted"] == 0  # dropping a finished one costs nothing


def test_a_new_transfer_joins_every_connected_peer() -> None:
    core = BroadcastCore(swarm=SWARM)
    assert core.peer_connected("A", 0.0) == [] and core.peer_connected("B", 0.0) == []
    pid, env, _ = patch(1)
    acts = follow(core, env)
    assert sorted(s.peer for s in sent(acts, Have)) == ["A", "B"]
    assert all(s.frame.pid == pid and s.frame.reply for s in sent(acts, Have))
    assert core.peer_connected("A", 1.0) == []  # a second stream to the same peer: no new session


# ---------------------------------------------------------------- manifests


def test_a_signed_manifest_is_checked_then_accepted_then_loaded() -> None:
    pid, env, chunks = patch(1)
    e = decode_envelope(env, swarm=SWARM)
    forged = encode(msgspec.structs.replace(e, body=e.body[:-1] + bytes([e.body[-1] ^ 1])))
    seen = []
    core = BroadcastCore(accept=lambda m: seen.append(m) or m.target_version != 2, swarm=SWARM)
    with pytest.raises(DecodeError):  # from gossip or the API: the caller hears of it
        core.offer(forged, 0.0)
    assert core.counters["manifests_rejected"] == 1 and not seen and not core.loading
    assert core.offer(patch(2)[1], 0.0) == [] and len(seen) == 1  # declined by the accept rule: nothing loads
    assert core.offer(env, 0.0) == [Load(pid, seen[-1])]
    assert core.offer(env, 0.0) == [] and len(seen) == 2  # loading already: asked once
    acts = core.follow(pid, {0: chunks[0], 3: chunks[3]}, 1.0, 1001.0)
    tr = core.transfers[pid]
    assert tr.session.nhave == 2 and tr.chunks[0] == chunks[0] and of(acts, Complete) == []
    assert of(acts, Added) == [Added(pid)] and Wake() in acts
    assert core.offer(env, 2.0) == [] and not core.loading


def test_a_patch_already_on_disk_completes_on_load() -> None:
    pid, env, chunks = patch(1)
    core = BroadcastCore(swarm=SWARM)
    acts = follow(core, env, dict(enumerate(chunks)))
    assert of(acts, Complete) == [Complete(pid)]
    assert core.transfers[pid].payload() == b"".join(chunks)


def test_abandoned_load_can_be_offered_again() -> None:
    pid, env, _ = patch(1)
    core = BroadcastCore(swarm=SWARM)
    assert of(core.offer(env, 0.0), Load)
    core.abandon(pid)
    assert core.follow(pid, {}, 0.0, 0.0) == [] and pid not in core.transfers
    assert of(core.offer(env, 1.0), Load)


def test_unknown_patch_in_a_have_map_is_asked_for_then_retried_of_another_live_advertiser() -> None:
    pid, env, chunks = patch(1)
    core = BroadcastCore(manifest_retry_s=2.0, seed=3, swarm=SWARM)
    for p in "ABC":
        core.peer_connected(p, 0.0)
    assert not core.ticking
    acts = core.on_frame("A", HaveChunk(pid, 0), 0.0)
    assert sent(acts, ManifestRequest) == [Send("A", ManifestRequest(pid))] and Wake() in acts
    assert core.ticking
    # a second advertiser right after: no second request yet
    assert core.on_frame("B", Have(pid, bits_from_indices(range(4), 4)), 0.5) == []
    assert sent(core.tick(1.9), ManifestRequest) == []
    core.peer_gone("A", 1.95)  # the one we asked died with our request
    acts = core.tick(2.1)
    assert sent(acts, ManifestRequest) == [Send("B", ManifestRequest(pid))]  # the live advertiser, not A, not C
    assert sent(core.tick(3.0), ManifestRequest) == []  # once per retry period
    # an answer from someone we never asked is taken (it is checked like any manifest)
    acts = core.on_frame("C", Manifest(pid, env), 3.5)
    assert of(acts, Load) == [Load(pid, core.loading[pid][1])]
    core.follow(pid, dict(enumerate(chunks)), 3.6, 1003.6)
    assert sent(core.tick(10.0), ManifestRequest) == []  # known now: never asked again
    assert not core.ticking


def test_a_manifest_not_asked_for_or_not_matching_its_id_is_not_taken() -> None:
    pid, env, _ = patch(1)
    other = patch(2)[0]
    core = BroadcastCore(swarm=SWARM)
    core.peer_connected("A", 0.0)
    assert core.on_frame("A", Manifest(pid, env), 0.0) == []  # never asked: ignored, no penalty
    assert not core.loading
    core.on_frame("A", HaveChunk(other, 0), 0.0)  # now we ask for `other`
    acts = core.on_frame("A", Manifest(other, env), 0.1)  # ... and get another patch's manifest
    assert [(a.peer, a.reason) for a in of(acts, Penalise)] == [("A", "manifest does not match its patch id")]
    assert not of(acts, Load) and not core.loading


def test_a_forged_manifest_from_a_peer_costs_that_peer() -> None:
    pid, env, _ = patch(1)
    e = decode_envelope(env, swarm=SWARM)
    forged = encode(msgspec.structs.replace(e, body=e.body[:-1] + bytes([e.body[-1] ^ 1])))
    core = BroadcastCore(swarm=SWARM)
    core.peer_connected("A", 0.0)
    fid = content_id(forged)
    core.on_frame("A", HaveChunk(fid, 0), 0.0)
    acts = core.on_frame("A", Manifest(fid, forged), 0.1)
    assert [a.peer for a in of(acts, Penalise)] == ["A"] and "bad manifest" in of(acts, Penalise)[0].reason
    assert not core.loading and core.counters["manifests_rejected"] == 1


def test_manifest_asks_are_bounded() -> None:
    core = BroadcastCore(max_manifest_asks=4, swarm=SWARM)
    core.peer_connected("A", 0.0)
    ids = [bytes([i]) * 32 for i in range(10)]
    for i, pid in enumerate(ids):
        core.on_frame("A", HaveChunk(pid, 0), float(i))
    assert len(core._advertisers) == 4 and set(core._advertisers) == set(ids[-4:])
    assert len(core._asked) <= 4


def test_frames_of_an_unknown_patch_other_than_haves_are_counted_not_answered() -> None:
    core = BroadcastCore(swarm=SWARM)
    core.peer_connected("A", 0.0)
    assert core.on_frame("A", Request(b"\x07" * 32, 0), 0.0) == []
    assert core.counters["frames_unknown_patch"] == 1 and not core.ticking


def test_a_manifest_request_is_answered_with_the_signed_envelope_only_for_known_patches() -> None:
    core = BroadcastCore(swarm=SWARM)
    core.peer_connected("A", 0.0)
    pid, _ = seeder(core, 1)
    acts = core.on_frame("A", ManifestRequest(pid), 0.0)
    assert acts == [Send("A", Manifest(pid, core.transfers[pid].envelope))]
    assert core.on_frame("A", ManifestRequest(b"\x09" * 32), 0.0) == []


# ---------------------------------------------------------------- bans


def test_a_corrupt_chunk_bans_its_sender_node_wide() -> None:
    core = BroadcastCore(swarm=SWARM)
    pid1, env1, chunks1 = patch(1)
    follow(core, env1)
    pid2, env2, _ = patch(2)
    follow(core, env2)
    for p in ("bad", "good"):
        core.peer_connected(p, 0.0)
    core.on_frame("bad", Have(pid2, bits_from_indices(range(4), 4)), 0.0)
    acts = core.on_frame("bad", Have(pid1, bits_from_indices(range(4), 4)), 0.0)
    (req,) = [s.frame for s in sent(acts, Request) if s.peer == "bad"][:1]
    acts = core.on_frame("bad", Chunk(pid1, req.index, b"\0" * len(chunks1[req.index])), 0.1)
    assert [a.peer for a in of(acts, Penalise)] == ["bad"]
    assert of(acts, Disconnect) == [Disconnect("bad", "sent 1 corrupt chunk(s)")]
    assert not of(acts, Stored)
    assert "bad" in core.banned and "bad" not in core.peers
    for pid in (pid1, pid2):  # every session forgot it, not only the one it corrupted
        assert "bad" not in core.transfers[pid].session.peers and "bad" in core.transfers[pid].session.banned
    # from now on: its frames do nothing, it never rejoins, and a second ban is a no-op
    assert core.on_frame("bad", HaveChunk(pid1, 0), 0.2) == []
    assert core.on_frame("bad", ManifestRequest(pid1), 0.2) == []
    assert core.peer_connected("bad", 0.3) == []
    assert core.ban("bad", "again", 0.4) == []
    assert "good" in core.transfers[pid1].session.peers


def test_a_ban_reaches_sessions_and_asks_the_driver_to_disconnect_once() -> None:
    core = BroadcastCore(swarm=SWARM)
    core.peer_connected("X", 0.0)
    seeder(core, 1)
    acts = core.ban("X", "failed spot check", 1.0)
    assert of(acts, Disconnect) == [Disconnect("X", "failed spot check")]
    assert core.next_upload("X", 1.0) is None


def test_bad_frames_cost_a_protocol_penalty_and_are_counted() -> None:
    core = BroadcastCore(SwarmConfig(penalty_protocol=7.0), swarm=SWARM)
    assert core.bad_frame("A", "frame too long") == [Penalise("A", "frame too long", 7.0)]
    assert core.counters["bad_frames"] == 1


# ---------------------------------------------------------------- uploads: round-robin and pacing


def _queue(core: BroadcastCore, peer: str, pid: bytes, indices: list[int]) -> list:
    acts = []
    for i in indices:
        acts += core.on_frame(peer, Request(pid, i), 0.0)
    return acts


def test_uploads_take_turns_across_patches() -> None:
    core = BroadcastCore(ROOMY, swarm=SWARM)
    a, chunks_a = seeder(core, 1)
    b, chunks_b = seeder(core, 2)
    c, _ = seeder(core, 3)  # nothing requested here: never picked
    core.peer_connected("P", 0.0)
    core.peer_connected("Q", 0.0)
    assert core.next_upload("P", 0.0) is None  # nothing queued
    acts = _queue(core, "P", a, [0, 1, 2]) + _queue(core, "P", b, [0, 1])
    assert ServeReady("P") in acts
    _queue(core, "Q", c, [0])  # another peer's requests are not P's
    order = []
    for _ in range(6):
        slot = core.next_upload("P", 0.0)
        if slot is None:
            break
        chunk, _acts = core.take_upload("P", slot, 0.0)
        assert chunk is not None and chunk.pid == slot.pid
        order.append((chunk.pid, chunk.index))
        assert chunk.data == {a: chunks_a, b: chunks_b}[chunk.pid][chunk.index]
    assert order == [(a, 0), (b, 0), (a, 1), (b, 1), (a, 2)]  # alternating while both have requests
    assert core.next_upload("Q", 0.0).pid == c


def test_uploads_are_paced_by_one_bucket_with_refunds() -> None:
    rate = 2 * CHUNK  # bytes per second; the burst is 2 chunks
    core = BroadcastCore(ROOMY, upload_bytes_per_s=rate, upload_burst_bytes=2 * CHUNK, now=0.0, swarm=SWARM)
    pid, env, chunks = patch(1, nchunks=4, short=100)
    follow(core, env, dict(enumerate(chunks)))
    for p in ("P", "Q"):
        core.peer_connected(p, 0.0)
    _queue(core, "P", pid, [0, 1])
    _queue(core, "Q", pid, [2, 3])
    slots = [core.next_upload("P", 0.0), core.next_upload("Q", 0.0)]
    assert [s.at for s in slots] == [0.0, 0.0]  # the burst
    for p, s in zip(("P", "Q"), slots):
        assert core.take_upload(p, s, 0.0)[0] is not None
    # both peers draw on the same bucket: the third and fourth chunks wait one chunk time each
    s3 = core.next_upload("P", 0.0)
    s4 = core.next_upload("Q", 0.0)
    assert s3.at == pytest.approx(0.5) and s4.at == pytest.approx(1.0)
    # the last chunk is 100 bytes short: the difference is refunded when it is taken
    chunk, _ = core.take_upload("Q", s4, 1.0)
    assert chunk is not None and chunk.index == 3 and len(chunk.data) == CHUNK - 100
    assert core.bucket.total == 4 * CHUNK - 100
    # a slot whose request was cancelled meanwhile yields nothing and costs nothing
    core.on_frame("P", Cancel(pid, 1), 1.0)
    assert core.take_upload("P", s3, 1.0) == (None, [])
    assert core.bucket.total == 3 * CHUNK - 100


def test_a_slot_for_an_evicted_patch_is_refunded() -> None:
    core = BroadcastCore(ROOMY, max_transfers=1, upload_bytes_per_s=CHUNK, swarm=SWARM)
    pid, _ = seeder(core, 1)
    core.peer_connected("P", 0.0)
    _queue(core, "P", pid, [0])
    slot = core.next_upload("P", 0.0)
    assert isinstance(slot, UploadSlot) and core.bucket.total == CHUNK
    follow(core, patch(2)[1])  # takes the only slot of the table
    assert pid not in core.transfers
    assert core.take_upload("P", slot, 0.0) == (None, [])
    assert core.bucket.total == 0


# ---------------------------------------------------------------- a whole transfer between two cores


def test_two_cores_move_a_patch_through_their_actions_only() -> None:
    """An origin and a follower wired back to back, frames passed as objects: the core's protocol end to
    end without streams, from the follower learning the manifest over the stream to completion."""
    pid, env, chunks = patch(1, nchunks=6, short=10)
    origin, follower = BroadcastCore(seed=1, swarm=SWARM), BroadcastCore(seed=2, swarm=SWARM)
    queue: list[tuple[str, object]] = []  # (receiver, frame)
    completed: list[Transfer] = []

    def deliver(src: str, acts: list) -> None:
        for a in acts:
            if isinstance(a, Send):
                queue.append((a.peer, (src, a.frame)))
            elif isinstance(a, Load):  # nothing on disk: follow at once
                deliver(src, cores[src].follow(a.pid, {}, now, 1000.0 + now))
            elif isinstance(a, Complete):
                completed.append(cores[src].transfers[a.pid])

    cores = {"O": origin, "F": follower}
    pid_o, acts = origin.publish(env, chunks, 0.0, 1000.0)
    assert pid_o == pid
    deliver("O", acts)
    deliver("O", origin.peer_connected("F", 0.0))
    deliver("F", follower.peer_connected("O", 0.0))
    now = 0.0
    for _ in range(500):
        while queue:
            dst, (src, frame) = queue.pop(0)
            deliver(dst, cores[dst].on_frame(src, frame, now))
        for name, core in cores.items():
            peer = "F" if name == "O" else "O"
            slot = core.next_upload(peer, now)
            if slot is not None:
                chunk, acts = core.take_upload(peer, slot, now)
                deliver(name, acts)
                if chunk is not None:
                    queue.append((peer, (name, chunk)))
        if completed:
            break
        now += 0.05
        for name, core in cores.items():
            deliver(name, core.tick(now))
    assert [t.pid for t in completed] == [pid]
    assert follower.transfers[pid].payload() == b"".join(chunks)
    assert origin.stats(pid)["bytes_out"] == sum(len(c) for c in chunks)


def test_the_default_upload_burst_is_one_full_chunk() -> None:
    """A chunk is the unit written: with a burst under one chunk, the first chunk after every idle gap
    waited for its own tokens."""
    from murmur.sync.chunks import DEFAULT_CHUNK_BYTES

    core = BroadcastCore(ROOMY, upload_bytes_per_s=2 * 2**20, swarm=SWARM)
    assert core.bucket.burst >= DEFAULT_CHUNK_BYTES
    assert core.bucket.reserve(DEFAULT_CHUNK_BYTES, 10.0) == 0.0  # after an idle gap: no wait
