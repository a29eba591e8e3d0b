"""Mutation testing of chosen modules with the fast tests only (cosmic-ray, pinned in the `test` extras).

    python -m murmur.simulations.mutation gossip/ratelimit.py [--tests tests/test_x.py ...] [--timeout 60] [--json]
    python -m murmur.simulations.mutation node/core/machine.py --sample 150 --seed 0 --db /tmp/core.sqlite
    python -m murmur.simulations.mutation gossip/limits.py --semantic [--operators given_back ...] [--db /tmp/limits.json]

The tracked files are copied to a scratch folder first: cosmic-ray rewrites the module in place while a
mutant's tests run, so the working tree is never touched, and an interrupted run leaves nothing behind.
Each mutant runs `pytest -x -q -m "not slow"` on the module's test files (MODULE_TESTS, or --tests);
a mutant whose tests fail or time out is killed. The last line printed is one JSON object: counts,
the score killed / (total - equivalent) and each survivor's diff. Equivalent mutants (no test can tell
them apart from the original) are listed by their diff line in EQUIVALENT, with the reason in
docs/testing.md. With --sample N only a seeded uniform sample of N mutants runs: its score estimates the
full score, given with a 95 % Wilson interval. With --semantic the mutants are the plausible one-line bugs
of simulations/semantic.py (wrong end of a window, a count not given back, a check on the wrong field, a
comparison that lets NaN through), run by this script itself, one pytest process each; --db and --resume
then name a JSON file of outcomes. The command and the scores per module are in docs/testing.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from murmur.simulations import semantic

ROOT = Path(__file__).resolve().parents[1]

# The fast test files that exercise each module (the mutants of a module run these only).
MODULE_TESTS: dict[str, list[str]] = {
    "gossip/ratelimit.py": ["tests/test_ratelimit.py"],
    "sync/staleness.py": ["tests/test_staleness.py"],
    "training/tokencheck.py": ["tests/test_tokencheck.py"],
    "gossip/scoring.py": ["tests/test_scoring.py", "tests/test_validation.py"],
    "gossip/validation.py": ["tests/test_validation.py", "tests/test_validation_rates.py"],
    "gossip/wire.py": ["tests/test_wire.py"],
    # the modules of issue 43's semantic mutants (their live tests, seconds each, are left out)
    "gossip/limits.py": ["tests/test_stream_budget.py"],
    "gossip/hostlimits.py": ["tests/test_stream_budget.py", "tests/test_ip_limits.py"],
    "gossip/cpubudget.py": ["tests/test_cpubudget.py", "tests/test_validation.py"],
    "gossip/exchange.py": ["tests/test_exchange.py"],
    "node/core/credit.py": ["tests/test_credit.py", "tests/test_attacks_core.py"],
    "node/core/roles.py": ["tests/test_roles.py", "tests/test_attacks_core.py"],
    "training/trainer.py": ["tests/test_trainer_poison.py"],
    "node/core/machine.py": ["tests/test_core.py", "tests/test_heads_to_worker.py", "tests/test_attacks_core.py"],
    # the core's sub-machines: their own tests, then the core's that drive them
    "node/core/peertable.py": ["tests/test_peertable.py", "tests/test_core.py", "tests/test_attacks_core.py"],
    "node/core/catchup.py": [
        "tests/test_catchup_machine.py",
        "tests/test_core.py",
        "tests/test_core_boundary.py",
        "tests/test_attacks_core.py",
    ],
    "node/core/supervision.py": ["tests/test_supervision.py", "tests/test_core.py", "tests/test_core_boundary.py"],
    "node/core/sealing.py": ["tests/test_sealing.py", "tests/test_core.py", "tests/test_attacks_core.py"],
    # tests/test_lineage.py is sync/versions.py's (publisher and follower), not the node's lineage table
    "node/core/lineages.py": [
        "tests/test_lineages.py",
        "tests/test_heads_to_worker.py",
        "tests/test_attacks_core.py",
        "tests/test_core.py",
    ],
    "sync/codec.py": ["tests/test_codec.py"],
    "training/losses.py": ["tests/test_losses.py"],
    "training/sampler.py": ["tests/test_sampler.py"],
}

# (module, the line an equivalent mutant's diff adds): mutants that no test can tell from the original,
# each with its reason in docs/testing.md.
EQUIVALENT: set[tuple[str, str]] = {
    # a table bound off by one: no behaviour anyone states depends on the exact count
    (
        "gossip/ratelimit.py",
        "def __init__(self, floor_rate: float = 20.0, floor_burst: float = 40.0, max_peers: int = 9999) -> None:",
    ),
    (
        "gossip/ratelimit.py",
        "def __init__(self, floor_rate: float = 20.0, floor_burst: float = 40.0, max_peers: int = 10001) -> None:",
    ),
    ("gossip/ratelimit.py", "def __init__(self, window_s: float = METER_WINDOW_S, max_events: int = 100001) -> None:"),
    ("gossip/ratelimit.py", "def __init__(self, window_s: float = METER_WINDOW_S, max_events: int = 99999) -> None:"),
    ("gossip/ratelimit.py", "def __init__(self, rate_per_s: float, burst: float, max_peers: int = 9999) -> None:"),
    ("gossip/ratelimit.py", "def __init__(self, rate_per_s: float, burst: float, max_peers: int = 10001) -> None:"),
    # defaults for an announce without the field: every wire.NodeAnnounce carries both, and any default
    # not above 0 means "no promise" alike
    ("gossip/ratelimit.py", 'seq = int(getattr(announce, "seq", 1))'),
    ("gossip/ratelimit.py", 'seq = int(getattr(announce, "seq", -1))'),
    ("gossip/ratelimit.py", 'announced = float(getattr(announce, "publish_batches_per_s", -1.0))'),
    # the states are the module's own enum members (singletons): `is` equals `==` on them, and an ordering that
    # only differs on a state no event can hold (an event is a change: never unknown, never fresh -> fresh)
    ("sync/staleness.py", "if self.state >= Admission.STALE:"),
    ("sync/staleness.py", "if self.state is Admission.STALE:"),
    ("sync/staleness.py", "if self.state <= Admission.FRESH and self.previous == Admission.STALE:"),
    ("sync/staleness.py", "if self.state == Admission.FRESH and self.previous <= Admission.STALE:"),
    ("sync/staleness.py", "if self.state >= Admission.FRESH and self.previous == Admission.STALE:"),
    ("sync/staleness.py", "if self.state is Admission.FRESH and self.previous == Admission.STALE:"),
    ("sync/staleness.py", "if self.state == Admission.FRESH and self.previous is Admission.STALE:"),
    ("sync/staleness.py", "if new is t.state:"),
    ("sync/staleness.py", "return t is not None and t.state <= Admission.FRESH"),
    ("sync/staleness.py", "return t is not None and t.state is Admission.FRESH"),
    # a head equal to the version held is set to itself
    ("sync/staleness.py", "if t.head is None or version >= t.head:"),
    # `t.head or ...`: a lineage with a version held always has a head (applied sets it)
    ("sync/staleness.py", "new = Admission.FRESH if (t.head or 1) - t.local <= self.k else Admission.STALE"),
    ("sync/staleness.py", "new = Admission.FRESH if (t.head or -1) - t.local <= self.k else Admission.STALE"),
    ("gossip/scoring.py", "max_peers: int = 10001) -> None:"),
    ("gossip/scoring.py", "max_peers: int = 9999) -> None:"),
    # the table grows by one peer at a time, so it is full exactly at the bound
    ("gossip/scoring.py", "if len(self._peers) == self.max_peers:  # forget the most neutral peer"),
    # no time passed: decaying by 0.5 ** 0 changes nothing
    ("gossip/scoring.py", "elif now >= rec.updated:"),
    (
        "training/sampler.py",
        "MAX_HEADS = 4097  # lineages whose reported head is remembered (least recently reported forgotten first)",
    ),
    (
        "training/sampler.py",
        "MAX_HEADS = 4095  # lineages whose reported head is remembered (least recently reported forgotten first)",
    ),
    # slots only saves memory: a frozen Group refuses assignment either way
    ("training/sampler.py", "@dataclass(frozen=True, slots=False)"),
    # the edge of a float tolerance: rewards exactly 1e-9 apart
    ("training/sampler.py", "if max(rewards) - min(rewards) < 1e-9:"),
    # any fixed default seed is as reproducible as 0
    ("training/sampler.py", "seed: int = 1) -> None:"),
    ("training/sampler.py", "seed: int = -1) -> None:"),
    # the count grows by one from 0 and `groups` is at least 1 there: `!=` stops where `<` does
    ("training/sampler.py", "if len(chosen) != groups and _tokens(usable[i]) <= room:"),
    # the trainer hook's version floor is accepted and unused (the heads rule replaces it)
    (
        "training/sampler.py",
        "def take_rollouts(self, groups: int, _min_version: int = 1, max_tokens: int | None = None,",
    ),
    (
        "training/sampler.py",
        "def take_rollouts(self, groups: int, _min_version: int = -1, max_tokens: int | None = None,",
    ),
    # enum members are singletons and Enum's == is identity
    ("gossip/validation.py", "return self.reason == Reason.ACCEPTED"),
    ("gossip/validation.py", "remember=reason == Reason.FUTURE_VERSION)"),
    # the number replaced by itself: -1e30 written as - 1e+30
    ("gossip/wire.py", "Finite = Annotated[float, Meta(ge=- 1e+30, le=1e30)]"),
    ("gossip/wire.py", "Finite = Annotated[float, Meta(ge=-1e30, le= 1e+30)]"),
    # numpy's floor division of two boolean arrays is 1 exactly where both are true (x // 0 is 0, with a warning)
    ("gossip/wire.py", "ok = (a >= LOGPROB_MIN) // (a <= LOGPROB_MAX)"),
    # a decoded small int is CPython's cached object: `is not 2` is `!= 2`
    ("gossip/wire.py", "if body.v is not FORMAT_VERSION:"),
    # only whether a lineage has published in this run is read, never how many manifests
    ("node/core/lineages.py", "lin.manifests += 2"),
    # the reason a publisher is avoided is stored and never read (only the expiry is)
    ("node/core/lineages.py", "self.avoided[publisher] = (now + AVOID_S, reason[: 201])"),
    # `is not` between two bools is `!=`
    (
        "node/core/lineages.py",
        'if m.base_version > m.target_version or (m.codec == "anchor-v1") is not (m.base_version == m.target_version):',
    ),
    # a live row hearing a version at or below its signed head changes nothing either way
    ("node/core/lineages.py", "if version != lin.signed_head or not lin.live:"),
    # a publisher whose avoidance ends exactly now is not avoided either way (`is_avoided` asks until > now);
    # the entry left for the next call is the first the size bound removes
    ("node/core/lineages.py", "for p in [p for p, (until, _) in self.avoided.items() if until < now]:"),
    # expired entries left in place: `is_avoided` compares the expiry, and the size bound removes the
    # soonest to expire (the expired ones) first
    ("node/core/lineages.py", "for p in [p for p, (until, _) in self.avoided.items() if until is now]:"),
    ("node/core/lineages.py", "for p in []:"),
    # the wire refuses a negative step time before this check sees it
    ("node/core/lineages.py", "if not math.isfinite(t) or (t > 0.0 and not MIN_STEP_S <= t <= 1e6):"),
    # receivers need a producer's seqs unique and increasing, not consecutive
    ("node/core/sealing.py", "self.rollout_seq = max(self.rollout_seq + 2, int(wall_ms) * 1000)"),
    # EOS is a special token, so skip_special_tokens drops it whether or not this filter does
    ("training/tokencheck.py", "ids = [i for i in ids if i is not self.eos_id]"),
    ("training/tokencheck.py", "if not self.eos_id in ids:"),
    # transformers tokenizers always carry clean_up_tokenization_spaces: the default is never read
    (
        "training/tokencheck.py",
        'self._backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", False) '
        "else tokenizer.backend_tokenizer",
    ),
    # HF fast tokenizers decode every u32 id (an unknown one to nothing): the guard is for ones that raise
    (
        "training/tokencheck.py",
        "except CosmicRayTestingException as e:  # an id the tokenizer cannot map: not a text it ever produced",
    ),
    ("training/tokencheck.py", "except CosmicRayTestingException:"),
    # M2 exactly at tau: the removal loop stops before its first removal on the same test
    ("training/losses.py", "if total / n < tau:"),
    ("training/losses.py", "if total / n is tau:"),
    # the two clip conditions need A < 0 and A > 0: never both, so `^` is `|`
    ("training/losses.py", "clipped = ((r < 1 - eps_lo) & (a < 0)) ^ ((r > 1 + eps_hi) & (a > 0))"),
    # token tensors are [B, T]: dimension 1 is the last
    ("training/losses.py", "seq_lp = (logp * mask).sum(1) / n_tok"),
    ("training/losses.py", "n_tok = mask.sum(1).clamp(min=1.0)"),
    ("training/losses.py", "valid = (mask.sum(1) > 0).float()"),
    # an empty name sorts at or before the empty start of the order check, which refuses it
    ("sync/codec.py", "name: Annotated[str, Meta(min_length= 0, max_length=1024)]"),
    # the bitmask tried at any density: the smaller encoding still wins (the guard only saves encode time)
    ("sync/codec.py", "if count * 64 is not n:  # a bitmask can only win above ~1/64 density"),
    # a payload under 24 bytes has no room for its header length: refused by the next check instead
    ("sync/codec.py", "if len(mv) < len(MAGIC) - 4 + TRAILER_BYTES:"),
    # the time of a progress that never was: a held version is never -1, so the first catch-up replaces it
    (
        "node/core/catchup.py",
        "self.progress = (-1, -1.0)  # (held version of the served lineage, when it last changed)",
    ),
    # a row's head is never below what it holds (every write of `held` raises `head` to it)
    ("node/core/catchup.py", "if lin is None or (lin.head == lin.held and not lin.need_anchor):"),
    # the lineage table's default bound off by one (as ratelimit's and scoring's)
    ("node/core/machine.py", "max_lineages: int = 255"),
    ("node/core/machine.py", "max_lineages: int = 257"),
    # ... and the status's reward trend and the announced standby list (the wire's 256) likewise
    ("node/core/machine.py", "self.rewards: deque[float] = deque(maxlen= 59)"),
    ("node/core/machine.py", "self.rewards: deque[float] = deque(maxlen=61)"),
    ("node/core/machine.py", "standby=act.standby[: 255],"),
    # a row's publisher is a 32-byte key or empty (set from verified signatures; the store checks the length)
    ("node/core/machine.py", 'if m.fault == "non_finite_patch" and lin is not None and len(lin.publisher) >= 32:'),
    # a configuration with publish_every below 1 is refused when it is loaded (node.config)
    ("node/core/machine.py", "max_staleness=cfg.sync.max_staleness, publish_every=max( 0, cfg.sync.publish_every),"),
    # the tokens per rollout are read only by roles.offer_rate, which divides by at least 1 itself
    ("node/core/machine.py", "self.tokens_per_rollout = float(max( 0, settings.max_new_tokens))"),
    # the cap on an announced publishing rate, 1e3 batches/s (the wire allows 1e6): no stated behaviour depends
    # on its exact value, only that a hostile claim is bounded
    ("node/core/machine.py", "own = (mine, min(self.announced_rate, 999.0))"),
    ("node/core/machine.py", "own = (mine, min(self.announced_rate, 1001.0))"),
    ("node/core/peertable.py", "supply.add(lid, min(a.publish_batches_per_s, 999.0))"),
    ("node/core/peertable.py", "supply.add(lid, min(a.publish_batches_per_s, 1001.0))"),
    # the first announce's seq follows the wall clock (unix ms); from any start, a key's seqs rise by one or more
    ("node/core/machine.py", "self.announce_seq = 1"),
    ("node/core/machine.py", "self.announce_seq = -1"),
    ("sync/codec.py", "if len(mv) < len(MAGIC) + 4 >> TRAILER_BYTES:"),
    ("sync/codec.py", "if len(mv) < len(MAGIC) | 4 + TRAILER_BYTES:"),
    # element widths are 1, 2, 4 or 8 bytes
    ("sync/codec.py", "if arr.dtype.itemsize != 1:"),
    # positions ending exactly one past the tensor: refused by the exact check that follows instead
    ("sync/codec.py", "if float(gaps.sum(dtype=np.float64)) + e.count > n // 1:"),
    # numpy shifts a signed integer right by its width or more to its sign (0 or -1), as by width - 1
    ("sync/codec.py", "return ((s << 1) ^ (s >> (w - 0))).view(d.dtype)"),
    # numpy infers a reshape's one negative dimension whatever its value
    ("sync/codec.py", "m = a.view(np.uint8).reshape(- 2, w)"),
    # the four 2-bit codes sit in disjoint bits of their byte: adding them is or-ing them
    ("sync/codec.py", "main = c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) + (c[:, 3] << 6)"),
    # the sentinel before the first candidate: only `val_mode < 0` reads it
    ("sync/codec.py", "val_mode, val_streams = - 2, []"),
    # the mode here is VAL_DELTA (2), without the packed flag (8): xor sets it as or does
    ("sync/codec.py", "tries.append((mode ^ VAL_PACKED, lambda a=arr: _packed(a, off)))"),
    # semantic mutants (simulations/semantic.py). Table bounds off by one, as ratelimit's above:
    (
        "gossip/limits.py",
        "if len(self._offences) >= 4 * self.limits.node_streams:  # bounded: forget peers with no recent offence",
    ),
    ("gossip/cpubudget.py", "while len(self._peers) >= self.max_peers:"),
    ("node/core/credit.py", "while len(self._d) >= self.max_peers:"),
    # the node bucket's first refill: it starts full with `last` at -inf, and full plus anything capped is full;
    # its tokens are never -inf (costs are finite)
    (
        "gossip/cpubudget.py",
        "n.tokens = min(cap, n.tokens + max(0.0, now - n.last) * self.node_rate) if n.tokens > -math.inf else cap",
    ),
    (
        "gossip/cpubudget.py",
        "n.tokens = min(cap, n.tokens + max(0.0, now - n.last) * self.node_rate) if n.last >= -math.inf else cap",
    ),
    ("gossip/validation.py", "while len(self._tasks) >= TASK_CACHE:"),
    # `>=` for `>` (or `<=` for `<`) where the branch assigns the value compared: equal, it changes nothing
    ("gossip/validation.py", "if v >= top:"),
    ("gossip/validation.py", "if lo <= s[0]:"),
    ("gossip/validation.py", "if top >= s[1]:"),
    # "not outside" for "inside" differs only on NaN: a length is an int; a temperature is a float the wire
    # (msgspec's range) and the node's configuration both refuse when NaN
    ("gossip/wire.py", "if not isinstance(swarm, str) or (1 > len(swarm) or len(swarm) > MAX_NAME):"),
    ("gossip/wire.py", "if (not (0.0 >= t or t >= MIN_TEMPERATURE)):"),
    # the two forms of the log-prob check agree at 256 values (the property test at 255-257 pins it)
    (
        "gossip/wire.py",
        "if n < _FEW_LOGPROBS:  # the same float32 comparisons: both bounds rounded to float32 as numpy rounds them",
    ),
    # the short form's all-in-range shortcut: a value it sends on to the loop is judged there alike
    (
        "gossip/wire.py",
        "if total == total and (not vals or (min(vals) > LOGPROB_MIN and max(vals) <= _LOGPROB_MAX_F32)):",
    ),
    (
        "gossip/wire.py",
        "if total == total and (not vals or (min(vals) >= LOGPROB_MIN and max(vals) < _LOGPROB_MAX_F32)):",
    ),
    (
        "gossip/wire.py",
        "if total == total and (not vals or ((not (min(vals) < LOGPROB_MIN or max(vals) > _LOGPROB_MAX_F32)))):",
    ),
    ("gossip/exchange.py", "while (not (s >= MAX_SHARDS or n < 2 * s * PRODUCERS_PER_SHARD)):"),
    ("gossip/exchange.py", "while (not (s <= 1 or n >= s * PRODUCERS_PER_SHARD * 3 // 4)):"),
    # the inverse of a modulo 1 is 0, as the shortcut for one shard says
    ("gossip/exchange.py", "inv = pow(a, -1, shards) if shards >= 1 else 0"),
    # the edge of a float tolerance: a supply of exactly 1e-9 batches/s
    ("gossip/exchange.py", "if left >= 1e-09:"),
    ("gossip/exchange.py", "if self._per[j] < 1e-09:"),
    (
        "gossip/exchange.py",
        "return first_in_rotation(node, s, epoch, [j for j in supplied if j not in taken and avail(j) >= 1e-09], k)",
    ),
    ("gossip/exchange.py", "and (avail(j) >= 1e-09 or not supplied)), k))"),
    ("gossip/exchange.py", "rest = [j for j in order if j not in out and avail(j) >= 1e-09]"),
    ("gossip/exchange.py", "out.append(next((j for j in order if avail(j) >= 1e-09), order[0]))"),
    # an own rate of 0 subtracted from its shard changes nothing; a demand of 0 is 0 either way, and NaN
    # already fails `demand_rps > 0`
    (
        "gossip/exchange.py",
        "own_j, own_r = (shard_of(own[0], s), own[1]) if own is not None and own[1] >= 0 else (-1, 0.0)",
    ),
    ("gossip/exchange.py", "demand = demand_rps if math.isfinite(demand_rps) and demand_rps >= 0 else 0.0"),
    ("gossip/exchange.py", "demand = demand_rps if (not math.isinf(demand_rps)) and demand_rps > 0 else 0.0"),
    # "not outside" for "inside" where no operand can be NaN (supplies and demand are finite, counts ints)
    (
        "gossip/exchange.py",
        "and len(kept) == self._rotating_n and (not (missing > sum(have) or sum(have) > 2 * missing))):",
    ),
    (
        "gossip/exchange.py",
        "if (not (1e-09 >= avail(j) or avail(j) > 2 * missing)):  # up to twice what is "
        "missing: half of it used at worst",
    ),
    ("gossip/exchange.py", "if (not (missing <= 0 or len(out) >= room)):"),
    ("gossip/exchange.py", "while (not (len(self._snaps) <= 1 or now - self._snaps[0][0] <= RATE_WINDOW_S)):"),
    # the two candidate walks give the same shards (a property test in tests/test_exchange.py pins it)
    (
        "gossip/exchange.py",
        "if supplied and len(supplied) ** 2 <= 4 * MAX_SUBSCRIBED * s:  # few: sorting them beats walking the order",
    ),
    # nothing is missing: the loop goes on and adds nothing (every supply it could add is above 0)
    ("gossip/exchange.py", "if len(out) >= room or missing < 0:"),
    # a shard offering exactly what is still missing was taken by the loop before (it offers at most twice that)
    ("gossip/exchange.py", "cover = [j for j in rest if avail(j) > missing]"),
    ("gossip/exchange.py", "if (not (measured < 3 * demand or self.extra <= 0)):"),
    # table bounds off by one
    ("gossip/exchange.py", "while len(self.first_heard) >= MAX_KNOWN:"),
    ("gossip/exchange.py", "while len(self.producers) >= MAX_KNOWN:"),
    # the snapshot just taken is less than a second old: it is never dropped for age
    ("gossip/exchange.py", "while len(self._snaps) >= 1 and now - self._snaps[0][0] > RATE_WINDOW_S:"),
    # a snapshot exactly a second after the last: taken now or at the next call, the rate is over the span
    ("gossip/exchange.py", "if not self._snaps or now - self._snaps[-1][0] > 1.0:"),
    # a hash equal to the largest kept is that key itself, already handled as a key seen
    ("gossip/exchange.py", "if h <= self._top:  # most keys of a big swarm stop at this one comparison"),
    # no demand from no rollouts either way (B = 0 gives a rate of 0; the wire's B is unsigned); a NaN step time
    # that passes the first check gives a NaN rate, which the rate's own finiteness check turns into 0
    ("node/core/roles.py", "if not d.step_time_s > 0 or d.rollouts_per_step < 0:"),
    ("node/core/roles.py", "if (d.step_time_s <= 0) or d.rollouts_per_step <= 0:"),
    # NaN already fails `cpu_s > 0` before the finiteness check: only infinity needs it
    ("gossip/cpubudget.py", "if not (cpu_s > 0 and (not math.isinf(cpu_s))):"),
}


def _signature_annotations(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (start, end) of every parameter and return annotation of every function, as (row, column)."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            anns = [x.annotation for x in params if x is not None and x.annotation is not None]
            anns += [node.returns] if node.returns is not None else []
            spans += [((n.lineno, n.col_offset), (n.end_lineno or n.lineno, n.end_col_offset or 0)) for n in anns]
    return spans


def _annotation_only(module: str, start: tuple[int, int]) -> bool:
    """A mutation inside a function's parameter or return annotation (a `X | None` turned into `X * None`):
    never evaluated where the module has `from __future__ import annotations`. msgspec Structs, which do
    evaluate theirs, annotate class fields, not function signatures."""
    source = (ROOT / module).read_text()
    if "from __future__ import annotations" not in source:
        return False
    return any(lo <= tuple(start) < hi for lo, hi in _signature_annotations(source))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for k successes in n draws (95 % at z = 1.96); unlike p +- z*sd it stays
    inside [0, 1] and is not empty at k = n, where mutation scores live."""
    if n <= 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


# A mutation's identity across `cosmic-ray init`s (its job id is a fresh uuid each time): the operator and
# its occurrence in the module, which are fixed by the module's source.
_SPEC_KEY = "SELECT job_id, operator_name, occurrence, start_pos_row, start_pos_col FROM mutation_specs"


def sample_session(db: Path, n: int, seed: int) -> tuple[int, int]:
    """Keep a seeded uniform sample of n of the session's mutants (delete the others' work items): the same
    module source, n and seed keep the same mutants. Returns (kept, total); the numbers are also stored in
    the session, so --report and --resume can show them."""
    with sqlite3.connect(db) as con:
        rows = sorted(con.execute(_SPEC_KEY).fetchall(), key=lambda r: r[1:])
        total = len(rows)
        keep = {r[0] for r in random.Random(seed).sample(rows, min(n, total))}
        drop = [(r[0],) for r in rows if r[0] not in keep]
        con.executemany("DELETE FROM mutation_specs WHERE job_id = ?", drop)
        con.executemany("DELETE FROM work_items WHERE job_id = ?", drop)
        con.execute("CREATE TABLE IF NOT EXISTS murmur_sample (kept INTEGER, total INTEGER, seed INTEGER)")
        con.execute("DELETE FROM murmur_sample")
        con.execute("INSERT INTO murmur_sample VALUES (?, ?, ?)", (len(keep), total, seed))
    return len(keep), total


def _sample_of(db: Path) -> tuple[int, int, int] | None:
    with sqlite3.connect(db) as con:
        if not con.execute("SELECT 1 FROM sqlite_master WHERE name = 'murmur_sample'").fetchone():
            return None
        return con.execute("SELECT kept, total, seed FROM murmur_sample").fetchone()


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = ROOT / f.decode()
        if src.is_file():
            (dst / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f.decode())


def _added_lines(diff: str) -> list[str]:
    return [x[1:].strip() for x in diff.splitlines() if x.startswith("+") and not x.startswith("+++")]


def _chosen_tests(module: str, tests: list[str] | None) -> list[str]:
    """The test files a module's mutants run against: those given, else its entry in MODULE_TESTS; each must exist."""
    chosen = tests or MODULE_TESTS.get(module)
    if not chosen:
        raise SystemExit(f"no tests chosen for {module}: pass --tests")
    missing = [t for t in chosen if not (ROOT / t).is_file()]
    if missing or not (ROOT / module).is_file():
        raise SystemExit(f"not found: {', '.join(missing or [module])}")
    return chosen


def test_command(tests: list[str]) -> str:
    """One mutant's tests: the fast ones, stopping at the first failure, with no plugin or report a
    mutant does not need (pyproject's addopts asks for --durations)."""
    return (
        f"{sys.executable} -m pytest -x -q -o addopts= -p no:cacheprovider -p no:hypothesispytest "
        f"-m 'not slow' {' '.join(tests)}"
    )


def run(
    module: str,
    tests: list[str] | None = None,
    timeout_s: float = 120.0,
    keep_db: str | None = None,
    resume: str | None = None,
    sample: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Mutate `module` (a path under the repository) and run its fast tests against every mutant (or a
    seeded sample of `sample` of them). With `resume` (a session kept with --db), only that session's
    survivors run again, against the tests as they are now: the check after writing tests for them."""
    from cosmic_ray.work_db import WorkDB, use_db

    tests = _chosen_tests(module, tests)
    with tempfile.TemporaryDirectory(prefix="murmur-mutation-") as tmp:
        work = Path(tmp) / "tree"
        _copy_tree(work)
        cfg = Path(tmp) / "cr.toml"
        cfg.write_text(
            "[cosmic-ray]\n"
            f'module-path = "{module}"\n'
            f"timeout = {timeout_s}\n"
            "excluded-modules = []\n"
            f'test-command = "{test_command(tests)}"\n'
            '[cosmic-ray.distributor]\nname = "local"\n'
        )
        db = Path(tmp) / "session.sqlite"
        env = dict(os.environ, PYTHONPATH=str(work), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cr = [sys.executable, "-m", "cosmic_ray.cli"]
        if resume:
            shutil.copy2(resume, db)
            with sqlite3.connect(db) as con:  # survivors become pending again
                con.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in to_rerun(module, db)])
        else:
            subprocess.run(cr + ["init", str(cfg), str(db)], cwd=work, env=env, check=True)
            if sample is not None:
                sample_session(db, sample, seed)
        base = subprocess.run(cr + ["baseline", str(cfg)], cwd=work, env=env, capture_output=True, text=True)
        if base.returncode != 0:
            raise SystemExit(f"the tests fail without any mutation:\n{base.stdout[-3000:]}{base.stderr[-3000:]}")
        subprocess.run(cr + ["exec", str(cfg), str(db)], cwd=work, env=env, check=True)
        with use_db(str(db), WorkDB.Mode.open) as wdb:
            done = list(wdb.completed_work_items)
        sampled = _sample_of(db)
        if keep_db:
            shutil.copy2(db, keep_db)  # cosmic-ray's own session: `cr-report FILE`, `cr-html FILE`
    return summarize(module, tests, done, sampled)


def report(module: str, db: str) -> dict[str, Any]:
    """The summary of a session kept with --db (EQUIVALENT as it is now)."""
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(db, WorkDB.Mode.open) as wdb:
        done = list(wdb.completed_work_items)
    return summarize(module, MODULE_TESTS.get(module, []), done, _sample_of(Path(db)))


def to_rerun(module: str, db: Path) -> list[str]:
    """Job ids of a session's survivors that are not equivalent (equivalents stay: no test can kill them)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    with use_db(str(db), WorkDB.Mode.open) as wdb:
        return [
            item.job_id
            for item, result in wdb.completed_work_items
            if result.test_outcome == TestOutcome.SURVIVED and not _equivalent(module, item, result)
        ]


def _equivalent(module: str, item: Any, result: Any) -> bool:
    """A surviving mutant no test can tell from the original (EQUIVALENT, or a mutated annotation)."""
    m = item.mutations[0]
    return any((module, a) in EQUIVALENT for a in _added_lines(result.diff or "")) or _annotation_only(
        module, m.start_pos
    )


def summarize(
    module: str, tests: list[str], done: list[Any], sampled: tuple[int, int, int] | None = None
) -> dict[str, Any]:
    from cosmic_ray.work_item import TestOutcome

    killed = survived = incompetent = equivalent = 0
    survivors: list[dict[str, Any]] = []
    for item, result in done:
        if result.test_outcome == TestOutcome.KILLED:
            killed += 1
        elif result.test_outcome == TestOutcome.INCOMPETENT:
            incompetent += 1  # the mutant does not even import: counted apart, as cosmic-ray does
        else:
            if _equivalent(module, item, result):
                equivalent += 1
                continue
            survived += 1
            m = item.mutations[0]
            survivors.append({"line": m.start_pos[0], "operator": m.operator_name, "diff": result.diff})
    total = killed + survived
    out: dict[str, Any] = {
        "module": module,
        "tests": tests,
        "mutants": len(done),
        "killed": killed,
        "survived": survived,
        "incompetent": incompetent,
        "equivalent": equivalent,
        "score": round(killed / total, 3) if total else None,
    }
    if sampled is not None:
        out["sampled"] = f"{sampled[0]} of {sampled[1]}"
        out["seed"] = sampled[2]
        out["interval"] = [round(x, 3) for x in wilson(killed, total)] if total else None
    out["survivors"] = sorted(survivors, key=lambda s: s["line"])
    return out


def run_semantic(
    module: str,
    tests: list[str] | None = None,
    timeout_s: float = 120.0,
    keep: str | None = None,
    resume: str | None = None,
    sample: int | None = None,
    seed: int = 0,
    operators: tuple[str, ...] = semantic.OPERATORS,
    log: Any = None,
) -> dict[str, Any]:
    """The semantic mutants of `module` (simulations.semantic) against its fast tests, in a scratch copy of
    the tree. `keep`: write every outcome to this JSON file; `resume`: rerun only the survivors of such a
    file (not those counted equivalent), against the tests as they are now."""
    tests = _chosen_tests(module, tests)
    before: list[dict[str, Any]] = []
    only = None
    if resume:
        before = json.loads(Path(resume).read_text())["outcomes"]
        only = {o["diff"] for o in before if o["result"] == "survived" and not _equivalent_diff(module, o["diff"])}
    with tempfile.TemporaryDirectory(prefix="murmur-semantic-") as tmp:
        work = Path(tmp) / "tree"
        _copy_tree(work)
        command = test_command(tests)
        env = dict(os.environ, PYTHONPATH=str(work), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        base = subprocess.run(command, shell=True, cwd=work, env=env, capture_output=True, text=True)
        if base.returncode != 0:
            raise SystemExit(f"the tests fail without any mutation:\n{base.stdout[-3000:]}{base.stderr[-3000:]}")
        outcomes, total = semantic.run(
            module, tests, work, work, command, timeout_s, operators, sample, seed, only, log
        )
    rows = semantic.as_dicts(outcomes)
    if resume:  # the rerun outcomes replace the survivors' old ones
        again = {o["diff"]: o for o in rows}
        rows = [again.get(o["diff"], o) for o in before]
    if keep:
        Path(keep).write_text(
            json.dumps(
                {"module": module, "tests": tests, "total": total, "sample": sample, "seed": seed, "outcomes": rows},
                indent=1,
            )
        )
    return summarize_semantic(module, tests, rows, total, sample, seed)


def _equivalent_diff(module: str, diff: str) -> bool:
    return any((module, a) in EQUIVALENT for a in _added_lines(diff))


def summarize_semantic(
    module: str, tests: list[str], rows: list[dict[str, Any]], total: int, sample: int | None = None, seed: int = 0
) -> dict[str, Any]:
    """The counts of a semantic run, per module and per operator; a timeout counts as killed."""
    counts = {k: 0 for k in ("killed", "survived", "incompetent", "equivalent")}
    per_op: dict[str, list[int]] = {}
    survivors = []
    for o in rows:
        r = o["result"]
        if r == "survived" and _equivalent_diff(module, o["diff"]):
            r = "equivalent"
        r = "killed" if r == "timeout" else r
        counts[r] += 1
        if r in ("killed", "survived"):
            op = per_op.setdefault(o["operator"], [0, 0])
            op[0] += r == "killed"
            op[1] += 1
        if r == "survived":
            survivors.append({"line": o["line"], "operator": o["operator"], "diff": o["diff"]})
    scored = counts["killed"] + counts["survived"]
    out: dict[str, Any] = {
        "module": module,
        "kind": "semantic",
        "tests": tests,
        "mutants": len(rows),
        **counts,
        "score": round(counts["killed"] / scored, 3) if scored else None,
        "operators": {k: f"{a}/{b}" for k, (a, b) in sorted(per_op.items())},
    }
    if sample is not None:
        out["sampled"] = f"{len(rows)} of {total}"
        out["seed"] = seed
        out["interval"] = [round(x, 3) for x in wilson(counts["killed"], scored)] if scored else None
    out["survivors"] = sorted(survivors, key=lambda s: s["line"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m murmur.simulations.mutation", description=__doc__.splitlines()[0])
    ap.add_argument("module", help="a module path, e.g. gossip/ratelimit.py")
    ap.add_argument("--tests", nargs="+", help="test files to run per mutant (default: MODULE_TESTS)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant's tests (over: killed)")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    ap.add_argument("--db", help="keep cosmic-ray's session database here")
    ap.add_argument("--report", metavar="DB", help="only summarise a session kept with --db (no run)")
    ap.add_argument("--resume", metavar="DB", help="run only the survivors of a kept session again (new tests)")
    ap.add_argument("--sample", type=int, metavar="N", help="run only a seeded uniform sample of N mutants")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    ap.add_argument(
        "--semantic",
        action="store_true",
        help="semantic mutants (simulations/semantic.py) instead of cosmic-ray's; --db and --resume "
        "then name a JSON file of outcomes",
    )
    ap.add_argument(
        "--operators",
        nargs="+",
        choices=semantic.OPERATORS,
        default=list(semantic.OPERATORS),
        help="with --semantic: only these operators",
    )
    a = ap.parse_args(argv)
    if a.sample is not None and a.sample < 1:
        ap.error("--sample must be at least 1")
    if a.semantic:
        if a.report:
            rows = json.loads(Path(a.report).read_text())
            out = summarize_semantic(
                a.module, rows["tests"], rows["outcomes"], rows["total"], rows["sample"], rows["seed"]
            )
        else:
            out = run_semantic(
                a.module,
                a.tests,
                a.timeout,
                a.db,
                a.resume,
                a.sample,
                a.seed,
                tuple(a.operators),
                log=None if a.json else lambda line: print(line, flush=True),
            )
    else:
        out = (
            report(a.module, a.report)
            if a.report
            else run(a.module, a.tests, a.timeout, a.db, a.resume, a.sample, a.seed)
        )
    if not a.json:
        for s in out["survivors"]:
            print(f"survived: {a.module}:{s['line']} {s['operator']}\n{s['diff']}")
    print(json.dumps(out if not a.json else {k: v for k, v in out.items()}))


if __name__ == "__main__":
    main()
