from __future__ import annotations

import os
import stat

import pytest

from murmur.gossip.errors import IdentityError
from murmur.gossip.identity import Identity, peer_id_from_public, verify


def test_peer_id_matches_libp2p(identity):
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    kp = create_new_key_pair(identity.seed)
    assert ID.from_pubkey(kp.public_key).to_base58() == identity.peer_id
    assert identity.peer_id.startswith("12D3KooW")


def test_sign_verify(identity, other_identity):
    sig = identity.sign(b"hello")
    assert verify(identity.public, sig, b"hello")
    assert not verify(identity.public, sig, b"hellO")
    assert not verify(other_identity.public, sig, b"hello")
    assert not verify(identity.public[:31], sig, b"hello")


def test_save_load_mode_and_refusal(tmp_path, identity):
    path = tmp_path / "k.pem"
    identity.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Identity.load(path).public == identity.public
    with pytest.raises(IdentityError, match="exists"):
        Identity.generate().save(path)
    Identity.generate().save(path, force=True)
    assert Identity.load(path).public != identity.public


@pytest.mark.parametrize(
    "content", [b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"]
)
def test_corrupt_key_is_one_line_error(tmp_path, content):
    path = tmp_path / "k.pem"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(IdentityError) as e:
        Identity.load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_world_readable_key_refused(tmp_path, identity):
    path = tmp_path / "k.pem"
    identity.save(path)
    path.chmod(0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        Identity.load(path)


def test_bad_public_key_length():
    with pytest.raises(IdentityError):
        peer_id_from_public(b"\x00" * 31)
