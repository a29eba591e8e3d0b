"""Report folder: metrics rows stream to JSONL/CSV, reload, and render PNG plots and an HTML page."""

from __future__ import annotations

import json

import pytest

from murmur.gossip.errors import MurmurError
from murmur.simulations.report import MetricsWriter, load_metrics, rebuild, write_report


def _fill(w: MetricsWriter) -> None:
    for t in range(10):
        for node in range(3):
            w.add("reward", t=float(t), node=node, reward=0.1 * t, isolated=0.05 * t, version=t, group="g")
        w.add("lag", t=float(t), node=3, lag=t % 3)
        w.add("staleness", t=float(t), node=0, staleness=t % 2)
        w.add("score", t=float(t), peer=4, behaviour="forged_reward", score=-10.0 * t)
    for i in range(4):
        w.add("broadcast", n=0, receiver=i, completion_s=1.0 + i, lower_bound_s=0.8, bytes=1000)
        w.add("bytes", node=i, group="g", bytes_up=1000 * i, bytes_down=500)
    w.add("rejection", t=1.0, node=0, peer=4, reason="forged_reward")
    w.add("rejection", t=2.0, node=1, peer=4, reason="blacklisted")
    w.add("event", t=3.0, node=2, action="leave")


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_metrics_round_trip_and_page(tmp_path, fmt: str) -> None:
    w = MetricsWriter(tmp_path, fmt)
    _fill(w)
    w.close()
    rows = load_metrics(tmp_path)
    assert len(rows["reward"]) == 30
    assert rows["reward"][5]["reward"] == pytest.approx(0.1)
    assert rows["rejection"][0]["reason"] == "forged_reward"
    page = write_report(
        tmp_path, rows, {"title": "t", "gain_swarm": 0.5, "graylist_threshold": -50.0}, 'name = "x"\n', threshold=-50.0
    )
    html = page.read_text()
    for png in ("reward.png", "staleness.png", "broadcast.png", "bytes.png", "rejections.png", "scores.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png in html
    assert "gain_swarm" in html and "name = &quot;x&quot;" in html
    assert json.loads((tmp_path / "summary.json").read_text())["gain_swarm"] == 0.5
    (tmp_path / "reward.png").unlink()
    rebuild(tmp_path)
    assert (tmp_path / "reward.png").exists()


def test_empty_kinds_skip_their_plots(tmp_path) -> None:
    page = write_report(tmp_path, {"reward": []}, {"x": 1})
    assert "<img" not in page.read_text()


def test_bad_inputs(tmp_path) -> None:
    with pytest.raises(MurmurError, match="format must be"):
        MetricsWriter(tmp_path, "xml")
    w = MetricsWriter(tmp_path / "a")
    with pytest.raises(ValueError):
        w.add("nonsense", x=1)
    w.close()
    with pytest.raises(MurmurError, match="no metrics"):
        load_metrics(tmp_path / "empty-dir-that-has-nothing")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("{not json\n")
    with pytest.raises(MurmurError, match="not a metrics row"):
        load_metrics(tmp_path / "b")
