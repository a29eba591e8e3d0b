"""The local control socket: `murmur node status` (and the demo) read a running node's state.

A unix socket in the node home (mode 0600: only the owner may ask). One
request per connection: a JSON line `{"cmd": "status"}`, answered with the
NodeStatus JSON, then the connection closes. Serving copies a snapshot, so a
reader never disturbs the node. Unix socket paths are limited to ~107 bytes;
for a deep home the socket lives in the temp dir and `<home>/control.addr`
names it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from murmur.gossip.errors import DecodeError, MurmurError
from murmur.node.status import STATUS_LIMIT, NodeStatus, decode_status, encode_status

MAX_REQUEST = 4096
MAX_CLIENTS = 8  # requests served at once; more wait in the listen backlog
CLIENT_TIMEOUT_S = 5.0
log = logging.getLogger("murmur.node.control")
ADDR_FILE = "control.addr"
_MAX_UNIX_PATH = 100


class ControlError(MurmurError):
    """No node answers on the control socket, or it answered garbage."""


def socket_path(home: Path, name: str = "control.sock") -> Path:
    """Where the node binds its control socket (short enough for AF_UNIX)."""
    p = Path(home).resolve() / name
    if len(str(p)) <= _MAX_UNIX_PATH:
        return p
    tag = hashlib.blake2b(str(p).encode(), digest_size=6).hexdigest()
    return Path(tempfile.gettempdir()) / f"murmur-{tag}.sock"


def _addr_for_client(home: Path, name: str) -> Path:
    f = Path(home) / ADDR_FILE
    if f.exists():
        try:
            return Path(f.read_text().strip())
        except OSError:
            pass
    return socket_path(home, name)


def request(home: Path, cmd: str = "status", name: str = "control.sock", timeout: float = 5.0) -> dict[str, Any]:
    """Send one command to the node running in `home`; its JSON reply as a dict."""
    path = _addr_for_client(home, name)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"no node is running in {home} (nothing listens on {path})") from None
        except OSError as e:
            raise ControlError(f"cannot reach the node in {home}: {e.strerror or e}") from None
        s.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
        buf = bytearray()
        while len(buf) <= STATUS_LIMIT:
            try:
                part = s.recv(65536)
            except TimeoutError:
                raise ControlError(f"the node in {home} did not answer within {timeout} s") from None
            if not part:
                break
            buf += part
    finally:
        s.close()
    if len(buf) > STATUS_LIMIT:
        raise ControlError("control reply too large")
    try:
        out = json.loads(buf)
    except ValueError:
        raise ControlError(f"malformed control reply from {path}") from None
    if not isinstance(out, dict):
        raise ControlError("control reply is not an object")
    if "error" in out:
        raise ControlError(str(out["error"]))
    return out


def status(home: Path, name: str = "control.sock", timeout: float = 5.0) -> NodeStatus:
    data = json.dumps(request(home, "status", name, timeout)).encode()
    try:
        return decode_status(data)
    except DecodeError as e:
        raise ControlError(str(e)) from None


class ControlRequest(msgspec.Struct, forbid_unknown_fields=True):
    """One request line: `{"cmd": "status"}`."""

    cmd: str


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def handle_request(raw: bytes, snapshot: Callable[[], NodeStatus]) -> bytes:
    """Sans-IO request handler: bytes in, reply bytes out (errors are replies, never exceptions).

    Anything a local client sends is answered: a line over `MAX_REQUEST` bytes, bytes that are not
    UTF-8 JSON, JSON nested past msgspec's depth limit, or a value of the wrong shape gets an error
    reply; the decoder's work is bounded by the line length.
    """
    line = raw.split(b"\n", 1)[0]
    if len(line) > MAX_REQUEST:
        return _error(f"request line over {MAX_REQUEST} bytes")
    try:
        cmd = msgspec.json.decode(line, type=ControlRequest).cmd if line.strip() else "status"
    except msgspec.ValidationError as e:
        return _error(f"malformed request: {str(e)[:200]}")
    except msgspec.DecodeError:
        return _error("malformed request: not a JSON object on one line")
    if cmd == "status":
        return encode_status(snapshot())
    if cmd == "ping":
        return b'{"ok": true}'
    return _error(f"unknown command {cmd[:64]!r} (status, ping)")


async def serve(
    home: Path, snapshot: Callable[[], NodeStatus], name: str = "control.sock", *, task_status: Any = None
) -> None:
    """Serve the control socket until cancelled (trio); removes the socket file on exit."""
    import trio

    path = socket_path(home, name)
    addr_file = Path(home) / ADDR_FILE
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(16)
    if path.parent != Path(home).resolve():
        addr_file.write_text(str(path))
    listener = trio.SocketListener(sock)

    limiter = trio.CapacityLimiter(MAX_CLIENTS)

    async def one(stream: trio.SocketStream) -> None:
        async with limiter, stream:
            try:
                buf = bytearray()
                with trio.move_on_after(CLIENT_TIMEOUT_S):
                    while b"\n" not in buf and len(buf) <= MAX_REQUEST:
                        part = await stream.receive_some(MAX_REQUEST)
                        if not part:
                            break
                        buf += part
                reply = handle_request(bytes(buf), snapshot)
                with trio.move_on_after(CLIENT_TIMEOUT_S):
                    await stream.send_all(reply)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # the client went away
            except Exception:  # never let one client end the node
                log.exception("control request failed")

    try:
        if task_status is not None:
            task_status.started(path)
        await trio.serve_listeners(one, [listener])
    finally:
        try:
            path.unlink()
        except OSError:
            pass
        try:
            addr_file.unlink()
        except OSError:
            pass
