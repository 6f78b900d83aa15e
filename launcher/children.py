"""Child processes of the launcher: each in its own process group, logged to a file, stopped by group id.

Every child the launcher starts (store nodes, trainer, rollout worker) runs with :func:`child_env`
(one thread per process, offline, the project on the path) in a new session, so a signal to the
driver does not reach it and :meth:`Children.stop` can stop it and everything it spawned (the
trainer's ranks) by its process group id, never by name. :meth:`Children.restart` starts a child
that exited again, under the same name with the same command, its log continued; ``children.json``
in the log folder always names each child's current pid, its start time and how often it was restarted,
and ``launcher.json`` the launcher's own pid and start time.

No child outlives the launcher (``launcher.lifeline``): each gets the parent-death signal (SIGKILL when
the launcher dies, however it dies) and a keeper process kills the children's process groups (their own
children) when the launcher dies without stopping them. A new :class:`Children` in a log folder an
earlier launcher used stops what that one left running (by the pids and start times it recorded), and
refuses to start while that launcher still runs or while an unrecorded process runs from the run
folder's config documents.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from launcher import lifeline

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
"""The project's folder (children run here, with it on ``PYTHONPATH``)."""
CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONWARNINGS": "ignore",
}
"""Environment every child gets on top of the driver's."""


def child_env() -> dict[str, str]:
    """Environment of every child: one thread each, offline, the project on the path."""
    env = dict(os.environ, **CHILD_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    return env


@dataclass(slots=True)
class Child:
    """A started subprocess (leader of its own process group) and its log file."""

    name: str
    cmd: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    restarts: int = 0
    """How often this child was started again after it exited (:meth:`Children.restart`)."""
    start_time: int | None = None
    """When its process started (``lifeline.start_time``: with the pid, what identifies it later)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment it got on top of :func:`child_env` (kept for a restart)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


class Children:
    """Starts subprocesses in their own process groups and stops every one of them, by group id.

    Raises (when made): ``lifeline.RunFolderInUseError`` (the launcher that used ``log_dir`` still runs) or
    ``lifeline.LeftoverProcessesError`` (processes of the run folder that cannot be stopped here, named).

    Example::

        with Children(Path("/tmp/logs")) as kids:
            kids.start("trainer", [sys.executable, "-m", "train", "--config", "train.json"])
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Child] = []
        self.leftovers = lifeline.stop_leftovers(log_dir, log_dir.parent)
        """What an earlier launcher of this log folder had left running, stopped here (see the module docstring)."""
        self._keeper: lifeline.Keeper | None = None

    def start(self, name: str, cmd: list[str], *, env: Mapping[str, str] | None = None, append: bool = False) -> Child:
        """Start ``cmd``, its output in ``<log_dir>/<name>.log`` (``append``: after what an earlier process of that
        name wrote there); ``env``: variables on top of :func:`child_env`."""
        child = self._spawn(name, cmd, restarts=0, env=dict(env or {}), append=append)
        self.started.append(child)
        self._write_index()
        return child

    def restart(self, child: Child) -> Child:
        """Start the command of ``child`` (which has exited) again under its name; returns the new child.

        Its output is appended to the same log; :attr:`started` and ``children.json`` name the new process.

        Raises:
            ValueError: ``child`` is still running, or was not started here.
        """
        if child.alive() or child not in self.started:
            msg = f"cannot restart {child.name} (pid {child.pid}): it is still running or was not started here"
            raise ValueError(msg)
        child.log_file.close()
        self._forget(child)
        new = self._spawn(child.name, child.cmd, restarts=child.restarts + 1, env=child.env)
        self.started[self.started.index(child)] = new
        self._write_index()
        return new

    def _spawn(self, name: str, cmd: list[str], *, restarts: int, env: dict[str, str], append: bool = False) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{name}.log"
        fh = path.open("ab" if restarts or append else "wb")
        if restarts or append:
            fh.write(f"---- {time.strftime('%H:%M:%S')} {f'restart {restarts}' if restarts else 'new start'} of "
                     f"{name} ----\n".encode())
            fh.flush()
        if self._keeper is None:
            self._keeper = lifeline.Keeper(env=child_env(), cwd=ROOT)
            me = {"pid": os.getpid(), "start_time": lifeline.start_time(os.getpid()), "keeper": self._keeper.pid}
            (self.log_dir / "launcher.json").write_text(json.dumps(me))
        proc = lifeline.popen(cmd, cwd=ROOT, env=child_env() | env, stdout=fh, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
        self._keeper.watch(proc.pid)
        log.info("started %s (pid %d, restart %d): %s", name, proc.pid, restarts, " ".join(cmd))
        return Child(name=name, cmd=list(cmd), proc=proc, log_path=path, log_file=fh, restarts=restarts, env=env,
                     start_time=lifeline.start_time(proc.pid))

    def _forget(self, child: Child) -> None:
        if self._keeper is not None:
            self._keeper.forget(child.pid)

    def _write_index(self) -> None:
        doc = [{"name": c.name, "pid": c.pid, "cmd": c.cmd, "restarts": c.restarts, "start_time": c.start_time}
               for c in self.started]
        (self.log_dir / "children.json").write_text(json.dumps(doc, indent=1))

    @staticmethod
    def _signal(child: Child, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, sig)  # the group this driver created for the child (pgid == its pid)

    def stop(self, child: Child, *, grace_s: float = 15.0) -> int | None:
        """SIGTERM the child's process group, wait ``grace_s``, then SIGKILL what is left; returns the exit code."""
        if child.alive():
            self._signal(child, signal.SIGTERM)
            try:
                child.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop in %.0f s: killing its process group", child.name, child.pid,
                            grace_s)
        self._signal(child, signal.SIGKILL)  # stragglers of the group (e.g. spawned trainer ranks)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=10)
        child.log_file.close()
        self._forget(child)
        return child.proc.returncode

    def stop_all(self) -> None:
        """Stop every child, the last started first; then let the keeper go."""
        for child in reversed(self.started):
            self.stop(child)
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None

    def tail(self, child: Child, lines: int = 30) -> str:
        """The last lines of a child's log."""
        child.log_file.flush()
        text = child.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
