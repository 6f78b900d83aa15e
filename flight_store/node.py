"""Run one store node: in this process until SIGINT/SIGTERM (:func:`serve`), or as a child (:class:`NodeProcess`).

``python -m flight_store --config node.json`` (see ``flight_store/__main__.py``) and ``knit serve``
both end here. The node owns its process, so its store also holds the process's resident memory
to the budget (``StoreConfig.rss_guard`` is turned on). What it prints on stdout is read by
whoever started it (tests, ``knit run``), one line each:

* ``knit serve: listening on <location>`` once it serves (signal handlers are installed first,
  so whoever reads the line may stop it at once and get a clean stop);
* ``knit serve: metrics on http://<host>:<port>/metrics`` with metrics;
* ``knit serve: stopped`` after a clean stop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TypeVar, cast

from flight_store.config import ServerConfig
from flight_store.server import StoreServer
from flight_store.spill import SpillCorruptionError
from schemas import documents

T = TypeVar("T")


def serve(config: ServerConfig) -> int:
    """Run one store node as ``config`` says until SIGINT/SIGTERM; returns the exit code (0).

    Must run in the main thread (it installs signal handlers). Logging goes to stderr at
    ``config.log_level``, unless logging was configured before.
    """
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    owned = dataclasses.replace(config, store=dataclasses.replace(config.store, rss_guard=True))
    try:
        server = StoreServer(owned)
    except (SpillCorruptionError, PermissionError, OSError, ValueError) as exc:
        print(f"knit serve: cannot start: {exc}", file=sys.stderr, flush=True)
        return 2
    lines = [f"listening on {server.location}"]
    if server.metrics_port is not None:
        lines.append(f"metrics on http://{config.advertised_host}:{server.metrics_port}/metrics")
    clean = serve_until_signalled("serve", lines, server.shutdown)
    if not clean:  # a stalled writer's gRPC thread would keep the process alive: the log is fsynced, leave now
        logging.shutdown()
        os._exit(0)
    return 0


def serve_until_signalled(name: str, lines: Sequence[str], shutdown: Callable[[], T]) -> T:
    """Print ``lines`` as ``knit NAME: LINE``, wait for SIGINT or SIGTERM, then ``shutdown()`` and say
    ``stopped``; returns what ``shutdown`` returns. The handlers come first: whoever reads the ``listening``
    line may signal at once, and must get a clean stop. Must run in the main thread."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for line in lines:
            print(f"knit {name}: {line}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        result = shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"knit {name}: stopped", flush=True)
    return result


class NodeProcess:
    """A store node in a child process (``python -m flight_store --config FILE``), started and stopped by pid.

    The constructor returns once the node printed its ``listening on`` line (:attr:`location`); its
    stdout stays open for further lines (:attr:`proc`). :meth:`stop` sends SIGTERM and waits, then
    kills it if it does not stop.

    Example::

        with NodeProcess(ServerConfig(log_level="WARNING")) as node:
            StoreAdmin(node.location).health()
    """

    def __init__(self, config: ServerConfig, workdir: Path | None = None, *,
                 stderr: int | None = subprocess.DEVNULL, prefix: Sequence[str] = ()) -> None:
        """``prefix``: what the command runs under (e.g. ``ip netns exec NAME``: the node in another host; it must
        exec the node, so that the pid :meth:`stop` signals is the node's)."""
        tmp = Path(tempfile.mkdtemp(prefix="knit-node-")) if workdir is None else None
        path = documents.write(config, (tmp or cast(Path, workdir)) / "node.json")
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "flight_store", "--config", str(path)],
                                     stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = self.proc.stdout.readline() if self.proc.stdout is not None else ""
        if tmp is not None:  # the node has read its config (or failed)
            shutil.rmtree(tmp, ignore_errors=True)
        if "listening on " not in line:
            self.stop()
            msg = f"store node process did not start{' under ' + ' '.join(prefix) if prefix else ''}: {line!r}"
            raise RuntimeError(msg)
        self.location = line.split("listening on ", 1)[1].strip()
        """Where the node listens."""

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the node and wait for it (SIGKILL after ``timeout_s``); returns its exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
