"""Adversarial behaviours: what a misbehaving peer sends, and a process that sends it over libp2p.

`Forger` builds the bad payloads (used by the emulator's adversary processes;
the virtual simulator builds the same kinds inline). Every payload is a real
signed `RolloutBatch` envelope on the built-in task set, bad in one way:

  forged_reward      wrong answers that claim reward 1.0 (validly signed)
  invalid_signature  a valid batch with a flipped signature byte
  replay             its first batch again, plus new content under the same seq
  stale_spam         rollouts claiming version 0 of another lineage
  corrupt_chunks     (broadcast plane) serves chunks that fail their hash
  free_ride          consumes, never publishes rollouts or uploads chunks

An adversary process (`python -m simulations.adversary ...`) joins the swarm
with a real libp2p host and publishes on the rollouts topic at a fixed rate.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

from gossip import wire
from gossip.identity import Identity
from training.tasksets import BUILTIN_TRAIN, TaskRegistry
from training.verifiers import score

TOKENIZER = hashlib.blake2b(b"murmur/sim-tokenizer", digest_size=32).digest()


class Forger:
    def __init__(self, ident: Identity, swarm: str, seed: int = 0, victim_lineage: bytes | None = None) -> None:
        self.ident = ident
        self.swarm = swarm
        self.rng = random.Random(seed)
        self.registry = TaskRegistry(swarm)
        self.registry.add_builtin()
        self.lineage = hashlib.blake2b(b"lineage" + ident.public, digest_size=32).digest()
        self.victim = victim_lineage or bytes(32)
        self.seq = 0
        self.first: bytes | None = None

    def _rollouts(self, lineage: bytes, version: int, correct: bool, claim: float | None, n: int = 8
                  ) -> list[wire.Rollout]:
        ref = wire.TaskRef(self.registry.builtin_id, BUILTIN_TRAIN, self.rng.randrange(1_000_000))
        task = self.registry.resolve(ref)
        out = []
        for _ in range(n):
            text = task.answer if correct else str(int(task.answer) + self.rng.choice((1, 2, 3)))
            ids = [ord(c) for c in text] + [1]
            out.append(wire.Rollout(task=ref, lineage=lineage, version=version, completion_ids=ids, text=text,
                                    tokenizer_hash=TOKENIZER, logprobs=bytes(4 * len(ids)), token_versions=[],
                                    sampling=wire.SamplingParams(max_new_tokens=8),
                                    reward=score(task, text) if claim is None else claim, created_ms=wire.now_ms()))
        return out

    def _seal(self, rollouts: list[wire.Rollout], seq: int | None = None) -> bytes:
        if seq is None:
            self.seq += 1
            seq = self.seq
        batch = wire.RolloutBatch(v=wire.FORMAT_VERSION, swarm=self.swarm, producer=self.ident.public, seq=seq,
                                  created_ms=wire.now_ms(), rollouts=rollouts)
        return wire.seal(self.ident, wire.ROLLOUT_BATCH, batch, swarm=self.swarm)

    def payloads(self, behaviour: str) -> list[bytes]:
        """The next bad message(s) of this behaviour; [] for behaviours that act by omission."""
        if behaviour == "forged_reward":
            return [self._seal(self._rollouts(self.lineage, 0, correct=False, claim=1.0))]
        if behaviour == "invalid_signature":
            data = bytearray(self._seal(self._rollouts(self.lineage, 0, correct=True, claim=None)))
            data[-5] ^= 0xFF  # inside the signature (the envelope's last field)
            return [bytes(data)]
        if behaviour == "replay":
            if self.first is None:
                self.first = self._seal(self._rollouts(self.lineage, 0, correct=True, claim=None))
                return [self.first]
            return [self.first, self._seal(self._rollouts(self.lineage, 0, correct=True, claim=None), seq=1)]
        if behaviour == "stale_spam":
            return [self._seal(self._rollouts(self.victim, 0, correct=True, claim=None))]
        return []


async def _serve(seed_hex: str, swarm: str, behaviour: str, rate: float, bootstrap: list[str], listen: str,
                 duration_s: float) -> None:
    import trio  # noqa: PLC0415

    from gossip import topics  # noqa: PLC0415
    from gossip.host import open_transport  # noqa: PLC0415

    ident = Identity.from_seed(bytes.fromhex(seed_hex))
    forger = Forger(ident, swarm, seed=int(seed_hex[:8], 16))
    async with open_transport(ident, [listen]) as t:
        for addr in bootstrap:
            with trio.move_on_after(10):
                try:
                    await t.connect(addr)
                except Exception as e:  # noqa: BLE001 - a dead bootstrap peer is not fatal here
                    print(f"adversary: connect {addr}: {e}", file=sys.stderr)
        topic = topics.rollouts(swarm)
        await t.subscribe(topic)
        with trio.move_on_after(duration_s):
            for _ in range(int(duration_s * rate) + 1):
                for data in forger.payloads(behaviour):
                    try:
                        await t.publish(topic, data)
                    except Exception as e:  # noqa: BLE001
                        print(f"adversary: publish: {e}", file=sys.stderr)
                await trio.sleep(1.0 / rate)


def main(argv: list[str]) -> None:
    """argv: seed_hex swarm behaviour rate duration_s listen [bootstrap ...]"""
    import trio  # noqa: PLC0415

    seed_hex, swarm, behaviour, rate, duration, listen, *boot = argv
    trio.run(_serve, seed_hex, swarm, behaviour, float(rate), boot, listen, float(duration))


def describe() -> dict[str, Any]:
    return {b: (__doc__ or "").split(b, 1)[1].split("\n", 1)[0].strip() for b in
            ("forged_reward", "invalid_signature", "replay", "stale_spam", "corrupt_chunks", "free_ride")}


if __name__ == "__main__":  # pragma: no cover - run as a subprocess by the emulator
    main(sys.argv[1:])
