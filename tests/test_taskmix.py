"""Task-set selection at a node (node/worker/taskmix.py) on a real SQLite store and real signed sets: a chosen
set not held yet is waited for (never replaced by the built-in one), a coordinator's new version
replaces the old one, "trusted" and weights, a set whose evaluation overlaps training is refused
with a reason, and the per-set counters and status that `murmur tasks list` shows."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from murmur.gossip.errors import ConfigError
from murmur.gossip.identity import Identity
from murmur.gossip.wire import TaskRef, content_id, decode_envelope
from murmur.node.store import open_store
from murmur.node.worker.taskmix import STATUS_KEY, TaskMix
from murmur.training.rollouts import RolloutRec
from murmur.training.selection import TaskSetChoice, normalise, resolve
from murmur.training.tasksets import (
    BUILTIN_COORDINATOR,
    TaskRegistry,
    TaskSetToml,
    builtin_manifest,
    manifest_from_toml,
    sign_task_set,
)
from murmur.training.tiny import warmup_generators

SWARM = "test"

COORD = Identity.from_seed(b"\x07" * 32)
OTHER = Identity.from_seed(b"\x08" * 32)


def signed(ident: Identity, name: str, version: int, eval_overlaps: bool = False) -> bytes:
    gens = [
        {
            "name": "sort",
            "generator": "sorting",
            "seed_end": 1000,
            "config": {"length": 5, "min_length": 4, "split": "train"},
        }
    ]
    gens.append(
        {
            "name": "sort-eval",
            "generator": "sorting",
            "seed_end": 1000,
            "config": {"length": 5, "min_length": 4, "split": "eval"},
        }
    )
    if eval_overlaps:  # held out from its own set, but murmur-tiny's warm-up trains on these look-ups
        gens.append({"name": "max-eval", "generator": "digits", "seed_end": 1000, "config": {"ops": "max"}})
    t = msgspec.convert(
        {"name": name, "version": version, "verifier": "exact", "generators": gens, "created_ms": 1}, TaskSetToml
    )
    return sign_task_set(ident, manifest_from_toml(t, name), swarm=SWARM)


def store_set(db, env: bytes) -> bytes:  # type: ignore[no-untyped-def]
    tid = content_id(decode_envelope(env, swarm=SWARM).body)
    m = msgspec.msgpack.decode(decode_envelope(env, swarm=SWARM).body)
    db.add_task_set(tid, m[1], m[2], bytes(m[3]), env)
    return tid


def mix(
    tmp_path: Path,
    entries: list,
    trusted: set[bytes] | None = None,  # type: ignore[no-untyped-def]
    swarm: str = SWARM,
):
    reg = TaskRegistry(swarm)
    reg.add_builtin()
    db = open_store(tmp_path)
    clock = [0.0]
    tm = TaskMix(
        reg, db, entries, {COORD.public} if trusted is None else trusted, warmup_generators(), clock=lambda: clock[0]
    )
    return tm, db, clock


def test_a_chosen_set_is_waited_for_then_its_newest_version_trained_on(tmp_path: Path) -> None:
    tm, db, clock = mix(tmp_path, ["coord-sort"])
    tm.refresh(force=True)
    assert tm.mixture == [] and tm.resolution.waiting == ["coord-sort"]  # no silent fallback to the built-in set
    assert "waiting for task set(s) coord-sort" in tm.describe_waiting()
    v1 = store_set(db, signed(COORD, "coord-sort", 1))
    assert not tm.refresh()  # polled at most every REFRESH_S
    clock[0] += 5
    assert tm.refresh() and tm.mixture == [(v1, 1.0)]
    v2 = store_set(db, signed(COORD, "coord-sort", 2))
    clock[0] += 5
    assert tm.refresh() and tm.mixture == [(v2, 1.0)]  # the new version replaces the old one
    store_set(db, signed(OTHER, "coord-sort", 9))  # an untrusted coordinator's set is refused, not followed
    clock[0] += 5
    assert not tm.refresh() and tm.mixture == [(v2, 1.0)]
    assert any("untrusted coordinator" in why for why in tm.refused.values())


def test_a_name_belongs_to_its_first_publisher(tmp_path: Path) -> None:
    """Two trusted coordinators: the second cannot take over the first's set name with a higher version."""
    tm, db, clock = mix(tmp_path, ["coord-sort"], trusted={COORD.public, OTHER.public})
    v1 = store_set(db, signed(COORD, "coord-sort", 1))
    taken = store_set(db, signed(OTHER, "coord-sort", 99))
    assert tm.refresh(force=True) and tm.mixture == [(v1, 1.0)]
    v2 = store_set(db, signed(COORD, "coord-sort", 2))
    clock[0] += 5
    assert tm.refresh() and tm.mixture == [(v2, 1.0)]  # its owner's new version still replaces the old one
    by_id = TaskMix(tm.registry, db, [taken.hex()], {COORD.public, OTHER.public}, warmup_generators())
    assert by_id.refresh(force=True) and by_id.mixture == [(taken, 1.0)]  # the other set, chosen by its id


def test_builtin_trusted_and_weights(tmp_path: Path) -> None:
    tm, db, clock = mix(tmp_path, ["builtin", {"set": "trusted", "weight": 3.0}])
    tm.refresh(force=True)
    assert tm.mixture == [(tm.registry.builtin_id, 1.0)] and tm.resolution.waiting == ["trusted"]
    a = store_set(db, signed(COORD, "a", 1))
    b = store_set(db, signed(COORD, "b", 1))
    clock[0] += 5
    assert tm.refresh()
    assert tm.mixture[0] == (tm.registry.builtin_id, 1.0) and sorted(tm.mixture[1:]) == sorted([(a, 3.0), (b, 3.0)])


def test_a_set_whose_eval_overlaps_the_warmup_is_refused_with_the_reason(tmp_path: Path) -> None:
    tm, db, clock = mix(tmp_path, ["bad"])
    store_set(db, signed(COORD, "bad", 1, eval_overlaps=True))
    tm.refresh(force=True)
    assert tm.mixture == [] and tm.resolution.waiting == ["bad"]
    assert "'max-eval' overlaps training generator 'lookup'" in tm.describe_waiting()


def test_counters_and_status(tmp_path: Path) -> None:
    tm, db, clock = mix(tmp_path, ["builtin"])
    tm.refresh(force=True)
    bid = tm.registry.builtin_id
    task = tm.registry.resolve(TaskRef(bid, "rev", 3))
    recs = [
        RolloutRec(
            ref=TaskRef(bid, "rev", 3),
            task=task,
            prompt_ids=[],
            ids=[],
            text="",
            logprobs=[],
            token_versions=[],
            version=0,
            lineage=bytes(32),
            tokenizer_hash=bytes(32),
            sampling=None,
            reward=r,
        )
        for r in (1.0, 0.0, 1.0, 1.0)
    ]
    tm.produced(recs)
    tm.accepted({bid: 5, b"\xee" * 32: 7})  # a set not held here is not counted
    tm.used({bid: 6})
    tm.record_eval(bid, 0, {"rev": 0.25, "all": 0.25})
    tm.record_eval(bid, 25, {"rev": 0.5, "all": 0.5})
    tm.save()
    st = db.get(STATUS_KEY)
    (row,) = st["sets"]
    assert (row["produced"], row["accepted"], row["used"], row["training"]) == (4, 5, 6, True)
    assert row["reward_by_generator"] == {"rev": 0.75}
    assert row["eval"]["start"]["accuracy"]["rev"] == 0.25 and row["eval"]["last"]["step"] == 25
    assert st["waiting"] == [] and st["choices"] == [{"set": "builtin", "weight": 1.0}]


def test_selection_entries_are_checked() -> None:
    assert normalise(["builtin", {"set": "AB" * 32, "weight": 2}]) == [
        TaskSetChoice(set="builtin"),
        TaskSetChoice(set="ab" * 32, weight=2.0),
    ]
    for bad, msg in (
        ([], "empty"),
        ([{"set": "a", "weight": 0}], "weight"),
        ([{"sett": "a"}], "sett"),
        (["a" * 200], "not a task-set name"),
    ):
        with pytest.raises(ConfigError, match=msg):
            normalise(bad)
    m = builtin_manifest()
    r = resolve(normalise(["f" * 64]), [(b"\x01" * 32, m)], b"\x01" * 32, BUILTIN_COORDINATOR.public)
    assert r.mixture == [] and r.waiting == ["f" * 64]


@pytest.mark.parametrize(
    "body,msg",
    [
        (
            '[training]\ntask_sets = ["mine"]\n',
            "key 'training.task_sets': 'mine' can only come from a trusted coordinator",
        ),
        ("[training]\ntask_sets = []\n", "key 'training.task_sets': empty"),
        ('[training]\ntask_sets = [{ set = "builtin", weight = 0.0 }]\n', "weight 0.0 of 'builtin'"),
        ('[training]\ntask_set = "builtin"\n', "unknown key 'training.task_set'"),
    ],
)
def test_bad_task_set_config_is_a_one_line_error(tmp_path: Path, body: str, msg: str) -> None:
    from murmur.node.config import load_config

    f = tmp_path / "config.toml"
    f.write_text(body)
    with pytest.raises(ConfigError, match=msg) as e:
        load_config(f)
    assert "\n" not in str(e.value) and str(f) in str(e.value)


def test_task_set_config_with_weights_loads_and_flattens(tmp_path: Path) -> None:
    from murmur.node.config import flatten, load_config

    f = tmp_path / "config.toml"
    f.write_text(
        f'[training]\ntask_sets = ["builtin", {{ set = "trusted", weight = 2.0 }}]\n'
        f'[trust]\ncoordinators = ["{COORD.public.hex()}"]\n'
    )
    cfg = load_config(f)
    assert normalise(cfg.training.task_sets) == [TaskSetChoice(set="builtin"), TaskSetChoice(set="trusted", weight=2.0)]
    assert flatten(cfg)["training.task_sets"] == ["builtin", {"set": "trusted", "weight": 2.0}]


def test_demo_task_set_is_checked_signed_and_installed_before_any_node_starts(tmp_path: Path) -> None:
    from murmur.gossip.errors import TaskError
    from murmur.node.cli.demo import DemoTaskSet, node_config, run_demo
    from murmur.node.cli.launch import write_config
    from murmur.node.config import load_config

    bad = tmp_path / "bad.toml"
    bad.write_text(
        'name = "b"\nverifier = "exact"\n[[generators]]\nname = "max-eval"\ngenerator = "digits"\n'
        'seed_end = 100\nconfig = { ops = "max" }\n[[generators]]\nname = "s"\ngenerator = "sorting"\n'
        "seed_end = 100\nconfig = { length = 6, min_length = 5 }\n"
    )
    with pytest.raises(TaskError, match="'max-eval' overlaps training generator 'lookup'"):
        run_demo(duration_s=1, workdir=tmp_path / "demo", tui=False, task_set=bad)
    assert not (tmp_path / "demo").exists()  # refused before anything was created or started
    good = tmp_path / "good.toml"
    good.write_text(bad.read_text().replace('ops = "max"', 'ops = "count"'))
    ds = DemoTaskSet(good)
    assert ds.max_new_tokens == 12  # the longest answer, six sorted digits "0,1,2,3,4,5", plus EOS
    home = tmp_path / "h"
    home.mkdir()
    ds.install(home)
    cfg = load_config(
        write_config(
            home,
            node_config(
                ["trainer"],
                "murmur-tiny",
                task_set=ds.manifest.name,
                coordinator=ds.coordinator.public.hex(),
                max_new_tokens=ds.max_new_tokens,
            ),
        )
    )
    assert cfg.training.task_sets == ["b"] and cfg.trust.coordinators == [ds.coordinator.public.hex()]
    tm, _, _ = mix(home, cfg.training.task_sets, {ds.coordinator.public}, swarm=cfg.node.swarm)  # as its worker
    tm.refresh(force=True)
    assert tm.mixture == [(ds.id, 1.0)] and not tm.refused
