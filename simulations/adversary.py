"""Adversarial behaviours: what a misbehaving peer sends, and a process that sends it over libp2p.

`Adversary` builds and seals the bad payloads, for the emulator's adversary
processes (`for_process`) and for the virtual simulator's adversaries, which
give it their own rollout draws and clock. Every payload is a real signed
`RolloutBatch` envelope on the built-in task set, bad in one way:

  forged_reward      wrong answers that claim reward 1.0 (validly signed)
  invalid_signature  a valid batch with a flipped signature byte
  replay             its first batch again, plus new content under the same seq
  stale_spam         rollouts claiming version 0 of another lineage
  misscheduled       correct rollouts claiming a schedule round whose prompts their task is not one of
  corrupt_chunks     (broadcast plane) serves chunks that fail their hash
  free_ride          consumes, never publishes rollouts or uploads chunks

An adversary process (`python -m murmur.simulations.adversary ...`) joins the swarm
with a real libp2p host and publishes on the rollouts topic at a fixed rate.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from murmur.gossip import wire
from murmur.gossip.identity import Identity
from murmur.training.schedule import PAST_ROUNDS, ScheduleBook, round_at
from murmur.training.tasksets import BUILTIN_TRAIN, TaskRegistry
from murmur.training.verifiers import score

TOKENIZER = hashlib.blake2b(b"murmur/sim-tokenizer", digest_size=32).digest()
SENDERS = ("forged_reward", "invalid_signature", "replay", "stale_spam", "misscheduled")  # they publish batches

# draw(lineage, wrong): a group of rollouts of version 0 of `lineage`, scored by the verifier; `wrong`: every
# answer wrong (what the forger sends), otherwise answered as the adversary's model answers
Draw = Callable[[bytes, bool], list[wire.Rollout]]


class Adversary:
    """What one misbehaving peer sends next: the one place its batches are built and sealed."""

    def __init__(
        self,
        ident: Identity,
        swarm: str,
        lineage: bytes,
        now_ms: Callable[[], int],
        draw: Draw,
        victim: Callable[[], bytes],
        schedule: ScheduleBook | None = None,
    ) -> None:
        self.ident = ident
        self.schedule = schedule  # the public prompt schedule: misscheduled claims a round its task is not in
        self.swarm = swarm
        self.lineage = lineage  # the lineage its own batches name
        self.now_ms = now_ms
        self.draw = draw
        self.victim = victim  # the lineage stale_spam names, asked once per batch
        self.seq = 0
        self.first: tuple[bytes, int] | None = None  # replay: the batch it sends again, and its seq

    def seal(self, rollouts: list[wire.Rollout], seq: int | None = None) -> bytes:
        if seq is None:
            self.seq += 1
            seq = self.seq
        batch = wire.RolloutBatch(
            v=wire.FORMAT_VERSION,
            swarm=self.swarm,
            producer=self.ident.public,
            seq=seq,
            created_ms=self.now_ms(),
            rollouts=rollouts,
        )
        return wire.seal(self.ident, wire.ROLLOUT_BATCH, batch, swarm=self.swarm)

    def payloads(self, behaviour: str) -> list[tuple[bytes, bytes]]:
        """The next bad message(s) of this behaviour, each with the lineage its rollouts name; [] for
        behaviours that act by omission or on the broadcast plane."""
        if behaviour == "forged_reward":
            forged = [
                wire.Rollout(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "reward": 1.0})
                for r in self.draw(self.lineage, True)
            ]  # all wrong, each claiming full reward
            return [(self.seal(forged), self.lineage)]
        if behaviour == "invalid_signature":
            data = bytearray(self.seal(self.draw(self.lineage, False)))
            data[-5] ^= 0xFF  # inside the signature (the envelope's last field)
            return [(bytes(data), self.lineage)]
        if behaviour == "replay":
            if self.first is None:
                self.first = self.seal(self.draw(self.lineage, False)), self.seq
                return [(self.first[0], self.lineage)]
            # the old bytes again, and other content under the same seq (equivocation)
            again = self.seal(self.draw(self.lineage, False), seq=self.first[1])
            return [(self.first[0], self.lineage), (again, self.lineage)]
        if behaviour == "stale_spam":
            victim = self.victim()
            return [(self.seal(self.draw(victim, False)), victim)]
        if behaviour == "misscheduled":
            rows = self.draw(self.lineage, False)
            rnd = self.misround(rows[0].task)
            return [(self.seal([msgspec.structs.replace(r, schedule_round=rnd) for r in rows]), self.lineage)]
        return []

    def misround(self, ref: wire.TaskRef) -> int:
        """A round inside receivers' windows whose prompts `ref` is not one of: the newest such (the current
        round unless a draw happens to be one of its prompts). Without a schedule, the current round."""
        now = round_at(self.now_ms())
        if self.schedule is not None:
            for back in range(PAST_ROUNDS + 1):
                if self.schedule.scheduled(ref, now - back) is False:
                    return now - back
        return now


def for_process(ident: Identity, swarm: str, seed: int = 0, victim_lineage: bytes | None = None) -> Adversary:
    """An adversary process's: its own task draws, always-correct honest answers, and the wall clock."""
    rng = random.Random(seed)
    registry = TaskRegistry(swarm)
    registry.add_builtin()
    victim = victim_lineage or bytes(32)

    def draw(lineage: bytes, wrong: bool, n: int = 8) -> list[wire.Rollout]:
        ref = wire.TaskRef(registry.builtin_id, BUILTIN_TRAIN, rng.randrange(1_000_000))
        task = registry.resolve(ref)
        out = []
        for _ in range(n):
            text = str(int(task.answer) + rng.choice((1, 2, 3))) if wrong else task.answer
            ids = [ord(c) for c in text] + [1]
            out.append(
                wire.Rollout(
                    task=ref,
                    lineage=lineage,
                    version=0,
                    completion_ids=ids,
                    text=text,
                    tokenizer_hash=TOKENIZER,
                    logprobs=bytes(4 * len(ids)),
                    token_versions=[],
                    sampling=wire.SamplingParams(max_new_tokens=8),
                    reward=score(task, text),
                    created_ms=wire.now_ms(),
                )
            )
        return out

    lineage = hashlib.blake2b(b"lineage" + ident.public, digest_size=32).digest()
    return Adversary(ident, swarm, lineage, wire.now_ms, draw, lambda: victim, ScheduleBook.of(registry))


async def _serve(
    seed_hex: str, swarm: str, behaviour: str, rate: float, bootstrap: list[str], listen: str, duration_s: float
) -> None:
    import trio

    from murmur.gossip import topics
    from murmur.gossip.host import open_transport

    ident = Identity.from_seed(bytes.fromhex(seed_hex))
    adversary = for_process(ident, swarm, seed=int(seed_hex[:8], 16))
    async with open_transport(ident, [listen]) as t:
        for addr in bootstrap:
            with trio.move_on_after(10):
                try:
                    await t.connect(addr)
                except Exception as e:  # a dead bootstrap peer is not fatal here
                    print(f"adversary: connect {addr}: {e}", file=sys.stderr)
        topic = topics.rollouts(swarm)
        await t.subscribe(topic)
        with trio.move_on_after(duration_s):
            for _ in range(int(duration_s * rate) + 1):
                for data, _ in adversary.payloads(behaviour):
                    try:
                        await t.publish(topic, data)
                    except Exception as e:
                        print(f"adversary: publish: {e}", file=sys.stderr)
                await trio.sleep(1.0 / rate)


def main(argv: list[str]) -> None:
    """argv: seed_hex swarm behaviour rate duration_s listen [bootstrap ...]"""
    import trio

    seed_hex, swarm, behaviour, rate, duration, listen, *boot = argv
    trio.run(_serve, seed_hex, swarm, behaviour, float(rate), boot, listen, float(duration))


def describe() -> dict[str, Any]:
    return {
        b: (__doc__ or "").split(b, 1)[1].split("\n", 1)[0].strip()
        for b in (
            "forged_reward",
            "invalid_signature",
            "replay",
            "stale_spam",
            "misscheduled",
            "corrupt_chunks",
            "free_ride",
        )
    }


if __name__ == "__main__":  # pragma: no cover - run as a subprocess by the emulator
    main(sys.argv[1:])
