"""Scenario format: built-ins load, round-trip, and every kind of bad input is one clear line."""

from __future__ import annotations

import msgspec
import pytest

from murmur.gossip.errors import ConfigError
from murmur.simulations import scenario as S


@pytest.mark.parametrize("name", S.BUILTINS)
def test_builtins_load_and_round_trip(name: str) -> None:
    sc = S.builtin(name)
    assert sc.name == name
    assert S.loads(S.dumps(sc)) == sc
    nodes = S.expand(sc)
    assert len(nodes) == sc.total_nodes
    assert [n.index for n in nodes] == list(range(len(nodes)))


def test_expand_places_adversaries_after_honest_nodes() -> None:
    sc = S.builtin("adversarial")
    nodes = S.expand(sc)
    assert [n.role for n in nodes[: sc.honest_nodes]] == ["trainer"] * sc.honest_nodes
    assert {n.behaviour for n in nodes[sc.honest_nodes :]} == set(S.BEHAVIOURS)


def test_integers_accepted_for_float_keys(tmp_path) -> None:
    p = tmp_path / "s.toml"
    p.write_text("duration_s = 60\n[[group]]\ncount = 2\nupload_bytes_per_s = 1000000\n")
    sc = S.load(p)
    assert sc.duration_s == 60.0 and sc.groups[0].upload_bytes_per_s == 1e6


BAD = [
    ("nodes = 3", "unknown key 'nodes'"),
    ("[[group]]\nspeed = 1", "unknown key 'group[0].speed'"),
    ('duration_s = "long"', "key 'duration_s': Expected `float`, got `str`"),
    ("[[group]]\ncount = 0", "key 'group[0].count'"),
    ("[[group]]\nloss = 1.5", "key 'group[0].loss'"),
    ("[[group]]\nupload_bytes_per_s = -1.0", "key 'group[0].upload_bytes_per_s'"),
    ("[[group]]\ncount = 2\njoin_s = 10.0\nleave_s = 5.0", "key 'group[0].leave_s': leave_s (5.0) must come after"),
    ('[[group]]\nrole = "follower"', "key 'group': no group has role = \"trainer\""),
    (
        '[[group]]\ncount = 2\n[[group]]\nrole = "follower"\nfollow = 2',
        "key 'group[1].follow': node 2 is not a trainer",
    ),
    ('[[adversary]]\nbehaviour = "polite"', "key 'adversary[0].behaviour'"),
    ('[[adversary]]\nbehaviour = "replay"\ngroup = 3', "key 'adversary[0].group': group 3 does not exist"),
    ('[[event]]\nat_s = 1.0\naction = "leave"\nnode = 7', "key 'event[0].node': node 7 does not exist"),
    ('[[event]]\nat_s = 1.0\naction = "explode"\nnode = 0', "key 'event[0].action'"),
    ('duration_s = 10.0\n[[event]]\nat_s = 20.0\naction = "leave"\nnode = 0', "key 'event[0].at_s'"),
    ("[learning]\ninitial = 0.9\nceiling = 0.5", "key 'learning.initial'"),
    ("[sync]\npatch_bytes = 1000\nchunk_bytes = 4096", "key 'sync.chunk_bytes'"),
    ("[training]\nlocal_groups = 0\nexternal_groups = 0", "key 'training.local_groups'"),
    ("[churn]\nprotect = [9]", "key 'churn.protect[0]'"),
    ("seed = -1", "key 'seed'"),
    ("this is not toml", "not valid TOML"),
]


@pytest.mark.parametrize("text,expect", BAD)
def test_bad_scenarios_name_file_and_key(text: str, expect: str) -> None:
    with pytest.raises(ConfigError) as e:
        S.loads(text, "my.toml")
    msg = str(e.value)
    assert msg.startswith("my.toml: "), msg
    assert expect in msg, msg
    assert "\n" not in msg


def test_file_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such scenario file"):
        S.load(tmp_path / "missing.toml")
    p = tmp_path / "bin.toml"
    p.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        S.load(p)
    with pytest.raises(ConfigError, match="no built-in scenario 'nope'"):
        S.builtin("nope")


def test_resolve_prefers_builtin_names_and_paths(tmp_path) -> None:
    assert S.resolve("churn").name == "churn"
    p = tmp_path / "x.toml"
    p.write_text('name = "mine"\n')
    assert S.resolve(p).name == "mine"


def test_to_builtins_uses_toml_key_names() -> None:
    raw = msgspec.to_builtins(S.builtin("adversarial"))
    assert "group" in raw and "adversary" in raw and "groups" not in raw
