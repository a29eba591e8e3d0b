"""Closed registry of answer verifiers: score(task, completion) -> reward in [0, 1].

Every receiver of a rollout recomputes its reward here, so scoring must be
cheap (the gossip validation pipeline targets >= 2000 rollouts/s per core,
signature check included) and must never run anything from the network: the
verifier is named from a fixed list, the completion is only parsed.

Answer extraction, shared by all verifiers: the content of the last
`<answer>...</answer>` if present, else of the last `\\boxed{...}`, else the
last non-empty line of the completion. Completions are cut to 8 KiB and the
extracted answer to 256 characters before any parsing, which bounds the
worst-case cost of `math_verify`'s parser.

`math_verify` tries a fast normalised numeric/fraction comparison first and
only calls the `math-verify` package (sympy-based, ~2 ms) when that is
inconclusive; without the package the fast comparison is the whole verifier.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import Final

from gossip.errors import TaskError
from training.tasks import Task, rg_entry

MAX_COMPLETION_CHARS: Final = 8192
MAX_ANSWER_CHARS: Final = 256

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?:/\d+)?")
_WS = re.compile(r"\s+")


def _last_boxed(text: str) -> str | None:
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    j = i + len("\\boxed{")
    depth = 1
    for k in range(j, min(len(text), j + 4 * MAX_ANSWER_CHARS)):
        c = text[k]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[j:k]
    return None


def extract_answer(completion: str) -> str:
    """The answer part of a completion (see module docstring), stripped."""
    text = completion[:MAX_COMPLETION_CHARS]
    if "<answer>" in text.lower():
        found = _ANSWER_TAG.findall(text)
        if found:
            return found[-1].strip()[:MAX_ANSWER_CHARS]
    if "\\boxed{" in text:
        boxed = _last_boxed(text)
        if boxed is not None:
            return boxed.strip()[:MAX_ANSWER_CHARS]
    stripped = text.strip()
    nl = stripped.rfind("\n")
    return (stripped[nl + 1:] if nl >= 0 else stripped).strip()[:MAX_ANSWER_CHARS]


def normalise(text: str) -> str:
    """Case-folded, whitespace-collapsed, trailing period dropped."""
    return _WS.sub(" ", text.strip()).rstrip(".").strip().casefold()


def parse_number(text: str) -> Fraction | None:
    """Exact value of a plain number, fraction or decimal (commas as thousands), else None."""
    t = text.strip().replace("$", "").replace(" ", "")
    if not t or len(t) > 64:
        return None
    if t.startswith("\\frac{") and t.endswith("}"):
        m = re.fullmatch(r"\\frac\{([-+]?\d+)\}\{(\d+)\}", t)
        if not m:
            return None
        t = f"{m.group(1)}/{m.group(2)}"
    if "," in t:
        if not re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", t):
            return None
        t = t.replace(",", "")
    try:
        if "/" in t:
            n, d = t.split("/", 1)
            if not re.fullmatch(r"[-+]?\d+", n) or not re.fullmatch(r"\d+", d) or int(d) == 0:
                return None
            return Fraction(int(n), int(d))
        if "e" in t.lower() and abs(int(t.lower().split("e", 1)[1])) > 400:
            return None
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def _last_number(text: str) -> Fraction | None:
    found = _NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def _close(x: Fraction, y: Fraction, tolerance: float) -> bool:
    if tolerance <= 0:
        return x == y
    return abs(float(x) - float(y)) <= tolerance * max(1.0, abs(float(y)))


# ------------------------------------------------------------ verifiers


def score_exact(task: Task, completion: str) -> float:
    return 1.0 if normalise(extract_answer(completion)) == normalise(task.answer) else 0.0


def score_numeric(task: Task, completion: str) -> float:
    """Numeric match within `tolerance` (relative above 1, absolute below); exact when 0."""
    gold = parse_number(task.answer)
    if gold is None:
        return score_exact(task, completion)
    ans = extract_answer(completion)
    got = parse_number(ans)
    if got is None:
        got = _last_number(ans)
    return 1.0 if got is not None and _close(got, gold, task.tolerance) else 0.0


_mv_lock = threading.Lock()


def _math_verify_pkg(gold: str, answer: str) -> bool | None:
    try:
        from math_verify import parse, verify  # noqa: PLC0415
    except ImportError:
        return None
    main = threading.current_thread() is threading.main_thread()
    # math-verify's timeouts use SIGALRM, only usable on the main thread; elsewhere
    # the length caps above bound the parse.
    timeout = 2 if main else None
    try:
        with _mv_lock:
            g = parse(gold, parsing_timeout=timeout)
            a = parse(answer, parsing_timeout=timeout)
            return bool(verify(g, a, timeout_seconds=timeout))
    except Exception:  # a parser failure on untrusted text is a wrong answer, not a crash
        return False


def score_math_verify(task: Task, completion: str) -> float:
    ans = extract_answer(completion)
    gold = parse_number(task.answer)
    got = parse_number(ans)
    if gold is not None and got is not None:
        return 1.0 if _close(got, gold, task.tolerance) else 0.0
    if normalise(ans) == normalise(task.answer):
        return 1.0
    ok = _math_verify_pkg(f"${task.answer}$", f"${ans}$" if "$" not in ans else ans)
    if ok is None:
        return 0.0
    return 1.0 if ok else 0.0


def score_rg(task: Task, completion: str) -> float:
    """The reasoning-gym dataset's own scorer, on the regenerated entry."""
    import json  # noqa: PLC0415

    if not task.generator.startswith("rg:"):
        raise TaskError(f"verifier 'rg_score' needs a reasoning-gym generator, not {task.generator!r}")
    from training.tasks import rg_dataset  # noqa: PLC0415

    cfg = json.loads(task.config_json)
    name = task.generator[3:]
    ds = rg_dataset(name, cfg, task.seed)
    entry = rg_entry(name, cfg, task.seed)
    try:
        s = ds.score_answer(extract_answer(completion), entry)
    except Exception:
        return 0.0
    try:
        s = float(s)
    except (TypeError, ValueError):
        return 0.0
    return min(1.0, max(0.0, s)) if s == s else 0.0


VERIFIERS: Final[dict[str, Callable[[Task, str], float]]] = {
    "exact": score_exact,
    "numeric": score_numeric,
    "math_verify": score_math_verify,
    "rg_score": score_rg,
}


def check_verifier(name: str) -> None:
    if name not in VERIFIERS:
        raise TaskError(f"unknown verifier {name!r} (known: {', '.join(VERIFIERS)})")


def score(task: Task, completion_text: str) -> float:
    """Reward in [0, 1] of `completion_text` for `task`, by the task's verifier."""
    fn = VERIFIERS.get(task.verifier)
    if fn is None:
        raise TaskError(f"unknown verifier {task.verifier!r} (known: {', '.join(VERIFIERS)})")
    return fn(task, completion_text)
