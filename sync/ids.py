"""Lineage ids: pure hashing with no torch, so the network process can check manifests cheaply; and how a node
relates to a lineage (`Relation`)."""

from __future__ import annotations

import functools
import hashlib
import struct
from enum import StrEnum

LINEAGE_DOMAIN = b"murmur/lineage/v1\x00"


class Relation(StrEnum):
    """How this node relates to a lineage; the values are what the node's store keeps (its `lineages.relation`
    CHECK) and what status shows."""

    OWN = "own"  # this node's key publishes it
    FOLLOW = "follow"  # this node served it, or applied a version of it
    SEEN = "seen"  # heard of only


def lineage_id(publisher: bytes, base_model_hash: bytes, name: str) -> bytes:
    """blake2b-256 of (publisher key, base model state hash, lineage name)."""
    if type(publisher) is bytes and type(base_model_hash) is bytes and type(name) is str:
        return _lineage_id_memo(publisher, base_model_hash, name)  # a node derives it per announce and manifest
    return _lineage_id(publisher, base_model_hash, name)


@functools.lru_cache(maxsize=16_384)
def _lineage_id_memo(publisher: bytes, base_model_hash: bytes, name: str) -> bytes:
    return _lineage_id(publisher, base_model_hash, name)


def _lineage_id(publisher: bytes, base_model_hash: bytes, name: str) -> bytes:
    if len(publisher) != 32 or len(base_model_hash) != 32:
        raise ValueError("publisher key and base model hash must be 32 bytes")
    nb = name.encode()
    return hashlib.blake2b(
        LINEAGE_DOMAIN + publisher + base_model_hash + struct.pack("<H", len(nb)) + nb, digest_size=32
    ).digest()
