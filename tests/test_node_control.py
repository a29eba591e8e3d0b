"""Control socket, status encoding, dashboard rendering and metrics export, in one process."""

from __future__ import annotations

import io
import select
import socket
import urllib.request
from pathlib import Path

import pytest
import trio

from murmur.node.shell import control
from murmur.node.status import LineageView, NodeStatus, PeerView
from murmur.node.ui.dashboard import node_panel, sparkline, swarm_table
from murmur.node.ui.metrics import Metrics
from murmur.sync.ids import Relation


def sample_status() -> NodeStatus:
    return NodeStatus(
        peer_id="12D3KooWtest",
        swarm="s",
        roles=["follower", "validator"],
        state="running",
        worker="generating",
        worker_restarts=2,
        serving="ab" * 32,
        serving_reason="largest unmet demand",
        peers=[PeerView(peer_id="12D3KooWpeer", roles=["trainer"])],
        lineages=[LineageView(lineage="ab" * 32, name="l", relation=Relation.FOLLOW, head=9, held=7, lag=2)],
        rollouts_produced=40,
        rollouts_accepted=12,
        rejected={"forged_reward": 3},
        reward_trend=[0.1, 0.4, 0.8],
        reward_start=0.1,
        reward_now=0.8,
        bytes_down=12345,
    )


def _serve_and_query(home: Path, cmd: str) -> dict:
    out: dict = {}

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(control.serve, home, sample_status)
            try:
                out["reply"] = await trio.to_thread.run_sync(control.request, home, cmd)
            except control.ControlError as e:
                out["error"] = e
            n.cancel_scope.cancel()

    trio.run(main)
    if "error" in out:
        raise out["error"]
    return out["reply"]


def test_status_over_control_socket(tmp_path: Path) -> None:
    reply = _serve_and_query(tmp_path, "status")
    assert reply["peer_id"] == "12D3KooWtest"
    assert reply["lineages"][0]["lag"] == 2
    assert not (tmp_path / "control.sock").exists()  # removed on exit


def test_unknown_command_is_an_error_reply(tmp_path: Path) -> None:
    with pytest.raises(control.ControlError, match="unknown command"):
        _serve_and_query(tmp_path, "reboot")


def test_deep_home_uses_short_socket_path(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 60) / ("y" * 60)
    deep.mkdir(parents=True)
    assert len(str(control.socket_path(deep))) <= 100
    assert _serve_and_query(deep, "status")["swarm"] == "s"


def test_no_node_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(control.ControlError, match="no node is running"):
        control.status(tmp_path, timeout=1.0)


def test_garbage_request_gets_error_reply() -> None:
    assert b"malformed" in control.handle_request(b"\xff\x00garbage\n", sample_status)


def test_dashboard_renders_status() -> None:
    from rich.console import Console

    buf = io.StringIO()
    con = Console(file=buf, width=160, force_terminal=False)
    con.print(node_panel(sample_status()))
    con.print(swarm_table([("n0", sample_status()), ("n1", None)]))
    text = buf.getvalue()
    assert "forged_reward 3" in text and "not answering" in text and "0.10 → 0.80" in text
    assert "restarted 2×" in text
    assert sparkline([0.0, 1.0]) == "▁█"


def test_metrics_exported_over_http() -> None:
    m = Metrics()
    port = m.serve(0)
    try:
        m.update(sample_status())
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    assert 'murmur_rollouts_rejected_total{reason="forged_reward"} 3.0' in body
    assert "murmur_reward 0.8" in body
    assert "murmur_worker_restarts_total 2.0" in body
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


HOSTILE_REQUESTS = [
    b"[" * 4000 + b"\n",  # nested past the JSON decoder's depth limit (RecursionError in the stdlib json)
    b'{"cmd":' * 500 + b"1" + b"}" * 500 + b"\n",
    b"\xff\xfe\x00garbage\n",  # not UTF-8
    b'{"cmd": "\xff"}\n',
    b'{"cmd": 5}\n',  # wrong types
    b'{"cmd": ["status"]}\n',
    b"[1, 2]\n",
    b"null\n",
    b'{"cmd": "' + b"x" * 6000 + b'"}\n',  # a line over the limit
    b'{"cmd": "status", "extra": {"a": [[[1]]]}}\n',
]


def test_control_socket_answers_hostile_input_with_errors(tmp_path: Path) -> None:
    replies: list[bytes] = []

    def ask(raw: bytes) -> bytes:
        path = control.socket_path(tmp_path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(path))
            try:
                s.sendall(raw)
            except BrokenPipeError:  # the node answered and closed before reading all of a huge line
                pass
            buf = b""
            while True:
                try:
                    part = s.recv(65536)
                except ConnectionResetError:  # the node closed with our unread bytes queued: its reply came first
                    return buf
                if not part:
                    return buf
                buf += part

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(control.serve, tmp_path, sample_status)
            for raw in HOSTILE_REQUESTS:
                replies.append(await trio.to_thread.run_sync(ask, raw))
            # a megabyte without a newline: read up to the limit, answered, the rest reset
            replies.append(await trio.to_thread.run_sync(ask, b"x" * 1_000_000))
            replies.append(await trio.to_thread.run_sync(ask, b'{"cmd": "ping"}\n'))
            n.cancel_scope.cancel()

    trio.run(main)
    for raw, reply in zip(HOSTILE_REQUESTS, replies):
        assert b'"error"' in reply, (raw[:40], reply[:200])
    huge = replies[len(HOSTILE_REQUESTS)]
    assert huge == b'{"error": "request line over %d bytes"}' % control.MAX_REQUEST, huge[:200]
    assert replies[-1] == b'{"ok": true}'  # the server outlived all of them


def test_control_socket_serves_at_most_max_clients_at_once(tmp_path: Path) -> None:
    """Idle local clients hold at most MAX_CLIENTS handlers: the next one is served only when one leaves."""
    from trio.testing import wait_all_tasks_blocked

    async def main() -> None:
        async with trio.open_nursery() as n:
            path = await n.start(control.serve, tmp_path, sample_status)
            idle = [await trio.open_unix_socket(str(path)) for _ in range(control.MAX_CLIENTS)]
            await wait_all_tasks_blocked()  # every idle client's handler is waiting for its request line
            late = await trio.open_unix_socket(str(path))
            await late.send_all(b'{"cmd": "ping"}\n')
            await wait_all_tasks_blocked()  # the server did all it would do for `late`
            # not served while MAX_CLIENTS are held: nothing to read, nor closed
            assert select.select([late.socket.fileno()], [], [], 0)[0] == []
            await idle[0].aclose()
            with trio.fail_after(10):
                assert await late.receive_some(100) == b'{"ok": true}'
            for s in idle[1:] + [late]:
                await s.aclose()
            n.cancel_scope.cancel()

    trio.run(main)
