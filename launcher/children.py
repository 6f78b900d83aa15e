"""Child processes of the launcher: each in its own process group, logged to a file, stopped by group id.

Every child the launcher starts (store nodes, trainer, rollout worker) runs with :func:`child_env`
(one thread per process, offline, the project on the path) in a new session, so a signal to the
driver does not reach it and :meth:`Children.stop` can stop it and everything it spawned (the
trainer's ranks) by its process group id, never by name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO

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
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


class Children:
    """Starts subprocesses in their own process groups and stops every one of them, by group id.

    Example:
        >>> with Children(Path("/tmp/logs")) as kids:  # doctest: +SKIP
        ...     kids.start("trainer", [sys.executable, "-m", "train", "--config", "train.json"])
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Child] = []

    def start(self, name: str, cmd: list[str]) -> Child:
        """Start ``cmd`` with its output in ``<log_dir>/<name>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{name}.log"
        fh = path.open("wb")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        child = Child(name=name, proc=proc, log_path=path, log_file=fh)
        self.started.append(child)
        doc = [{"name": c.name, "pid": c.pid, "cmd": c.proc.args} for c in self.started]
        (self.log_dir / "children.json").write_text(json.dumps(doc, indent=1, default=str))
        log.info("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
        return child

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
        return child.proc.returncode

    def stop_all(self) -> None:
        """Stop every child, the last started first."""
        for child in reversed(self.started):
            self.stop(child)

    def tail(self, child: Child, lines: int = 30) -> str:
        """The last lines of a child's log."""
        child.log_file.flush()
        text = child.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
