"""Nothing a launcher starts outlives it: the parent-death signal, a keeper process, and a run folder's leftovers.

A launcher killed without its cleanup (SIGKILL, the OOM killer) leaves its children running, holding their
ports and spill directories. Three layers end them, each for what the one before cannot reach:

* :func:`die_with_parent`: a ``preexec_fn`` that asks the kernel (``prctl(PR_SET_PDEATHSIG)``) to SIGKILL the
  child when the thread that started it ends (:func:`popen` starts children on a thread that lives as long as
  the process). It survives ``exec``, so a child started through a
  prefix that execs (``ip netns exec`` on a namespace host) is covered too. Linux only (elsewhere: none).
* :class:`Keeper`: one small process per launcher (``python -m launcher.lifeline``) that reads a pipe only
  the launcher writes. The launcher tells it each child's process group as it starts and forgets it as it
  stops; when the pipe closes without a goodbye (the launcher died, however), the keeper SIGKILLs every
  group it still knows: the children's own children (trainer ranks, an engine's workers), which the
  parent-death signal of their group leader does not reach.
* :func:`leftovers`: a new launcher in the same run folder finds the processes an older one left (the
  ``children.json`` it wrote, checked by start time, or by command line where an older launcher recorded
  none) and the processes that name the run folder on their command line; :func:`stop_leftovers` stops the
  recorded ones by their pid and refuses the rest.

Processes are always signalled by pid or process-group id, never by name, and only once their identity is
checked (a pid the kernel gave to another process since is left alone).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal a process gets when its parent (the thread that forked it) ends."""
BYE = b"bye\n"
"""What the launcher writes before it closes the keeper's pipe on a clean stop."""


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # loaded once here: a preexec_fn should do as little as it can


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` under which the child gets ``sig`` once this process's calling thread ends (``None``
    where the kernel offers no parent-death signal).

    Start children from a thread that lives as long as the launcher (its main thread): the kernel sends
    the signal when the *thread* that forked the child ends. A launcher that died between the fork and
    the ``prctl`` is noticed too (the child's parent is then another process) and the child ends at once.
    """
    if _PRCTL is None:
        return None
    prctl, parent = _PRCTL, os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 or os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


class _Spawner:
    """One daemon thread per process that forks every child :func:`popen` starts: the parent-death signal follows
    the thread that forked, and this one ends only with the process (a child a short-lived thread started, a
    restart from a supervising thread say, would otherwise be killed when that thread ends)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def run(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="knit-spawner")
            pool = self._pool
        return pool.submit(fn).result()


_SPAWNER = _Spawner()


def popen(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **kwargs)`` under :func:`die_with_parent` (unless ``kwargs`` names another
    ``preexec_fn``), forked on the process's spawner thread so that only the process's death sends the signal."""
    kwargs.setdefault("preexec_fn", die_with_parent())
    return _SPAWNER.run(lambda: subprocess.Popen(cmd, **kwargs))


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``), ``None`` if it is gone or a
    zombie: with the pid, what tells this process from a later one the kernel gave the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return None if fields[0] == "Z" else int(fields[19])


def cmdline(pid: int) -> list[str] | None:
    """The command line of process ``pid`` (``None`` if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def processes_naming(text: str) -> list[int]:
    """Pids of the live processes (zombies and this one apart) with ``text`` in their command line: what a run
    folder's name finds of its processes."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        cmd = cmdline(pid)
        if cmd is not None and any(text in a for a in cmd) and start_time(pid) is not None:
            pids.append(pid)
    return pids


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# ---- the keeper ------------------------------------------------------------------------------------


class Keeper:
    """The launcher's side of the keeper: a process that SIGKILLs the children's process groups if the launcher
    dies before it says goodbye (:meth:`close`).

    Example::

        keeper = Keeper()
        keeper.watch(child.pid)  # its process group, which it leads
        keeper.forget(child.pid)  # stopped by the launcher
        keeper.close()
    """

    def __init__(self, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        read, self._write = os.pipe()  # the write end is not inheritable: only this process holds it
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "launcher.lifeline"], stdin=read, env=env, cwd=cwd,
                                         stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read)
        self.pid = self.proc.pid

    def _send(self, line: bytes) -> None:
        try:
            os.write(self._write, line)
        except OSError as exc:  # the keeper died (killed): the parent-death signals still hold
            log.warning("the keeper process (pid %d) is gone: %s", self.pid, exc)

    def watch(self, pgid: int) -> None:
        """Kill process group ``pgid`` (led by a child started with ``start_new_session``) if the launcher dies."""
        self._send(f"+{pgid} {start_time(pgid) or 0}\n".encode())

    def forget(self, pgid: int) -> None:
        """The group was stopped: leave it alone (its pid may be given to another process later)."""
        self._send(f"-{pgid}\n".encode())

    def close(self) -> None:
        """Say goodbye and let the keeper exit without killing anything (idempotent)."""
        if self._write < 0:
            return
        self._send(BYE)
        os.close(self._write)
        self._write = -1
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def keep(stream: Any) -> int:
    """The keeper's loop (``python -m launcher.lifeline``): follow ``+pgid start`` / ``-pgid`` lines on
    ``stream`` until ``bye`` (returns 0) or the end of the stream, then SIGKILL every group still followed
    (returns how many)."""
    groups: dict[int, int] = {}
    for raw in stream:
        line = raw.strip()
        if line == BYE.strip():
            return 0
        if line.startswith(b"+"):
            pgid, started = (int(x) for x in line[1:].split())
            groups[pgid] = started
        elif line.startswith(b"-"):
            groups.pop(int(line[1:]), None)
    killed = 0
    for pgid, started in groups.items():
        now = start_time(pgid)
        if now is not None and started and now != started:
            continue  # the leader's pid belongs to another process now: its old group had ended
        _kill_group(pgid, signal.SIGKILL)  # the leader, or what is left of its group
        killed += 1
    return killed


# ---- leftovers of an earlier launcher in the same run folder -------------------------------------


class RunFolderInUseError(RuntimeError):
    """Another launcher, still running, uses this run folder; names its pid."""


class LeftoverProcessesError(RuntimeError):
    """Processes of an earlier launcher in this run folder run on and could not be stopped, or are not recorded
    as its children (so they are not stopped here); names each (pid and command line)."""


@dataclass(frozen=True, slots=True)
class Leftover:
    """A process an earlier launcher of the run folder left running."""

    name: str
    """The child's name in ``children.json`` (``store0``), or ``unrecorded``."""
    pid: int
    cmd: list[str]

    def __str__(self) -> str:
        return f"{self.name} (pid {self.pid}: {' '.join(self.cmd)})"


def _recorded(entry: dict[str, Any]) -> bool:
    """Whether ``entry`` of ``children.json`` describes the process that runs under its pid now."""
    pid = int(entry["pid"])
    if entry.get("start_time"):
        return start_time(pid) == int(entry["start_time"])
    return start_time(pid) is not None and cmdline(pid) == list(entry.get("cmd", []))  # an older launcher's index


def leftovers(log_dir: Path, run_dir: Path) -> tuple[list[Leftover], list[Leftover]]:
    """The processes an earlier launcher left: those its ``log_dir/children.json`` records (identity checked; the
    launcher itself is in ``log_dir/launcher.json``),
    and the other live processes started with ``--config`` and a document of ``run_dir/configs`` (as every
    child of a launcher is; not this process or its parents).

    Raises:
        RunFolderInUseError: the launcher that wrote the index still runs.
    """
    index, launcher = log_dir / "children.json", log_dir / "launcher.json"
    entries = json.loads(index.read_text()) if index.exists() else []
    owner = json.loads(launcher.read_text()) if launcher.exists() else None  # an older launcher wrote none
    if owner and owner["pid"] != os.getpid() and start_time(int(owner["pid"])) == owner["start_time"]:
        msg = f"the run folder {run_dir} is in use by a running launcher (pid {owner['pid']}); stop it first"
        raise RunFolderInUseError(msg)
    recorded = [Leftover(e["name"], int(e["pid"]), list(e.get("cmd", []))) for e in entries if _recorded(e)]
    skip = _ancestors() | {x.pid for x in recorded}
    configs = run_dir.resolve() / "configs"
    unrecorded = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        pid = int(entry.name)
        cmd = cmdline(pid) or []
        if any(doc.parent == configs for doc in _config_docs(pid, cmd)) and start_time(pid) is not None:
            unrecorded.append(Leftover("unrecorded", pid, cmd))
    return recorded, unrecorded


def _config_docs(pid: int, cmd: list[str]) -> list[Path]:
    """The documents process ``pid`` was given with ``--config`` (a relative one from its working directory)."""
    docs = [Path(b) for a, b in itertools.pairwise(cmd) if a == "--config"]
    if not docs or all(d.is_absolute() for d in docs):
        return docs
    try:
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return [d for d in docs if d.is_absolute()]
    return [(cwd / d).resolve() for d in docs]


def _ancestors() -> set[int]:
    """This process and its parents up to init (a test or a shell that names the run folder is not a leftover)."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return out


def stop_leftovers(log_dir: Path, run_dir: Path, *, grace_s: float = 5.0) -> list[Leftover]:
    """Stop the processes an earlier launcher of ``run_dir`` recorded and left running (SIGTERM to each one's
    process group, SIGKILL after ``grace_s``); returns them.

    Raises:
        RunFolderInUseError: that launcher still runs.
        LeftoverProcessesError: one of them is still running after SIGKILL, or a process it did not record
            names the run folder (both named; nothing unrecorded is signalled).
    """
    recorded, unrecorded = leftovers(log_dir, run_dir)
    if recorded:
        log.warning("stopping what an earlier launcher of %s left running: %s", run_dir,
                    ", ".join(map(str, recorded)))
    started = {x.pid: start_time(x.pid) for x in recorded}

    def running() -> list[Leftover]:
        return [x for x in recorded if started[x.pid] is not None and start_time(x.pid) == started[x.pid]]

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for x in running():
            _kill_group(x.pid, sig)  # it leads its group (started in a session of its own)
        deadline = time.monotonic() + wait_s
        while running() and time.monotonic() < deadline:
            time.sleep(0.05)
    stuck = running()
    if stuck or unrecorded:
        msg = (f"processes of an earlier run in {run_dir} still run: {', '.join(map(str, stuck + unrecorded))}; "
               "stop them (they hold the run's ports and spill directories) and start again")
        raise LeftoverProcessesError(msg)
    return recorded


if __name__ == "__main__":
    killed = keep(sys.stdin.buffer)
    if killed:
        print(f"launcher.lifeline: the launcher died; killed {killed} process group(s)", file=sys.stderr)
