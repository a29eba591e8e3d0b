"""Held-out evaluation by construction: the split of built-in problem spaces, the overlap check on
task sets (built-in rules and reasoning-gym collision probes), and the built-in set's eval side
against its training generators and murmur-tiny's warm-up."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from murmur.gossip.errors import TaskError
from murmur.gossip.wire import GeneratorSpec
from murmur.training.evaluation import check_evaluation, held_out_tasks, rg_collisions, well_formed
from murmur.training.tasks import BUILTIN_GENERATORS, eval_side, generate
from murmur.training.tasksets import (
    BUILTIN_FAMILIES,
    builtin_manifest,
    load_task_set_toml,
    overlap,
    train_generators,
)
from murmur.training.tiny import warmup_generators, warmup_prompts


def spec(name: str, generator: str, config: dict, start: int = 0, end: int = 1_000_000) -> GeneratorSpec:
    return GeneratorSpec(name=name, generator=generator, config=config, seed_start=start, seed_end=end)


@pytest.mark.parametrize("family,generator,config", [(f, g, c) for f, g, c, _ in BUILTIN_FAMILIES])
def test_the_two_sides_of_a_builtin_split_never_share_a_problem(family: str, generator: str, config: dict) -> None:
    train = {generate(generator, {**config, "split": "train"}, s).prompt for s in range(3000)}
    held = {generate(generator, {**config, "split": "eval"}, s).prompt for s in range(1000)}
    assert train and held and not train & held
    assert all(eval_side(p, 5) for p in held) and not any(eval_side(p, 5) for p in train)
    # about one problem in `holdout` (5) of the whole space is on the eval side
    everything = [generate(generator, config, s).prompt for s in range(3000)]
    assert 0.1 < sum(eval_side(p, 5) for p in everything) / len(everything) < 0.3


def test_split_all_draws_what_the_generator_drew_before_splits_existed() -> None:
    # the first draw of the seed's stream: existing task sets keep their tasks and ids
    assert (
        generate("arithmetic", {"digits": 2, "ops": "+-*"}, 7).prompt
        == generate("arithmetic", {"digits": 2, "ops": "+-*", "split": "all"}, 7).prompt
    )
    assert set(BUILTIN_GENERATORS["sorting"].params) >= {"split", "holdout"}


def test_builtin_set_is_held_out_from_training_and_warmup_with_enough_problems() -> None:
    m = builtin_manifest()
    check_evaluation([m], warmup_generators())
    tasks = held_out_tasks(m, 100)
    prompts = {t.task.prompt for t in tasks}
    assert len(prompts) >= 200
    assert {t.family for t in tasks} == {f for f, *_ in BUILTIN_FAMILIES}
    assert not prompts & warmup_prompts(0)  # none of them is in the warm-up's 6,400 problems
    train = {generate(g.generator, g.config, s).prompt for g in train_generators(m) for s in range(2000)}
    assert not prompts & train


def test_builtin_training_spaces_are_too_large_to_memorise() -> None:
    # RL has to learn each family's rule: 2,000 draws of a training generator are mostly distinct problems
    # (with ~880 problems a family's training reward rises by memorising them while held-out accuracy stays)
    for g in train_generators(builtin_manifest()):
        assert len({generate(g.generator, g.config, s).prompt for s in range(2000)}) >= 1000, g.name


def test_well_formed_is_the_answer_shape_not_the_answer() -> None:
    sort = generate("sorting", {"length": 3, "min_length": 3}, 0)
    assert well_formed(sort, "9,9,9") and well_formed(sort, sort.answer + " ")
    assert not well_formed(sort, "9,9") and not well_formed(sort, "99,9") and not well_formed(sort, "9,9,9,9")
    rev = generate("digits", {"length": 4, "min_length": 4, "ops": "reverse"}, 0)
    assert well_formed(rev, "0000") and not well_formed(rev, "000") and not well_formed(rev, "00a0")


def test_disjoint_seeds_of_one_builtin_space_are_not_held_out() -> None:
    cfg = {"digits": 1, "ops": "+"}
    e, t = spec("add-eval", "arithmetic", cfg, 1_000_000, 1_010_000), spec("add", "arithmetic", cfg, 0, 1_000_000)
    assert "disjoint seeds are not enough" in (overlap(e, t) or "")
    # and indeed they collide: the old built-in set's 'add-eval' was in training's 100 problems
    assert {generate("arithmetic", cfg, s).prompt for s in range(1_000_000, 1_000_200)} <= {
        generate("arithmetic", cfg, s).prompt for s in range(2000)
    }


@pytest.mark.parametrize(
    "e_cfg,t_cfg,held",
    [
        ({"digits": 2, "ops": "*"}, {"digits": 2, "ops": "+-"}, True),  # operations never trained on
        ({"digits": 3, "min_digits": 3}, {"digits": 2}, True),  # operand lengths never trained on
        ({"digits": 2, "mod": 7}, {"digits": 2}, True),
        ({"digits": 2, "split": "eval"}, {"digits": 2, "split": "train"}, True),
        ({"digits": 2, "split": "eval", "holdout": 4}, {"digits": 2, "split": "train"}, False),  # other partition
        ({"digits": 2, "split": "eval"}, {"digits": 2}, False),  # training draws from the whole space
        ({"digits": 3, "min_digits": 2}, {"digits": 2}, False),  # two-digit operands on both sides
    ],
)
def test_overlap_rules_for_arithmetic(e_cfg: dict, t_cfg: dict, held: bool) -> None:
    assert (overlap(spec("x-eval", "arithmetic", e_cfg), spec("x", "arithmetic", t_cfg)) is None) == held


def test_reasoning_gym_seed_ranges_and_collision_counts() -> None:
    a, b = spec("ls", "rg:leg_counting", {}, 0, 500_000), spec("ls-eval", "rg:leg_counting", {}, 500_000, 10**6)
    assert overlap(b, a) is None
    assert overlap(spec("x-eval", "rg:leg_counting", {}, 400_000, 600_000), a) is not None
    assert overlap(spec("x-eval", "rg:number_sorting", {}), a) is None  # another dataset
    # collisions counted: large datasets give none in 1000 x 1000 draws ...
    for name in ("rg:leg_counting", "rg:number_sorting"):
        assert rg_collisions(spec("e", name, {}, 10**6), spec("t", name, {}), 1000, 1000) == 0
    # ... a small configuration of basic_arithmetic collides, and the start check refuses it
    cfg = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    small_t, small_e = (
        spec("ar", "rg:basic_arithmetic", cfg, 0, 10**6),
        spec("ar-eval", "rg:basic_arithmetic", cfg, 10**6, 2 * 10**6),
    )
    assert rg_collisions(small_e, small_t) > 0
    m = msgspec.structs.replace(builtin_manifest(), generators=[small_t, small_e])
    with pytest.raises(TaskError, match="too small for disjoint seeds"):
        check_evaluation([m], [])


TOML_HEAD = 'name = "t"\nverifier = "exact"\n'


def _gen(name: str, generator: str, config: str, start: int = 0, end: int = 1000) -> str:
    return (
        f'[[generators]]\nname = "{name}"\ngenerator = "{generator}"\nseed_start = {start}\nseed_end = {end}\n'
        f"config = {config}\n"
    )


@pytest.mark.parametrize(
    "body,msg",
    [
        (
            _gen("add", "arithmetic", "{ digits = 1 }") + _gen("add-eval", "arithmetic", "{ digits = 1 }", 1000, 2000),
            "eval generator 'add-eval' overlaps training generator 'add'",
        ),
        (
            _gen("look", "digits", '{ length = 1, min_length = 1, ops = "first", split = "eval", holdout = 1000 }'),
            "no 'eval' problem in 256 draws",
        ),
        (_gen("add", "arithmetic", '{ split = "test" }'), "config 'split'='test' not one of all, train, eval"),
    ],
)
def test_bad_task_sets_get_a_one_line_error(tmp_path: Path, body: str, msg: str) -> None:
    f = tmp_path / "ts.toml"
    f.write_text(TOML_HEAD + body)
    with pytest.raises(TaskError, match=msg) as e:
        load_task_set_toml(f)
    assert "\n" not in str(e.value) and str(f) in str(e.value)


def test_a_coordinator_eval_generator_that_overlaps_the_warmup_is_refused_at_start() -> None:
    m = msgspec.structs.replace(
        builtin_manifest(),
        name="coord",
        generators=[
            spec("sort", "sorting", {"length": 5, "min_length": 4}),
            spec("max-eval", "digits", {"length": 4, "ops": "max"}),  # murmur-tiny's warm-up trains on these
        ],
    )
    check_evaluation([m], [])  # held out from the set's own training generators ...
    with pytest.raises(TaskError, match="'max-eval' overlaps training generator 'lookup' \\(task set 'coord'\\)"):
        check_evaluation([m], warmup_generators())  # ... but not from the warm-up
