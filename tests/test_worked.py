"""The worked-answer regime: a built-in family whose answers need worked steps (>= 64 completion tokens),
graded on the result after the marker with malformed work scoring 0, held out like the other built-in
families, and the murmur-tiny build warmed up on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from murmur.gossip.errors import TaskError
from murmur.training.evaluation import check_evaluation, held_out_tasks, well_formed
from murmur.training.tasks import generate
from murmur.training.tasksets import (
    answers_manifest,
    check_manifest,
    eval_generators,
    overlap,
    train_generators,
    worked_manifest,
)
from murmur.training.tokenizer import CHARS
from murmur.training.verifiers import MAX_COMPLETION_CHARS, Verdicts, score, worked_digest


def _chain(seed: int, split: str = "train") -> object:
    g = next(x for x in worked_manifest().generators if x.config["split"] == split)
    return generate(g.generator, g.config, seed, g.verifier)


def test_every_worked_answer_needs_at_least_64_completion_tokens() -> None:
    for split in ("train", "eval"):
        tasks = [_chain(s, split) for s in range(300)]
        texts = [t.answer for t in tasks] + [t.prompt for t in tasks]  # type: ignore[attr-defined]
        assert all(c in CHARS for x in texts for c in x)  # murmur-tiny's tokenizer: one token per character
        assert min(len(t.answer) for t in tasks) >= 64, split  # type: ignore[attr-defined]
        # prompt, answer and EOS fit murmur-tiny's 128 positions
        assert max(len(t.prompt) + len(t.answer) + 1 for t in tasks) <= 128  # type: ignore[attr-defined]


def test_the_verifier_grades_the_result_after_the_marker_and_scores_malformed_work_zero() -> None:
    t = _chain(0)
    ref = t.answer  # type: ignore[attr-defined]
    steps, final = ref.rsplit(";", 1)
    wrong = str((int(final.split()[-1]) + 1) % 10)
    assert score(t, ref) == 1.0  # type: ignore[arg-type]
    assert score(t, " " + ref.replace(";", "; ") + " ") == 1.0  # type: ignore[arg-type]  # spacing is not work
    assert score(t, f"{steps};#### {wrong}") == 0.0  # type: ignore[arg-type]
    assert score(t, final) == 0.0  # type: ignore[arg-type]  # the result without the work
    assert score(t, steps.split(";", 1)[1] + ";" + final) == 0.0  # type: ignore[arg-type]  # a step skipped
    assert score(t, steps + ";" + steps.split(";")[0] + ";" + final) == 0.0  # type: ignore[arg-type]  # one too many
    assert score(t, steps.replace("+", " plus ", 1) + ";" + final) == 0.0  # type: ignore[arg-type]  # not a step
    assert score(t, ref.replace("####", "Answer:")) == 0.0  # type: ignore[arg-type]  # no marker
    assert score(t, ref + ";" + final) == 0.0  # type: ignore[arg-type]  # work after the result
    # a step's numbers are not graded, only their shape: the result after the marker is the answer
    first, rest = steps.split(";", 1)
    assert score(t, first[:-1] + str((int(first[-1]) + 5) % 10) + ";" + rest + ";" + final) == 1.0  # type: ignore[arg-type]


def test_the_verdict_cache_keys_worked_work_by_a_short_digest() -> None:
    t = _chain(1)
    v = Verdicts(entries=4)
    assert v.score(t, t.answer) == 1.0  # type: ignore[arg-type,attr-defined]
    assert [k[1] for k in v._d] == [worked_digest(t.answer)]  # type: ignore[attr-defined]
    assert len(worked_digest(t.answer)) <= 8  # type: ignore[attr-defined]
    long = ";".join(["1+a1=2"] * (MAX_COMPLETION_CHARS // 6 + 10)) + ";#### 2"
    assert worked_digest(long) == ""  # cut at the completion limit: no marker left, so malformed


def test_the_worked_family_is_held_out_like_the_other_built_in_families() -> None:
    m = worked_manifest()
    check_manifest(m)  # eval held out from the set's training generators
    check_evaluation([m], train_generators(answers_manifest("worked")))  # ... and from the warm-up's
    (e,), (t,) = eval_generators(m), train_generators(m)
    assert overlap(e, t) is None
    same = type(e)(
        name="chain-eval", generator="worked", config={**e.config, "split": "all"}, seed_start=0, seed_end=10
    )
    assert overlap(same, t) is not None  # the whole space is not held out from its train side
    train = {_chain(s).prompt for s in range(2000)}  # type: ignore[attr-defined]
    evals = [x.task for x in held_out_tasks(m, 100)]
    assert not {x.prompt for x in evals} & train
    assert len(train) == 2000  # a space far larger than what RL sees: it has to learn the rule


def test_a_worked_answer_is_well_formed_with_the_reference_steps_whatever_its_numbers() -> None:
    t = _chain(2)
    steps, final = t.answer.rsplit(";", 1)  # type: ignore[attr-defined]
    assert well_formed(t, t.answer)  # type: ignore[arg-type,attr-defined]
    assert well_formed(t, steps.replace("=", "=1", 1) + ";#### 7")  # type: ignore[arg-type]
    assert not well_formed(t, steps.split(";", 1)[1] + ";" + final)  # type: ignore[arg-type]


def test_the_worked_regime_has_its_own_murmur_tiny_build(tmp_path: Path) -> None:
    from murmur.training.tiny import WORKED_WARMUP_STEPS, tiny_dir

    assert tiny_dir(tmp_path) != tiny_dir(tmp_path, answers="worked")
    assert tiny_dir(tmp_path, answers="worked").name == f"murmur-tiny-worked-s0-w{WORKED_WARMUP_STEPS}"
    assert tiny_dir(tmp_path, 3, 2) != tiny_dir(tmp_path, 3, 2, answers="worked")
    with pytest.raises(TaskError, match="answers"):
        answers_manifest("long")
