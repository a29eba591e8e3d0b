"""Task generators, verifiers and signed task sets: determinism, scoring, refusal of bad input."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from murmur.gossip.errors import DecodeError, SignatureError, TaskError
from murmur.gossip.identity import Identity
from murmur.gossip.wire import TASK_SET, Envelope, TaskRef, decode_envelope, encode, open_envelope, seal
from murmur.training.tasks import BUILTIN_GENERATORS, generate
from murmur.training.tasksets import (
    BUILTIN_COORDINATOR,
    BUILTIN_EVAL,
    BUILTIN_TRAIN,
    TaskRegistry,
    builtin_manifest,
    builtin_task_set,
    load_task_set_toml,
    sign_task_set,
    task_set_id,
)
from murmur.training.verifiers import extract_answer, parse_number, score

SWARM = "test"

EXAMPLE = Path(__file__).resolve().parents[1] / "training" / "tasksets" / "example.toml"


@pytest.mark.parametrize(
    "gen,cfg",
    [
        ("arithmetic", {"digits": 3, "ops": "+-*"}),
        ("arithmetic", {"digits": 2, "ops": "+", "mod": 10}),
        ("digits", {"length": 6, "ops": "reverse,sum,max,min,first,last,count"}),
        ("sorting", {"length": 5, "max_value": 50, "descending": True}),
    ],
)
def test_builtin_generators_are_deterministic_and_self_consistent(gen: str, cfg: dict) -> None:
    tasks = [generate(gen, cfg, s) for s in range(200)]
    again = [generate(gen, cfg, s) for s in range(200)]
    assert tasks == again
    assert len({t.prompt for t in tasks}) > 20  # seeds actually vary the task
    for t in tasks:
        assert score(t, t.answer) == 1.0
        assert score(t, f"thinking...\n<answer>{t.answer}</answer>") == 1.0
        assert score(t, t.answer + "1") == 0.0


def test_arithmetic_answers_are_correct() -> None:
    for s in range(300):
        t = generate("arithmetic", {"digits": 2, "ops": "+-*"}, s)
        expr = t.prompt.rstrip("=")
        assert int(t.answer) == eval(expr)  # our own generated digits and operators


def test_sorting_and_digits_answers() -> None:
    for s in range(100):
        t = generate("sorting", {"length": 6}, s)
        xs = [int(x) for x in t.prompt.split(" ", 1)[1].rstrip("=").split(",")]
        assert t.answer == ",".join(map(str, sorted(xs)))
        d = generate("digits", {"length": 5, "ops": "reverse"}, s)
        assert d.answer == d.prompt.split(" ")[1].rstrip("=")[::-1]


@pytest.mark.parametrize(
    "gen,cfg,msg",
    [
        ("nope", {}, "unknown generator"),
        ("arithmetic", {"digitz": 2}, "unknown config key 'digitz'"),
        ("arithmetic", {"digits": "2"}, "must be an integer"),
        ("arithmetic", {"digits": 99}, "outside"),
        ("arithmetic", {"ops": "/"}, "ops"),
        ("digits", {"ops": "explode"}, "ops"),
        ("rg:no_such_dataset", {}, "unknown reasoning-gym dataset"),
        ("rg:basic_arithmetic", {"bogus_key": 1}, "bad config"),
    ],
)
def test_unknown_generators_and_configs_raise_task_error(gen: str, cfg: dict, msg: str) -> None:
    with pytest.raises(TaskError, match=msg):
        generate(gen, cfg, 0)


def test_reasoning_gym_entries_are_deterministic_and_scored_by_the_dataset() -> None:
    cfg = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    a = [generate("rg:basic_arithmetic", cfg, s) for s in range(20)]
    b = [generate("rg:basic_arithmetic", cfg, s) for s in range(20)]
    assert a == b and len({t.prompt for t in a}) > 5
    for t in a:
        assert t.verifier == "rg_score"
        assert score(t, f"<answer>{t.answer}</answer>") == 1.0
        assert score(t, "<answer>not a number</answer>") == 0.0


def test_verifiers() -> None:
    t = generate("arithmetic", {"digits": 1}, 3)
    num = msgspec.structs.replace(t, answer="0.5", verifier="numeric", tolerance=0.01)
    assert score(num, "0.504") == 1.0 and score(num, "0.52") == 0.0 and score(num, "1/2") == 1.0
    assert score(num, "the answer is 0.5") == 1.0
    mv = msgspec.structs.replace(t, answer="\\frac{1}{2}", verifier="math_verify", tolerance=0.0)
    assert score(mv, "\\boxed{0.5}") == 1.0
    assert score(mv, "\\boxed{\\frac{2}{4}}") == 1.0
    assert score(mv, "\\boxed{3}") == 0.0
    ex = msgspec.structs.replace(t, answer="Hello World", verifier="exact")
    assert score(ex, "  hello   world. ") == 1.0 and score(ex, "hello") == 0.0
    bad = msgspec.structs.replace(t, verifier="eval")
    with pytest.raises(TaskError, match="unknown verifier"):
        score(bad, "1")
    assert extract_answer("a\n\\boxed{x{y}}") == "x{y}"
    assert parse_number("1,234.5") == parse_number("1234.5")
    assert parse_number("1e99999") is None  # no giant exponent blow-up


# ------------------------------------------------------------ task sets


def test_builtin_task_set_is_identical_everywhere_and_resolves() -> None:
    a, b = builtin_task_set(SWARM), builtin_task_set(SWARM)
    assert a == b
    reg = TaskRegistry(SWARM)
    m = reg.add_builtin()
    assert reg.builtin_id == task_set_id(a, swarm=SWARM)
    assert {BUILTIN_TRAIN, BUILTIN_EVAL} <= {g.name for g in m.generators}
    t = reg.resolve(TaskRef(reg.builtin_id, BUILTIN_TRAIN, 7))
    assert t.prompt.endswith("=") and score(t, t.answer) == 1.0
    with pytest.raises(TaskError, match="seed out of range"):
        reg.resolve(TaskRef(reg.builtin_id, BUILTIN_TRAIN, 1_000_000))
    with pytest.raises(TaskError, match="unknown generator"):
        reg.resolve(TaskRef(reg.builtin_id, "other", 0))
    with pytest.raises(TaskError, match="unknown task set"):
        reg.resolve(TaskRef(bytes(32), BUILTIN_TRAIN, 0))


def test_the_public_builtin_key_is_trusted_for_the_builtin_body_only() -> None:
    forged = msgspec.structs.replace(builtin_manifest(), description="evil")
    env = seal(BUILTIN_COORDINATOR, TASK_SET, forged, swarm=SWARM)
    with pytest.raises(SignatureError, match="built-in"):
        TaskRegistry(SWARM).add(env, set())


def test_example_toml_round_trips_through_signing(tmp_path: Path) -> None:
    m = load_task_set_toml(EXAMPLE)
    ident = Identity.from_seed(b"\x01" * 32)
    env = sign_task_set(ident, m, swarm=SWARM)
    reg = TaskRegistry(SWARM)
    got = reg.add(env, {ident.public})
    tid = task_set_id(env, swarm=SWARM)
    assert reg.get(tid) == got and got.coordinator == ident.public
    assert [x for x, _ in reg.list()] == [tid]
    for g in got.generators:
        t = reg.resolve(TaskRef(tid, g.name, g.seed_start + 1))
        assert score(t, f"<answer>{t.answer}</answer>") == 1.0


def test_untrusted_and_forged_task_sets_are_refused() -> None:
    ident, other = Identity.from_seed(b"\x02" * 32), Identity.from_seed(b"\x03" * 32)
    env = sign_task_set(ident, load_task_set_toml(EXAMPLE), swarm=SWARM)
    with pytest.raises(SignatureError, match="untrusted"):
        TaskRegistry(SWARM).add(env, {other.public})
    e = decode_envelope(env, swarm=SWARM)
    tampered = encode(Envelope(e.v, e.kind, e.swarm, e.body[:-1] + bytes([e.body[-1] ^ 1]), e.signer, e.sig))
    with pytest.raises(SignatureError):
        TaskRegistry(SWARM).add(tampered, {ident.public})
    with pytest.raises(DecodeError):
        TaskRegistry(SWARM).add(b"\x93garbage", {ident.public})


def test_unknown_generator_or_verifier_in_a_signed_set_is_refused() -> None:
    ident = Identity.from_seed(b"\x04" * 32)
    m = load_task_set_toml(EXAMPLE)
    g0 = msgspec.structs.replace(m.generators[0], generator="shell")
    bad_gen = msgspec.structs.replace(m, generators=[g0], coordinator=ident.public, created_ms=1)
    with pytest.raises(TaskError, match="unknown generator"):
        TaskRegistry(SWARM).add(seal(ident, TASK_SET, bad_gen, swarm=SWARM), {ident.public})
    bad_ver = msgspec.structs.replace(m, verifier="python", coordinator=ident.public, created_ms=1)
    with pytest.raises(TaskError, match="unknown verifier"):
        TaskRegistry(SWARM).add(seal(ident, TASK_SET, bad_ver, swarm=SWARM), {ident.public})
    with pytest.raises(TaskError, match="unknown verifier"):
        sign_task_set(ident, msgspec.structs.replace(m, verifier="python"), swarm=SWARM)


@pytest.mark.parametrize(
    "body,msg",
    [
        (
            'name = "x"\nverifier = "exact"\n[[generators]]\nname = "a"\ngenerator = "digits"\nseed_end = 5\nfoo = 1\n',
            r"unknown key 'generators\[0\]\.foo'",
        ),
        ('name = "x"\nverifier = "exact"\n[[generators]]\nname = "a"\ngenerator = "digits"\n', "missing key"),
        ('name = "x"\nverifier = "exact"\ngenerators = []\n', "key 'generators'"),
        (
            'name = "x"\nverifier = "nope"\n[[generators]]\nname = "a"\ngenerator = "digits"\nseed_end = 5\n',
            "unknown verifier",
        ),
        (
            'name = "x"\nverifier = "exact"\n[[generators]]\nname = "a"\ngenerator = "bash"\nseed_end = 5\n',
            "unknown generator",
        ),
        (
            'name = "x"\nverifier = "exact"\n[[generators]]\nname = "a"\ngenerator = "digits"\nseed_end = 5\n'
            'config = { length = "long" }\n',
            "must be an integer",
        ),
        (
            'name = "x"\nverifier = "exact"\n[[generators]]\nname = "a"\ngenerator = "digits"\nseed_start = 9\nseed_end = 5\n',
            "seed_end",
        ),
        ("name = [", "not valid TOML"),
    ],
)
def test_malformed_toml_gets_a_one_line_error_naming_file_and_key(tmp_path: Path, body: str, msg: str) -> None:
    p = tmp_path / "ts.toml"
    p.write_text(body)
    with pytest.raises(TaskError, match=msg) as ei:
        load_task_set_toml(p)
    assert str(p) in str(ei.value) and "\n" not in str(ei.value)


def test_missing_toml_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no such task-set file"):
        load_task_set_toml(tmp_path / "absent.toml")


def test_builtin_generator_list_is_closed() -> None:
    assert set(BUILTIN_GENERATORS) == {"arithmetic", "digits", "sorting", "worked"}
    env, body = open_envelope(builtin_task_set(SWARM), TASK_SET, swarm=SWARM)
    assert body.coordinator == env.signer
