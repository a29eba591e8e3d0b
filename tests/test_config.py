from __future__ import annotations

import pytest

from murmur.gossip.errors import ConfigError
from murmur.node.config import Config, load_config, load_config_with_sources, render_default_config


def test_default_config_round_trips(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(render_default_config())
    assert load_config(path) == Config()
    assert "# use the Kademlia DHT" in path.read_text()


def test_missing_file_gives_defaults(tmp_path):
    assert load_config(tmp_path / "none.toml") == Config()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[network]\nbogus = 1\n", "unknown key 'network.bogus'"),
        ("[nosuch]\nx = 1\n", "unknown key 'nosuch'"),
        ("[sync]\nmax_staleness = 'four'\n", "key 'sync.max_staleness'"),
        ("[network]\nlisten = 5\n", "key 'network.listen'"),
        ("[network\n", "not valid TOML"),
        ("\xff\xfe", "not valid TOML"),
    ],
)
def test_bad_config_is_one_line_naming_file_and_key(tmp_path, text, needle):
    path = tmp_path / "config.toml"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and needle in msg and "\n" not in msg


def test_env_overrides_and_sources(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[sync]\nmax_staleness = 2\n[network]\nbootstrap = ['/ip4/127.0.0.1/tcp/1']\n")
    cfg, sources = load_config_with_sources(path, {"MURMUR_SYNC_MAX_STALENESS": "7", "MURMUR_NODE_SWARM": "lab"})
    assert cfg.sync.max_staleness == 7 and sources["sync.max_staleness"] == "env MURMUR_SYNC_MAX_STALENESS"
    assert cfg.node.swarm == "lab"
    assert cfg.network.bootstrap == ["/ip4/127.0.0.1/tcp/1"] and sources["network.bootstrap"] == str(path)
    assert sources["gossip.rate_burst"] == "default"


def test_bad_env_override(tmp_path):
    with pytest.raises(ConfigError, match="MURMUR_SYNC_NOPE"):
        load_config_with_sources(None, {"MURMUR_SYNC_NOPE": "1"})
    with pytest.raises(ConfigError, match="sync.max_staleness"):
        load_config_with_sources(None, {"MURMUR_SYNC_MAX_STALENESS": "'x'"})


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[trust]\ncoordinators = ['aa']\n", "trust.coordinators"),
        ("[node]\nroles = ['miner']\n", "node.roles"),
        ("[node]\nhardware = 'tpu'\n", "node.hardware"),
        ("[training]\nloss_norm = 'sum'\n", "training.loss_norm"),
        ("[network]\nbootstrap = ['127.0.0.1:4001']\n", "network.bootstrap"),
        ("[sync]\nchunk_bytes = 0\n", "sync.chunk_bytes"),
        ("[sync]\nmax_staleness = -1\n", "sync.max_staleness"),
        ("[training]\ntemperature = 0.005\n", "training.temperature"),  # receivers would refuse every rollout
        ("[training]\ntemperature = 11.0\n", "training.temperature"),
        ("[training]\ntemperature = nan\n", "training.temperature"),
        ("[training]\nminibatch_groups = -1\n", "training.minibatch_groups"),
        ("[training]\nminibatch_groups = 5000\n", "training.minibatch_groups"),
        ("[training]\nschedule_share = 1.5\n", "training.schedule_share"),
        ("[training]\nschedule_share = -0.1\n", "training.schedule_share"),
        ("[training]\nschedule_share = nan\n", "training.schedule_share"),
        ("[training]\nselect_groups = -1\n", "training.select_groups"),
        ("[training]\nselect_groups = 1025\n", "training.select_groups"),
        ("[training]\nfollower_oversample = 0.5\n", "training.follower_oversample"),
        ("[training]\nfollower_oversample = 9.0\n", "training.follower_oversample"),
    ],
)
def test_semantic_errors_name_the_key(tmp_path, text, needle):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("t", [0.0, 0.01, 0.7, 10.0])
def test_temperatures_receivers_accept_are_accepted(tmp_path, t):
    path = tmp_path / "config.toml"
    path.write_text(f"[training]\ntemperature = {t!r}\n")
    assert load_config(path).training.temperature == t
