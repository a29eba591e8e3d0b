"""Node identity: one ed25519 key that signs everything and is also the libp2p peer ID.

The key is stored as PKCS#8 PEM with mode 0600. The peer ID is computed here
exactly as libp2p does (identity multihash of the protobuf-encoded public key,
base58btc) so that commands like `murmur id` need not import py-libp2p.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from murmur.gossip.errors import IdentityError

KEY_FILE = "identity.pem"
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def peer_id_from_public(public: bytes) -> str:
    """libp2p peer ID of an ed25519 public key (32 raw bytes)."""
    if type(public) is bytes:  # hashable: a bounded memo, since base58 in pure Python is slow and runs per message
        return _peer_id_memo(public)
    return _peer_id(bytes(public))


@functools.lru_cache(maxsize=16_384)
def _peer_id_memo(public: bytes) -> str:
    return _peer_id(public)


def _peer_id(public: bytes) -> str:
    if len(public) != 32:
        raise IdentityError(f"ed25519 public key must be 32 bytes, got {len(public)}")
    # protobuf PublicKey{Type=Ed25519(1), Data=public}: 08 01 12 20 <32 bytes>
    proto = b"\x08\x01\x12\x20" + public
    # 36 bytes <= 42: libp2p uses the identity multihash (code 0x00, length).
    return b58encode(b"\x00" + bytes([len(proto)]) + proto)


def verify(public: bytes, signature: bytes, message: bytes) -> bool:
    """True when `signature` is a valid ed25519 signature of `message` by `public`."""
    if len(public) != 32 or len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity, for tests and simulations."""
        if len(seed) != 32:
            raise IdentityError("ed25519 seed must be 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @cached_property  # derived from the private key on every call otherwise (a node asks per message)
    def public(self) -> bytes:
        return self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def seed(self) -> bytes:
        return self.private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @cached_property
    def peer_id(self) -> str:
        return peer_id_from_public(self.public)

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    def save(self, path: Path, force: bool = False) -> None:
        """Write atomically with mode 0600; refuse to overwrite unless forced."""
        path = Path(path)
        if path.exists() and not force:
            raise IdentityError(f"{path}: identity key exists; use --force to replace it")
        pem = self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Identity:
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise IdentityError(f"{path}: no identity key; run `murmur init`") from None
        except OSError as e:
            raise IdentityError(f"{path}: cannot read identity key: {e.strerror}") from None
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(f"{path}: identity key is readable by others (mode {mode:o}); chmod 600 it")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise IdentityError(f"{path}: not a valid PEM ed25519 private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{path}: key is not ed25519")
        return cls(key)
