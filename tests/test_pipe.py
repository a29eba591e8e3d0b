"""The worker pipe: every message kind is a Struct, checked when built and when read; bytes stay bytes."""

from __future__ import annotations

import multiprocessing

import pytest

from murmur.gossip.errors import DecodeError
from murmur.node import pipe


def test_every_kind_round_trips_with_bytes_as_bytes() -> None:
    env = bytes(range(256)) * 4
    cases = {
        "follow": {"id": "ab", "name": "n", "publisher": "cd", "base": "ef"},
        "patch": {"lineage": "ab", "kind": "patch", "base": 1, "target": 2},
        "admit": {"lineage": "ab", "generate": True},
        "pace": {"rollouts_per_s": 1.5},
        "head": {"lineage": "ab", "version": 7},
        "external": env,
        "stop": None,
        "ready": {"base": "ab", "version": 0, "model_bytes": 10},
        "state": "training",
        "rollouts": [env, b""],
        "step": {
            "step": 1,
            "version": 2,
            "reward_mean": 0.5,
            "loss": None,
            "n_external_groups": 3,
            "step_s": 1.0,
            "used": 3,
            "published": 2,
            "rollouts_per_step": 8,
        },
        "gen": {"reward_mean": 0.1, "version": 1, "tokens": 5, "latency_s": 0.2},
        "published": {"version": 3, "envelope": env, "bytes": 99},
        "applied": {"lineage": "ab", "version": 3},
        "apply_failed": {"lineage": "ab", "base": 2, "target": 3, "error": "x"},
        "perf": {"gen_tokens_per_s": 10.0, "rollout_latency_s": 1.0},
        "spot": {"ok": False, "producer": "ab", "diff": 0.3, "lineage": "cd", "version": 1},
        "spot_round": {"eligible": 7},
        "engine": {"requested": "vllm", "mode": "", "error": "vLLM is not installed"},
        "error": "boom",
        "log": "hi",
    }
    assert set(cases) == set(pipe.KINDS)
    for kind, body in cases.items():
        m = pipe.decode(pipe.encode(kind, body))
        assert type(m) is pipe.KINDS[kind]
    assert pipe.decode(pipe.encode("external", env)).data == env
    assert pipe.decode(pipe.encode("published", cases["published"])).total_bytes == 99
    assert pipe.decode(pipe.encode("follow", None)).info is None


def test_malformed_messages_are_decode_errors() -> None:
    with pytest.raises(DecodeError):
        pipe.encode("nope", {})
    with pytest.raises(DecodeError):
        pipe.encode("applied", {"lineage": "ab"})  # a field missing
    with pytest.raises(DecodeError):
        pipe.encode("pace", {"rollouts_per_s": "fast"})
    with pytest.raises(DecodeError):
        pipe.encode("head", {"lineage": "ab", "version": -1})  # versions are >= 0
    for junk in (b"", b"\xc1", pipe.encode("pace", {"rollouts_per_s": 1.0})[:-1]):
        with pytest.raises(DecodeError):
            pipe.decode(junk)


def test_messages_cross_a_real_pipe_as_bytes() -> None:
    a, b = multiprocessing.Pipe(duplex=True)
    a.send_bytes(pipe.encode("rollouts", [b"\x00\x01"]))
    assert b.poll(5) and pipe.decode(b.recv_bytes(pipe.MAX_MESSAGE)) == pipe.Rollouts([b"\x00\x01"])
    a.close()
    b.close()
