"""Shared fixtures. Threads are capped before torch loads: the machine has 2 shared cores."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from gossip.identity import Identity  # noqa: E402


@pytest.fixture
def identity() -> Identity:
    return Identity.from_seed(bytes(range(32)))


@pytest.fixture
def other_identity() -> Identity:
    return Identity.from_seed(bytes(range(1, 33)))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh node home, also exported as MURMUR_HOME."""
    h = tmp_path / "home"
    monkeypatch.setenv("MURMUR_HOME", str(h))
    return h


@pytest.fixture
def webrtc_extra() -> None:
    """Skip, with the reason, where the optional `webrtc` extra (aiortc) is not installed (as in CI)."""
    from gossip.webrtc import webrtc_unavailable

    reason = webrtc_unavailable()
    if reason:
        pytest.skip(f"WebRTC extra not installed: {reason}")
