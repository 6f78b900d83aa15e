"""The store nodes of a ``knit run``, kept up: a node whose process dies is started again, and the outage recorded.

Each node runs from its config document (``configs/store{i}.json``), which names its port and its
spill directory (``stores/node{i}`` in the run folder). A node started again from the same document
listens on the same port and replays its spill log, so it comes back with every acknowledged group
under the same ``seq`` numbers (the planner's scan cursor stays valid: no group is scanned twice or
skipped), released groups still released, its images, the latest weights and the published version.
While it is down the trainer and the rollout retry their calls (``ClientConfig.retries``); nothing
here talks to them.

Guarantees of :class:`Stores`:

* a node whose process exited (any exit code, a signal included) is started again within one
  :meth:`Stores.check` (the driver calls it every half second), at most ``max_restarts`` times per node;
* every outage is recorded (:class:`Outage`: which node, how its process ended, when the driver found
  it dead, when it answered ``health`` again, how many processes it took);
* a node that cannot be brought back (it exited after ``max_restarts`` restarts, did not answer within
  ``start_timeout_s`` of its restart, or, cut off, did not answer for ``start_timeout_s``) is *lost*: its process is
  stopped, it stays down in the cluster view for good (never started again, never asked again) and
  :attr:`Stores.lost` names it, so the driver can take the run up again without it (``launcher.run``); only a
  cluster with every node lost raises ``RuntimeError`` (naming the last, with the end of its log);
* with ``probe_s``, a node whose process runs but that does not answer ``health`` (its host cut off
  from the network) is recorded too, as an outage of cause ``unreachable``, from the first probe it
  missed to the first it answered again; nothing is restarted for it (the clients' calls wait or retry).
  The probes run on a thread of their own from :meth:`Stores.start` to :meth:`Stores.close`, so a caller
  blocked in a call to that node does not delay them;
* every node down (either cause) is left out of routing from the moment it is found down until it answers
  again (:attr:`Stores.views`, ``launcher.supervise``): the cluster's version goes up and the nodes alive take
  its new groups.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from flight_store.client import StoreAdmin
from flight_store.config import ServerConfig
from launcher.children import Child, Children
from launcher.placement import Site
from launcher.supervise import ClusterViews
from schemas import documents
from schemas.run_summary import StoreOutage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outage:
    """A store node whose process died during the run, and its way back (unix times, as the driver saw them)."""

    store: str
    """The child's name (``store1``)."""
    node: str
    """The node's id (``node1``)."""
    location: str
    """Where it listens, before and after (the same port)."""
    exit_code: int | None
    """How its process ended (negative: the signal that ended it, -9 = SIGKILL)."""
    died_at: float
    """When the driver found the process gone (it looks every half second)."""
    restarts: int = 1
    """Processes started for it during this outage (more than one when a restarted node died before it answered)."""
    back_at: float | None = None
    """When the restarted node first answered ``health`` (None: not back)."""
    cause: str = "exited"
    """``exited`` (its process died and was started again), ``unreachable`` (its process ran, but it did not
    answer: ``died_at`` is the first probe it missed; ``restarts`` is 0) or ``node_lost`` (``--ray``: its Ray node
    was lost for good)."""
    lost_at: float | None = None
    """When the driver gave the node up for good (None: not lost; ``back_at`` stays None then)."""

    def record(self) -> StoreOutage:
        """The outage as the report shows it (``schemas.run_summary.StoreOutage``), with ``down_s`` (None while it
        is not back)."""
        down = None if self.back_at is None else round(self.back_at - self.died_at, 3)
        return StoreOutage(store=self.store, node=self.node, location=self.location, exit_code=self.exit_code,
                           died_at=round(self.died_at, 3),
                           back_at=None if self.back_at is None else round(self.back_at, 3), down_s=down,
                           restarts=self.restarts, cause=self.cause,
                           lost_at=None if self.lost_at is None else round(self.lost_at, 3))


class Stores:
    """Starts the store nodes of a run and keeps them up.

    Args:
        kids: starts, restarts and stops the processes.
        nodes: each node's config (with its port and ``store.spill_dir``).
        out: the run folder (``configs/store{i}.json`` is written there; ``stores/`` is cleared at start).
        max_restarts: times one node may be started again.
        start_timeout_s: seconds a node may take to answer ``health`` after a (re)start.
        sites: where each node runs (``launcher.placement``; default: here).
        probe_s: seconds between two ``health`` probes of each running node (``None``: none; see the guarantees).

    Example::

        with Children(out / "logs") as kids:
            stores = Stores(kids, store_configs(cfg), out, max_restarts=3, start_timeout_s=60)
            stores.start()
            while training():
                stores.check()
    """

    def __init__(self, kids: Children, nodes: list[ServerConfig], out: Path, *, max_restarts: int,
                 start_timeout_s: float, sites: list[Site] | None = None, probe_s: float | None = None) -> None:
        if sites is not None and len(sites) != len(nodes):
            msg = f"Stores: {len(sites)} sites for {len(nodes)} nodes"
            raise ValueError(msg)
        self._sites = sites if sites is not None else [Site() for _ in nodes]
        self._probe_s = probe_s
        self._probes: dict[str, StoreAdmin] = {}  # the prober thread's own connections
        self._prober: threading.Thread | None = None
        self._stop_probing = threading.Event()
        self._lock = threading.Lock()  # outages are appended by the prober too
        self._kids = kids
        self._out = out
        self._max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        """Seconds a node may take to answer after a (re)start, and stay cut off, before it is lost."""
        self.nodes = nodes
        """Each node's config (as its document says)."""
        self.children: list[Child] = []
        """Each node's current process."""
        self.outages: list[Outage] = []
        """Every outage so far, in the order they began."""
        self.views: ClusterViews | None = None
        """The cluster view told to the nodes (from :meth:`start` on): which nodes routing leaves out."""

    @property
    def lost(self) -> list[str]:
        """Ids of the nodes given up for good, in the order they were lost."""
        with self._lock:
            return [o.node for o in sorted(self.outages, key=lambda o: o.lost_at or 0.0) if o.lost_at is not None]

    @property
    def locations(self) -> list[str]:
        return [n.location for n in self.nodes]

    def start(self, *, fresh: bool = True) -> None:
        """Start every node on a fresh spill directory (``fresh=False``: on the one there, as a resume does) and
        wait until each answers ``health``. A resume starts again a node that dies meanwhile (an outage, as later in
        the run), and goes on without the nodes whose process runs but that did not answer within
        ``start_timeout_s`` (their hosts cut off, say) when another one answers: each is an ``unreachable`` outage
        from then on, back when it answers, lost when it stays silent as long again.

        Raises:
            RuntimeError: a node exited, or did not answer within ``start_timeout_s`` (names them, with a log):
                on a fresh start, or when no node answers.
        """
        if fresh:
            shutil.rmtree(self._out / "stores", ignore_errors=True)  # the spill logs of an earlier run in this folder
        for i, node in enumerate(self.nodes):
            path = documents.write(node, self._out / "configs" / f"store{i}.json")
            cmd = self._sites[i].command([sys.executable, "-m", "flight_store", "--config", str(path)])
            self.children.append(self._kids.start(f"store{i}", cmd, env=self._sites[i].env))
        deadline = time.monotonic() + self.start_timeout_s
        ids = [str(n.node_name or n.location) for n in self.nodes]
        while silent := [i for i, loc in enumerate(self.locations) if ids[i] not in self.lost and not answers(loc)]:
            dead = [i for i in silent if not self.children[i].alive()]
            if dead and not fresh:  # a resume: a node that dies while the stores start is started again, as later
                for i in dead:
                    self._restart(i, self.children[i])
            elif dead or time.monotonic() > deadline:
                if not dead and not fresh and len(silent) < len(self.nodes) - len(self.lost):
                    self._unreachable_at_start(silent)
                    break
                who = self.children[dead[0] if dead else silent[0]]
                names = ", ".join(self.children[i].name for i in silent)
                msg = f"store node(s) {names} did not come up:\n{self._kids.tail(who)}"
                raise RuntimeError(msg)
            time.sleep(0.2)
        self.views = ClusterViews(self.locations, ids=[str(n.node_name or n.location) for n in self.nodes])
        self._tell_down()  # routing leaves out a node that did not answer at a resume's start
        if self._probe_s is not None:
            self._prober = threading.Thread(target=self._probe_loop, args=(self._probe_s,), name="knit-store-probes",
                                            daemon=True)
            self._prober.start()

    def _unreachable_at_start(self, silent: list[int]) -> None:
        """Go on without the nodes ``silent`` (processes running, no answer): an ``unreachable`` outage each."""
        now = time.time()
        for i in silent:
            node, child = self.nodes[i], self.children[i]
            if any(o.location == node.location and o.back_at is None for o in self.outages):
                continue  # started again after it died: that outage goes on
            log.warning("store %s (%s) did not answer within %.0f s of its start (its process runs): the run goes on "
                        "without it until it answers", node.node_name, child.name, self.start_timeout_s)
            with self._lock:
                self.outages.append(Outage(store=child.name, node=str(node.node_name or node.location),
                                           location=node.location, exit_code=None, died_at=now, restarts=0,
                                           cause="unreachable"))

    def check(self) -> list[str]:
        """Start again every node whose process exited, note those back; returns the ids of the nodes down now.

        A node that exited after ``max_restarts`` restarts, or is still down ``start_timeout_s`` after its outage
        began, is lost (:meth:`_lose`).

        Raises:
            RuntimeError: every node is lost.
        """
        lost = set(self.lost)
        for i, child in enumerate(self.children):
            if not child.alive() and str(self.nodes[i].node_name or self.nodes[i].location) not in lost:
                self._restart(i, child)
        with self._lock:
            outages = list(self.outages)
        for outage in outages:
            if outage.back_at is not None or outage.lost_at is not None:
                continue
            if outage.cause == "exited" and answers(outage.location):  # the prober follows the unreachable ones
                outage.back_at = time.time()
                log.warning("store %s (%s) is back after %.1f s", outage.node, outage.store,
                            outage.back_at - outage.died_at)
            elif time.time() - outage.died_at > self.start_timeout_s:
                self._lose(outage, f"did not answer within {self.start_timeout_s} s")
        self._tell_down()
        return [o.node for o in outages if o.back_at is None]

    def _lose(self, outage: Outage, why: str) -> None:
        """Give ``outage``'s node up for good: stop its process (it must never answer with what it held) and keep
        it down in the view; raises when no node is left."""
        child = self.children[self.locations.index(outage.location)]
        tail = self._kids.tail(child)
        log.error("store node %s (%s) is lost for good (%s): its groups not trained are regenerated:\n%s",
                  outage.node, outage.store, why, tail)
        self._kids.stop(child, grace_s=1.0)
        with self._lock:
            outage.lost_at = time.time()
        if len(self.lost) == len(self.nodes):
            msg = f"every store node is lost, the last {outage.node} ({outage.store}): {why}\n{tail}"
            raise RuntimeError(msg)

    def _tell_down(self) -> None:
        """Routing leaves out exactly the nodes down now (a new view told to the nodes when that changed)."""
        with self._lock:
            down = [o.node for o in self.outages if o.back_at is None]
        if self.views is not None:
            self.views.set_down(down)

    def _probe_loop(self, every_s: float) -> None:
        """The prober thread: every ``every_s``, a node whose process runs but does not answer starts an
        ``unreachable`` outage, and one of those that answers again (a fresh connection) ends it."""
        while not self._stop_probing.wait(every_s):
            self.probe_once()
            self._tell_down()

    def probe_once(self) -> None:
        """One round of probes over every node (what the prober thread does every ``probe_s``)."""
        for i, node in enumerate(self.nodes):
            if self._stop_probing.is_set():
                return
            child = self.children[i]
            with self._lock:
                down = next((o for o in self.outages if o.location == node.location and o.back_at is None), None)
            if down is None and child.alive():
                missed_at = time.time()
                if self._answers_probe(node.location):
                    continue
                self._probes.pop(node.location).close()  # its channel may be in reconnect backoff (a restart):
                # a fresh connection decides
                if not answers(node.location) and child.alive():
                    log.warning("store %s (%s) does not answer (its process runs): unreachable", node.node_name,
                                child.name)
                    with self._lock:
                        self.outages.append(Outage(store=child.name, node=str(node.node_name or node.location),
                                                   location=node.location, exit_code=None, died_at=missed_at,
                                                   restarts=0, cause="unreachable"))
            elif (down is not None and down.cause == "unreachable" and down.lost_at is None
                  and answers(node.location)):
                down.back_at = time.time()  # a fresh connection: the probe's own may still be in TCP backoff
                stale = self._probes.pop(node.location, None)
                if stale is not None:
                    stale.close()
                log.warning("store %s (%s) answers again after %.1f s", down.node, down.store,
                            down.back_at - down.died_at)

    def _answers_probe(self, location: str) -> bool:
        """``health`` over one long-lived connection per node (a probe costs one small call, no new connection)."""
        probe = self._probes.get(location)
        if probe is None:
            probe = self._probes[location] = StoreAdmin(location, timeout=1.0, retries=0)
        try:
            return bool(probe.health()[location].ok)
        except Exception as exc:  # any failure is "does not answer now"
            log.debug("probe of %s failed: %s", location, exc)
            return False

    def close(self) -> None:
        """Stop the prober thread and close its connections (idempotent)."""
        self._stop_probing.set()
        if self._prober is not None:
            self._prober.join(timeout=30)
            self._prober = None
        for probe in self._probes.values():
            probe.close()
        self._probes.clear()
        if self.views is not None:
            self.views.close()

    def wait_up(self) -> None:
        """Return once no node is down but those lost (starting again those that exit); raises as :meth:`check`
        does, and when a node still does not answer after ``start_timeout_s`` (an unreachable one)."""
        deadline = time.monotonic() + self.start_timeout_s
        while down := sorted(set(self.check()) - set(self.lost)):
            if time.monotonic() > deadline:
                msg = f"store nodes {down} still do not answer after {self.start_timeout_s} s"
                raise RuntimeError(msg)
            time.sleep(0.2)

    def _restart(self, i: int, child: Child) -> None:
        """Node ``i``'s process exited: its outage begins (or goes on), and the process is started again, or, its
        restarts spent, the node is lost."""
        node, code = self.nodes[i], child.proc.returncode
        with self._lock:
            outage = next((o for o in self.outages if o.store == child.name and o.back_at is None), None)
            if outage is None:
                outage = Outage(store=child.name, node=str(node.node_name or node.location), location=node.location,
                                exit_code=code, died_at=time.time(), restarts=0)
                self.outages.append(outage)
            elif outage.cause == "unreachable":  # it did not answer, then it died
                outage.cause, outage.exit_code, outage.restarts = "exited", code, 0
        if child.restarts >= self._max_restarts:
            self._lose(outage, f"exited with {code} after {child.restarts} restart(s) "
                               f"(max_store_restarts={self._max_restarts})")
            return
        log.warning("store %s (%s, pid %d) exited with %s: starting it again on %s from its spill log",
                    node.node_name, child.name, child.pid, code, node.location)
        outage.restarts += 1
        self.children[i] = self._kids.restart(child)


def answers(location: str) -> bool:
    """Whether the node at ``location`` answers ``health`` now (a fresh connection: no reconnect backoff)."""
    with StoreAdmin(location, timeout=1.0, retries=0) as probe:
        return bool(probe.health()[location].ok)
