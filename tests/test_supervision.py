"""Worker supervision (`node.core.supervision`) on its own: the restart backoff and its reset, one restart per
exit, the worker's state, error and engine as the status shows them."""

from __future__ import annotations

from murmur.node import pipe
from murmur.node.core.events import Log, RestartWorker
from murmur.node.core.supervision import RESTART_BACKOFF_S, WORKER_STABLE_S, WorkerSupervisor
from murmur.node.pipe import WorkerState


def delays(out: list) -> list[float]:
    return [a.delay_s for a in out if isinstance(a, RestartWorker)]


def test_exits_in_a_row_restart_after_the_documented_backoff_which_then_stays_at_its_last_step() -> None:
    sup = WorkerSupervisor(0.0)
    got, now = [], 0.0
    for _ in range(len(RESTART_BACKOFF_S) + 2):
        out: list = []
        assert sup.on_exit(1, now, out)
        got += delays(out)
        now += 1.0
        sup.on_started(now)
    assert RESTART_BACKOFF_S == (1.0, 2.0, 5.0, 15.0, 30.0, 60.0)
    assert got == [1.0, 2.0, 5.0, 15.0, 30.0, 60.0, 60.0, 60.0]
    assert sup.restarts == 8


def test_a_worker_that_ran_stable_resets_the_backoff_and_one_just_short_of_it_does_not() -> None:
    sup = WorkerSupervisor(0.0)
    sup.on_exit(1, 0.0, [])
    sup.on_started(10.0)
    out: list = []
    sup.on_exit(1, 10.0 + WORKER_STABLE_S - 0.5, out)
    assert delays(out) == [RESTART_BACKOFF_S[1]]
    sup.on_started(200.0)
    out = []
    sup.on_exit(1, 200.0 + WORKER_STABLE_S, out)
    assert delays(out) == [RESTART_BACKOFF_S[0]]
    assert sup.restarts == 3  # a reset backoff does not reset the count


def test_an_exit_while_a_restart_is_due_is_the_same_exit() -> None:
    sup = WorkerSupervisor(0.0)
    out: list = []
    assert sup.on_exit(1, 1.0, out) and sup.state is WorkerState.RESTARTING
    again: list = []
    assert not sup.on_exit(1, 1.5, again)
    assert again == [] and sup.restarts == 1
    sup.on_started(2.0)
    assert sup.state is WorkerState.STARTING and sup.started == 2.0
    assert delays(out) == [1.0] and out[0] == Log(
        "worker exited", {"code": 1, "error": "worker exited with code 1", "restart_in_s": 1.0, "restarts": 1}
    )


def test_the_exit_code_is_the_error_only_when_the_worker_said_nothing_and_the_code_is_a_failure() -> None:
    sup = WorkerSupervisor(0.0)
    sup.on_exit(0, 1.0, [])
    sup.on_started(2.0)
    sup.on_exit(None, 3.0, [])
    assert sup.error == ""  # a clean exit, or one with no code, is no error
    sup.on_started(4.0)
    out: list = []
    sup.on_error("x" * 5000, out)
    assert sup.error == "x" * 4000 and out == [Log("worker failed", {"error": "x" * 300})]
    sup.on_exit(3, 5.0, [])
    assert sup.error == "x" * 4000  # what the worker said is kept over the exit code
    fresh = WorkerSupervisor(0.0)
    fresh.on_exit(-9, 1.0, [])
    assert fresh.error == "worker exited with code -9"


def test_the_worker_is_down_until_ready_or_at_work() -> None:
    sup = WorkerSupervisor(0.0)
    assert sup.state is WorkerState.STARTING and sup.down
    out: list = []
    sup.on_state(WorkerState.LOADING, out)
    assert sup.down and out == [Log("worker state", {"state": "loading"})]
    sup.on_ready()
    assert sup.state is WorkerState.READY and not sup.down
    for state in (WorkerState.TRAINING, WorkerState.GENERATING, WorkerState.STANDBY, WorkerState.CATCHING_UP):
        sup.on_state(state, [])
        assert not sup.down, state
    for state in (WorkerState.WAITING_FOR_TASKS, WorkerState.STOPPED):
        sup.on_state(state, [])
        assert sup.down, state


def test_the_engine_is_the_mode_the_worker_runs_or_why_the_asked_one_is_unavailable() -> None:
    sup = WorkerSupervisor(0.0)
    out: list = []
    sup.on_engine(pipe.Engine(requested="vllm", mode="", error="no GPU"), out)
    assert sup.engine == "vllm unavailable: no GPU" and out == [Log("worker engine", {"engine": sup.engine})]
    sup.on_engine(pipe.Engine(requested="vllm", mode="transformers", error=""), [])
    assert sup.engine == "transformers"
