"""Worker supervision (sans-IO, part of `node.core.machine`): the worker process's state as the network process
knows it, its last error and engine, and when to restart it.

The runtime starts a worker (`WorkerStarted`); the worker reports its state (`node.pipe.State`), that it is
ready, its engine and its errors. When it exits, it is restarted (`RestartWorker`) after a backoff that
grows with each exit in a row (`RESTART_BACKOFF_S`) and starts over once a worker ran for
`WORKER_STABLE_S`; an exit while a restart is already due is the same exit, not another (one restart each).
A restart the core asks for itself (its roles changed: `restart_for`) is not an exit and costs no backoff.
"""

from __future__ import annotations

from murmur.node import pipe
from murmur.node.core.events import Action, Log, RestartWorker
from murmur.node.pipe import WorkerState

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 15.0, 30.0, 60.0)
WORKER_STABLE_S = 120.0  # a worker that ran this long resets the restart backoff
# the states in which the worker cannot apply anything (so this node, not a publisher, is why nothing moves)
WORKER_DOWN = frozenset(
    {
        WorkerState.STARTING,
        WorkerState.RESTARTING,
        WorkerState.LOADING,
        WorkerState.WAITING_FOR_TASKS,
        WorkerState.STOPPED,
    }
)


class WorkerSupervisor:
    def __init__(self, now: float) -> None:
        self.state = WorkerState.STARTING
        self.error = ""
        self.engine = ""  # what the worker runs (pipe.Engine): a MODE_*, or "<asked> unavailable: <why>"
        self.started = now
        self.in_row = 0  # exits since the last stable run
        self.restarts = 0
        self.replacing = False  # a restart the core asked for is under way: the old worker's last words are not news

    @property
    def down(self) -> bool:
        return self.state in WORKER_DOWN

    def on_started(self, now: float) -> None:
        self.started = now
        self.state = WorkerState.STARTING
        self.replacing = False

    def on_exit(self, code: int | None, now: float, out: list[Action]) -> bool:
        """The worker process exited: whether a restart was scheduled (False: one is already due)."""
        if self.state is WorkerState.RESTARTING:
            return False
        if now - self.started >= WORKER_STABLE_S:
            self.in_row = 0
        delay = RESTART_BACKOFF_S[min(self.in_row, len(RESTART_BACKOFF_S) - 1)]
        self.in_row += 1
        self.restarts += 1
        if code not in (0, None) and not self.error:
            self.error = f"worker exited with code {code}"
        self.state = WorkerState.RESTARTING
        out.append(
            Log(
                "worker exited",
                {"code": code, "error": self.error[:300], "restart_in_s": delay, "restarts": self.restarts},
            )
        )
        out.append(RestartWorker(delay))
        return True

    def restart_for(self, now: float, out: list[Action]) -> None:
        """The core restarts the worker on purpose (its roles changed): until the new worker starts, the old
        one's exit is this restart, not a failure (it schedules no other and leaves the backoff as it was), and
        what it still reports while it finishes its step (its state) does not undo that."""
        self.replacing = True
        self.state = WorkerState.RESTARTING
        self.error = ""
        out.append(Log("worker restarting", {"why": "roles changed"}))

    def on_state(self, state: WorkerState, out: list[Action]) -> None:
        if self.replacing:
            return
        self.state = state
        out.append(Log("worker state", {"state": state.value}))

    def on_ready(self) -> None:
        self.state = WorkerState.READY

    def on_engine(self, m: pipe.Engine, out: list[Action]) -> None:
        self.engine = m.mode or f"{m.requested} unavailable: {m.error}"
        out.append(Log("worker engine", {"engine": self.engine}))

    def on_error(self, message: str, out: list[Action]) -> None:
        """The worker's last error, kept for the status."""
        self.error = message[:4000]
        out.append(Log("worker failed", {"error": self.error[:300]}))
