"""Closed registry of answer verifiers: score(task, completion) -> reward in [0, 1].

Every receiver of a rollout recomputes its reward here, so scoring must be
cheap (the gossip validation pipeline targets >= 2000 rollouts/s per core,
signature check included) and must never run anything from the network: the
verifier is named from a fixed list, the completion is only parsed.

Answer extraction, shared by all verifiers but `worked`: the content of the last
`<answer>...</answer>` if present, else of the last `\\boxed{...}`, else the
last non-empty line of the completion. `worked` judges the whole completion's
work through a short digest (`worked_digest`). Completions are cut to 8 KiB and the
extracted answer to 256 characters before any parsing, which bounds the
worst-case cost of `math_verify`'s parser.

`math_verify` tries a fast normalised numeric/fraction comparison first and
only calls the `math-verify` package (sympy-based, ~2 ms) when that is
inconclusive; without the package the fast comparison is the whole verifier.

Every verifier is a function of (task, extracted answer): `score` extracts
once and `score_answer` judges. A producer scores its own completions inline
(`score`); a receiver scores other peers' completions through a
`VerifierPool`: worker processes that each judge one batch at a time under a
time limit (a worker past its limit is killed and replaced), with a bounded
verdict cache per (task, answer), so hostile text can neither hang the node
nor hold its threads.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any, Final, NamedTuple

import psutil

from murmur.gossip.errors import MurmurError, TaskError
from murmur.gossip.validation import VerifierTimeout, VerifierUnavailable
from murmur.training.tasks import RG_PREFIX, WORKED_MARKER, WORKED_SEP, Task, rg_entry

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
    return (stripped[nl + 1 :] if nl >= 0 else stripped).strip()[:MAX_ANSWER_CHARS]


_STEP = re.compile(r"-?\d{1,12}\s*[-+*]\s*[a-z]?-?\d{1,12}\s*=\s*-?\d{1,12}")  # a term may carry its label
_FINAL = re.compile(re.escape(WORKED_MARKER) + r"\s*(-?\d{1,64})")


def worked_digest(completion: str) -> str:
    """What the `worked` verifier grades in a worked answer: "<steps>|<final>" when the completion is
    well-formed work (steps such as `4+b7=1` split by ";", then the marker and an integer, nothing else),
    else ""."""
    parts = [p.strip() for p in completion[:MAX_COMPLETION_CHARS].strip().split(WORKED_SEP)]
    final = _FINAL.fullmatch(parts[-1])
    if final is None or not all(_STEP.fullmatch(p) for p in parts[:-1]):
        return ""
    return f"{len(parts) - 1}|{int(final.group(1))}"


def answer_of(task: Task, completion: str) -> str:
    """The part of a completion that the task's verifier judges: a worked answer's digest
    (`worked_digest`), else the extracted answer."""
    return worked_digest(completion) if task.verifier == "worked" else extract_answer(completion)


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


def score_exact(task: Task, ans: str) -> float:
    return 1.0 if normalise(ans) == normalise(task.answer) else 0.0


def score_numeric(task: Task, ans: str) -> float:
    """Numeric match within `tolerance` (relative above 1, absolute below); exact when 0."""
    gold = parse_number(task.answer)
    if gold is None:
        return score_exact(task, ans)
    got = parse_number(ans)
    if got is None:
        got = _last_number(ans)
    return 1.0 if got is not None and _close(got, gold, task.tolerance) else 0.0


_mv_lock = threading.Lock()


def _math_verify_pkg(gold: str, answer: str) -> bool | None:
    try:
        from math_verify import parse, verify
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


_ASSIGN = re.compile(r"^[A-Za-z]\s*=\s*")
_ARITH = re.compile(r"[\d+\-*/(). ]+")
_ARITH_TOKEN = re.compile(r"\d+(?:\.\d+)?|[-+*/()]")
MAX_ARITH_CHARS: Final = 64


def arith_value(text: str) -> Fraction | None:
    """Exact value of a short expression of numbers, + - * / and parentheses (an optional
    "x =" and $...$ around it, \\cdot or \\times for *), else None. No powers, at most
    64 characters: the value and the work stay small whatever the input."""
    t = text.strip().strip("$").strip()
    t = _ASSIGN.sub("", t).replace("\\cdot", "*").replace("\\times", "*").replace("\\left", "").replace("\\right", "")
    if not t or len(t) > MAX_ARITH_CHARS or not _ARITH.fullmatch(t):
        return None
    tokens = _ARITH_TOKEN.findall(t)
    if "".join(tokens) != t.replace(" ", ""):
        return None
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def atom() -> Fraction:
        tok = take() if peek() is not None else ""
        if tok == "(":
            v = expr()
            if take() != ")":
                raise ValueError
            return v
        if tok in ("-", "+"):
            v = atom()
            return -v if tok == "-" else v
        return Fraction(tok)

    def term() -> Fraction:
        v = atom()
        while peek() in ("*", "/"):
            op, rhs = take(), atom()
            v = v * rhs if op == "*" else v / rhs
        return v

    def expr() -> Fraction:
        v = term()
        while peek() in ("+", "-"):
            op, rhs = take(), term()
            v = v + rhs if op == "+" else v - rhs
        return v

    try:
        value = expr()
    except (ValueError, ZeroDivisionError, IndexError, RecursionError):
        return None
    return value if pos == len(tokens) else None


def score_math_verify(task: Task, ans: str) -> float:
    gold = parse_number(task.answer)
    got = parse_number(ans)
    if got is None:  # "x = 12", "$2 \\cdot 6$", "24/2 + 0": settled exactly without sympy
        got = arith_value(ans)
    if gold is not None and got is not None:
        return 1.0 if _close(got, gold, task.tolerance) else 0.0
    if normalise(ans) == normalise(task.answer):
        return 1.0
    ok = _math_verify_pkg(f"${task.answer}$", f"${ans}$" if "$" not in ans else ans)
    if ok is None:
        return 0.0
    return 1.0 if ok else 0.0


def score_rg(task: Task, ans: str) -> float:
    """The reasoning-gym dataset's own scorer, on the regenerated entry."""
    import json

    if not task.generator.startswith("rg:"):
        raise TaskError(f"verifier 'rg_score' needs a reasoning-gym generator, not {task.generator!r}")
    from murmur.training.tasks import rg_dataset

    cfg = json.loads(task.config_json)
    name = task.generator[3:]
    ds = rg_dataset(name, cfg, task.seed)
    entry = rg_entry(name, cfg, task.seed)
    try:
        s = ds.score_answer(ans, entry)
    except Exception:
        return 0.0
    try:
        s = float(s)
    except (TypeError, ValueError):
        return 0.0
    return min(1.0, max(0.0, s)) if s == s else 0.0


def score_worked(task: Task, digest: str) -> float:
    """1 when the work has as many steps as the reference solution and the same final result; work of
    any other shape, or no marker, scores 0 (`worked_digest`)."""
    return 1.0 if digest and digest == worked_digest(task.answer) else 0.0


VERIFIERS: Final[dict[str, Callable[[Task, str], float]]] = {
    "exact": score_exact,
    "numeric": score_numeric,
    "math_verify": score_math_verify,
    "rg_score": score_rg,
    "worked": score_worked,
}


def check_verifier(name: str) -> None:
    if name not in VERIFIERS:
        raise TaskError(f"unknown verifier {name!r} (known: {', '.join(VERIFIERS)})")


def score_answer(task: Task, answer: str) -> float:
    """Reward in [0, 1] of an extracted `answer` for `task`, by the task's verifier."""
    fn = VERIFIERS.get(task.verifier)
    if fn is None:
        raise TaskError(f"unknown verifier {task.verifier!r} (known: {', '.join(VERIFIERS)})")
    return fn(task, answer)


def score(task: Task, completion_text: str) -> float:
    """Reward in [0, 1] of `completion_text` for `task`, by the task's verifier."""
    return score_answer(task, answer_of(task, completion_text))


# ------------------------------------------------------------ bounded pool

TIME_LIMIT_S: Final = 2.0  # verifier CPU seconds per batch (up to 64 completions) in one pool worker
WALL_FACTOR: Final = 15.0  # past this multiple in wall time the machine, not the input, is the problem
POLL_S: Final = 0.02
MEMORY_HEADROOM_MB: Final = 512  # address space a worker may grow by after its imports: a batch past it fails
START_LIMIT_S: Final = 60.0  # a worker's start, and each import of a verifier family (reasoning-gym is slow)
VERDICT_CACHE: Final = 8192  # (task, extracted answer) -> reward, per worker: the groups of recent batches


class VerifierError(MurmurError):
    """A verifier raised or its worker died on this input."""


class Verdicts:
    """Bounded (task, extracted answer) -> reward cache: a verdict depends on nothing else."""

    def __init__(self, entries: int = VERDICT_CACHE) -> None:
        self.entries = entries
        self._d: OrderedDict[tuple[Task, str], float] = OrderedDict()

    def score(self, task: Task, completion: str) -> float:
        key = (task, answer_of(task, completion))
        hit = self._d.get(key)
        if hit is not None:
            self._d.move_to_end(key)
            return hit
        value = score_answer(task, key[1])
        self._d[key] = value
        if len(self._d) > self.entries:
            self._d.popitem(last=False)
        return value


WARM_MATH: Final = "math_verify"  # the math-verify package (sympy)
WARM_RG: Final = "reasoning_gym"
WARM_ALL: Final = frozenset({WARM_MATH, WARM_RG})


def warm_needs(tasks: Iterable[Task]) -> frozenset[str]:
    """The slow imports judging `tasks` needs: the exact and numeric verifiers need none."""
    out: set[str] = set()
    for t in tasks:
        if t.verifier == "math_verify":
            out.add(WARM_MATH)
        if t.verifier == "rg_score" or t.generator.startswith(RG_PREFIX):
            out.add(WARM_RG)
    return frozenset(out)


def _warm_up(families: frozenset[str]) -> None:
    """Import what `families` need and make their first calls. Runs in a pool worker as a call of its
    own, before the first batch that needs them, so it never counts against an honest batch's time
    limit; a node whose task sets use only the exact and numeric verifiers never imports sympy or
    reasoning-gym (docs/gossip.md says what that saves)."""
    import resource

    from murmur.training.tasks import _rg_module

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))  # the budget is headroom over the imports
    if WARM_MATH in families:
        _math_verify_pkg("$1$", "$x+1$")
    if WARM_RG in families:
        try:
            _rg_module()
        except Exception:  # reasoning-gym missing: rg tasks fail to resolve before they reach a verifier
            pass
    _limit_memory(MEMORY_HEADROOM_MB)


def _limit_memory(headroom_mb: int) -> None:
    """Cap this process's address space at what its imports use plus `headroom_mb`: a completion that
    makes a verifier build a huge object (sympy expanding a power tower) then fails with MemoryError,
    a named rejection, instead of swapping the volunteer's machine."""
    import resource

    limit = psutil.Process().memory_info().vms + headroom_mb * 2**20
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


class _Call(NamedTuple):
    """Work other than judging that runs under the same limits: task generation from a network-supplied
    configuration (`VerifierPool.call`)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _pool_worker(conn: Any, entries: int) -> None:
    """One pool process: judge batches (or run calls) until the pipe closes. Replies (ok, result | error, cpu_s)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    verdicts = Verdicts(entries)
    _limit_memory(MEMORY_HEADROOM_MB)
    conn.send(("ready", None, 0.0))
    while True:
        t0 = time.process_time()  # waiting costs no CPU; unpickling the batch does, and counts
        try:
            items = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if isinstance(items, _Call):
                out: Any = items.fn(*items.args, **items.kwargs)
            else:
                out = [verdicts.score(task, text) for task, text in items]
            ok = True
        except TaskError as e:
            out, ok = ("task", str(e)), False
        except Exception as e:  # hostile input we did not foresee: a named rejection upstream
            out, ok = ("error", f"{type(e).__name__}: {str(e)[:200]}"), False
        conn.send((ok, out, time.process_time() - t0))


class _Worker:
    def __init__(self, ctx: Any, entries: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_pool_worker, args=(child, entries), daemon=True, name="murmur-verifier")
        self.proc.start()
        child.close()
        if not self.conn.poll(START_LIMIT_S):
            self.kill()
            raise VerifierUnavailable("verifier worker did not start")
        self.conn.recv()
        self._ps = psutil.Process(self.proc.pid)
        self.warmed: frozenset[str] = frozenset()

    def cpu(self) -> float:
        """CPU seconds the worker process has used."""
        try:
            t = self._ps.cpu_times()
        except psutil.Error:  # gone: the pipe says so next
            return 0.0
        return t.user + t.system

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(5)
        finally:
            self.conn.close()


class VerifierPool:
    """`workers` processes, each judging one batch at a time under `time_limit_s`.

    `score_batch` blocks its calling thread until a worker is free (the caller bounds how
    many threads wait: gossip.service uses its own limiter). A batch whose judging uses more
    than `time_limit_s` of the worker's CPU kills that worker (replaced at the next call) and
    raises VerifierTimeout; one still unjudged after `wall_factor` times the limit in wall time
    raises VerifierUnavailable (this machine, not the input, is slow); a worker's exception is
    a VerifierError (TaskError for a task the verifier refuses). `cpu_s` sums the workers' CPU
    time (benchmarks count it)."""

    def __init__(
        self,
        workers: int = 1,
        time_limit_s: float = TIME_LIMIT_S,
        cache_entries: int = VERDICT_CACHE,
        wall_factor: float = WALL_FACTOR,
    ) -> None:
        if workers < 1 or not time_limit_s > 0:
            raise ValueError("a verifier pool needs workers >= 1 and time_limit_s > 0")
        self.workers = workers
        self.time_limit_s = time_limit_s
        self.wall_factor = wall_factor
        self.cache_entries = cache_entries
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a threaded (trio) parent
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.cpu_s = 0.0
        self._mine = threading.local()  # per calling thread: the CPU its calls used (`thread_cpu_s`)
        self.timeouts = 0
        self.started = 0

    def score_batch(self, items: list[tuple[Task, str]]) -> list[float]:
        return self._run(items, self.time_limit_s, warm_needs(t for t, _ in items))

    def call(self, fn: Callable[..., Any], *args: Any, cpu_s: float | None = None, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a pool worker, under the pool's memory budget and `cpu_s` of its CPU
        (default the per-batch limit): for work an input from the network sizes, such as generating
        tasks from a task set's configuration. `fn` must be a module-level function (it is pickled by name)."""
        return self._run(_Call(fn, args, kwargs), cpu_s or self.time_limit_s, WARM_ALL)

    def _run(self, payload: Any, limit_s: float, needs: frozenset[str]) -> Any:
        with self._slots:
            w = self._take()
            if not self._warm(w, needs):
                w.kill()
                raise VerifierUnavailable("a verifier worker could not import its verifiers")
            live = True  # false once killed: only a live worker goes back to the pool
            try:
                w.conn.send(payload)
                late = self._wait(w, limit_s)
                if late is not None:
                    if isinstance(late, VerifierTimeout):  # it spent the whole limit on this call
                        self._mine.cpu = self.thread_cpu_s() + limit_s
                    w.kill()
                    live = False
                    raise late
                ok, out, cpu = w.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as e:
                if live:
                    w.kill()
                live = False
                raise VerifierError(f"verifier worker died: {type(e).__name__}") from None
            finally:
                if live:
                    self._give(w)
            with self._lock:
                self.cpu_s += cpu
            self._mine.cpu = self.thread_cpu_s() + cpu
        if not ok:
            kind, msg = out
            raise (TaskError if kind == "task" else VerifierError)(msg)
        return out

    def _warm(self, w: _Worker, needs: frozenset[str]) -> bool:
        """Make `w` import what the next payload needs, as a call of its own that nobody is charged for
        (like the worker's start). False: it could not (our failure, never the sender's)."""
        missing = needs - w.warmed
        if not missing:
            return True
        try:
            w.conn.send(_Call(_warm_up, (missing,), {}))
            if self._wait(w, START_LIMIT_S) is not None:
                return False
            ok, _, _ = w.conn.recv()
        except (EOFError, OSError):
            return False
        if ok:
            w.warmed |= missing
        return bool(ok)

    def thread_cpu_s(self) -> float:
        """CPU-seconds the verifier workers spent on this thread's calls so far (what the gossip
        layer charges to the sender's verification budget)."""
        return float(getattr(self._mine, "cpu", 0.0))

    def _wait(self, w: _Worker, limit_s: float) -> MurmurError | None:
        """Wait for the reply. The limit is on the worker's CPU time, so an input that makes the
        verifier work is stopped, while a machine too busy to run the worker costs the sender
        nothing (VerifierUnavailable once the wall-clock backstop passes)."""
        used0 = w.cpu()
        backstop = time.monotonic() + self.wall_factor * limit_s
        while not w.conn.poll(POLL_S):
            if w.cpu() - used0 > limit_s:
                with self._lock:
                    self.timeouts += 1
                return VerifierTimeout(f"not done within {limit_s} s of verifier CPU")
            if time.monotonic() > backstop:
                return VerifierUnavailable(
                    f"verifier worker not done after {self.wall_factor * limit_s:.0f} s (this machine is overloaded)"
                )
        return None

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise VerifierUnavailable("verifier pool is closed")
            if self._idle:
                return self._idle.pop()
        w = _Worker(self._ctx, self.cache_entries)
        with self._lock:
            self.started += 1
        return w

    def _give(self, w: _Worker) -> None:
        with self._lock:
            if self._closed:
                w.kill()
            else:
                self._idle.append(w)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
