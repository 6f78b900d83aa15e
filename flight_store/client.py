"""The clients of one or many store nodes, one class per role a user meets:

* :class:`~flight_store.writing.StoreWriter`: what a rollout engine uses (write groups and images,
  register groups in flight, read the weights it serves);
* :class:`~flight_store.reading.StoreReader`: what a trainer uses (scan metadata, read the rows of
  planned slices, release, publish the demand, count the groups in flight);
* :class:`~flight_store.publishing.StorePublisher`: what a trainer publishes (weights, policy versions);
* :class:`StoreAdmin`: what an operator asks (health, cluster membership).

All four stand on :class:`StoreNodes`: the connections (TLS, bearer token), routing, retries,
``stats``, ``get_version`` and ``close``. Two roles over the same nodes may share one set of
connections (:meth:`StoreNodes.sharing`).

Node name = the location string (``"grpc://host:port"``). Every call that concerns several
nodes fans out concurrently on a thread pool. A group is written to the node routing gives it
(``schemas.routing`` over the ids the nodes report, :mod:`flight_store.cluster`), its images to the
same node. Errors come back as the project's typed errors (:mod:`flight_store.errors`); a node that
cannot be reached raises :class:`NodeUnavailableError` naming it.

Retries follow the error table: a call that fails with a retryable error (``error.retryable``: the
node is unavailable, its budget is full) is retried ``retries`` times with exponential backoff (every
call is idempotent), any other error is raised at once.

Node failure: a call made with ``partial=True`` returns the answers of the nodes that answered and
records the others in :attr:`StoreNodes.last_failed_nodes` (the default stays strict: the first
unreachable node raises). When the launcher marks a lost node down (``set_cluster``, the cluster's
version goes up), routing moves its groups to the nodes alive: a routed write stops retrying the lost
node at once and goes to the new owner, and the calls that ask every node (scans, releases, versions,
weights, stats) leave the node out until a newer view brings it back. While a view has nodes down, the
client asks for a newer one at most every :data:`VIEW_TTL_S`, and at once when a call fails.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from flight_store.calls import NodeCalls
from flight_store.cluster import ClusterView, view_from
from flight_store.config import ClientConfig
from flight_store.errors import NodeUnavailableError
from flight_store.secrets import read_token_file
from schemas.replies import ClusterReply, HealthReply, NodeStats, VersionReply
from schemas.wire import EmptyBody, SetClusterBody

T = TypeVar("T")
log = logging.getLogger(__name__)
VIEW_TTL_S = 1.0
"""While nodes are down, how old a cluster view may be before a call asks the nodes for a newer one."""


class ViewCache:
    """The cluster view one set of connections routes by (shared by the clients that share them)."""

    def __init__(self) -> None:
        self.view: ClusterView | None = None
        self.at = 0.0
        """When :attr:`view` was asked (monotonic)."""
        self.lock = threading.Lock()


class StoreNodes:
    """The connections to one or many store nodes, and what every role does with them.

    Args:
        locations: one location or a list (``"grpc://127.0.0.1:8815"``); each is also the node's name.
        token: bearer token sent as ``authorization: Bearer <token>``; ``None`` reads ``KNIT_TOKEN``.
        tls_root_certs: PEM root certificates for ``grpc+tls://`` locations.
        timeout: seconds per call (``None`` = no limit).
        retries: extra attempts of a call that failed with a retryable error (0 = fail at once).
        backoff: seconds before the first retry; doubled for each further one (capped at 5 s).
    """

    def __init__(
        self,
        locations: str | Sequence[str],
        *,
        token: str | None = None,
        tls_root_certs: bytes | None = None,
        timeout: float | None = 30.0,
        retries: int = 3,
        backoff: float = 0.1,
    ) -> None:
        locs = [locations] if isinstance(locations, str) else list(locations)
        self._setup(NodeCalls(locs, token=token, tls_root_certs=tls_root_certs, timeout=timeout, retries=retries,
                              backoff=backoff))

    def _setup(self, calls: NodeCalls, views: ViewCache | None = None) -> None:
        """State of a client over ``calls`` (a role adds its own); ``views``: the view cache of the client it shares
        them with."""
        self._calls = calls
        self._nodes = calls.nodes
        self.last_failed_nodes: list[str] = []
        """Nodes that did not answer the latest call made with ``partial=True``."""
        self._views = views if views is not None else ViewCache()
        if views is None:
            calls.down = self._found_down

    @classmethod
    def from_config(cls, locations: str | Sequence[str], config: ClientConfig) -> Self:
        """A client of ``locations`` as ``config`` says (the token and CA are read from its files)."""
        token = read_token_file(config.token_file) if config.token_file else None
        certs = Path(config.tls_root_certs_file).read_bytes() if config.tls_root_certs_file else None
        return cls(locations, token=token, tls_root_certs=certs, timeout=config.timeout_s, retries=config.retries,
                   backoff=config.backoff_s)

    @classmethod
    def from_cluster(cls, location: str, **kwargs: Any) -> Self:
        """A client of every node of the cluster ``location`` belongs to (its ``cluster`` action lists them)."""
        with StoreNodes(location, **kwargs) as probe:
            members = probe._cluster_answers()[location].nodes
        return cls([m.location for m in members] or [location], **kwargs)

    @classmethod
    def sharing(cls, other: StoreNodes) -> Self:
        """A client of this role over ``other``'s connections (same nodes, token, timeouts); each closes once,
        and the connections end with the last close.

        Example:
            >>> from flight_store.server import StoreServer
            >>> from flight_store.reading import StoreReader
            >>> from flight_store.writing import StoreWriter
            >>> with StoreServer() as server, StoreWriter(server.location) as writer, \\
            ...         StoreReader.sharing(writer) as reader:
            ...     reader.nodes == writer.nodes
            True
        """
        client = cls.__new__(cls)
        client._setup(other._calls.share(), other._views)
        return client

    @property
    def nodes(self) -> list[str]:
        """The node names (= locations), in the order given."""
        return list(self._nodes)

    @property
    def retries(self) -> int:
        """Extra attempts of a call that failed with a retryable error."""
        return self._calls.retries

    def node_for(self, group_id: str) -> str:
        """The node ``group_id`` belongs to: routing (``schemas.routing``) over the ids the nodes report."""
        return self.cluster_view().owner(group_id)

    def cluster_view(self, *, refresh: bool = False) -> ClusterView:
        """The nodes' ids and those down (asked with the ``cluster`` action, then cached; asked again when
        ``refresh``, or when nodes are down and the view is older than :data:`VIEW_TTL_S`). The nodes that do not
        answer take their ids from the others' member lists; while none answers, the view asked last stays (a
        node cut off and another slow to answer must not stop the routing that sends groups around them).

        Raises:
            NodeUnavailableError: no node answers the first view (after the client's retries).
        """
        cache = self._views
        with cache.lock:
            stale = cache.view is not None and cache.view.down and time.monotonic() - cache.at > VIEW_TTL_S
            if cache.view is None:
                answers = self._calls.retrying(self._nodes[0], self._view_answers)
            elif refresh or stale:
                try:
                    answers = self._view_answers()
                except NodeUnavailableError as exc:
                    log.warning("cluster view: %s; routing on by view v%d", exc, cache.view.version)
                    cache.at = time.monotonic()  # asked again after VIEW_TTL_S, not on every call
                    return cache.view
            else:
                return cache.view
            cache.view, cache.at = view_from(answers, self._nodes), time.monotonic()
            return cache.view

    def _view_answers(self) -> dict[str, ClusterReply]:
        """The ``cluster`` answers of the nodes that answer at once (on this thread: a routed call on a pool thread
        asks too, and must not wait for the pool)."""
        answers = {}
        for n in self._nodes:
            try:
                answers[n] = self._calls.action(n, "cluster", ClusterReply, retry=False, quick=True)
            except NodeUnavailableError as exc:
                log.debug("cluster view: %s does not answer (%s)", n, exc)
        if not answers:
            msg = f"no store node of {self._nodes} answers"
            raise NodeUnavailableError(msg, node=self._nodes[0])
        return answers

    @property
    def down_nodes(self) -> frozenset[str]:
        """The nodes the cluster's newest view known here leaves out. A client of several nodes asks for the view
        the first time (a client started after a node was lost must not wait on it); none while no node answers."""
        if self._views.view is None and len(self._nodes) > 1:
            with contextlib.suppress(NodeUnavailableError):
                self.cluster_view()
        return self.cluster_view().down if self._views.view is not None else frozenset()

    def _live(self) -> list[str]:
        """The nodes not down, in order (every node while none is, or no view was asked yet)."""
        down = self.down_nodes
        return [n for n in self._nodes if n not in down]

    def _found_down(self, node: str) -> bool:
        """Whether ``node`` is down in a view asked now (at most every :data:`VIEW_TTL_S`): a routed call that
        failed on it asks."""
        if self._views.view is None or time.monotonic() - self._views.at > VIEW_TTL_S:
            try:
                self.cluster_view(refresh=True)
            except NodeUnavailableError:
                return False
        return node in self.down_nodes

    def stats(self, *, partial: bool = False) -> dict[str, NodeStats]:
        """The ``stats`` answer of every node not down (``partial``: of every reachable one, see
        :attr:`last_failed_nodes`)."""
        return self._fan_out(self._live(), lambda n: self._calls.action(n, "stats", NodeStats, retry=False),
                             partial=partial, what="stats")

    def get_version(self) -> int:
        """The newest published policy version (max over the nodes not down)."""
        body = EmptyBody().to_bytes()
        answers = self._fan_out(self._live(), lambda n: self._calls.action(n, "get_version", VersionReply, body,
                                                                           retry=False), what="get_version")
        return max(a.version for a in answers.values())

    def close(self) -> None:
        """Close every connection and the thread pool (once no other client shares them)."""
        self._calls.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cluster_answers(self) -> dict[str, ClusterReply]:
        return self._fan_out(self._nodes, lambda n: self._calls.action(n, "cluster", ClusterReply))

    def _fan_out(
        self, nodes: Iterable[str], fn: Callable[[str], T], *, partial: bool = False, what: str = "call"
    ) -> dict[str, T]:
        """:meth:`NodeCalls.fan_out`; a partial call lists the nodes it left out in :attr:`last_failed_nodes`, a strict
        one leaves out only the nodes found down on the way (the cluster's view says so) and raises for any other,
        and when no node answers at all (it has no answer to give)."""
        asked = list(nodes)
        out, failed = self._calls.fan_out(asked, fn, partial=True, what=what)
        if partial:
            self.last_failed_nodes = failed
            return out
        unreachable = [n for n in failed if not self._found_down(n)]
        if unreachable:
            msg = f"{what}: store node {unreachable[0]} is unavailable"
            raise NodeUnavailableError(msg, node=unreachable[0])
        if not out:
            view = self._views.view
            down = f"down in cluster view v{view.version}: {sorted(view.down)}" if view is not None else "no view"
            msg = f"{what}: no store node answers ({down})"
            raise NodeUnavailableError(msg, node=(failed or asked or self._nodes)[0])
        return out


class StoreAdmin(StoreNodes):
    """What an operator asks the nodes: are they alive, which cluster do they form (and, from
    :class:`StoreNodes`, their ``stats`` and the published version).

    Example:
        >>> from flight_store.server import StoreServer
        >>> with StoreServer() as server, StoreAdmin(server.location) as admin:
        ...     admin.health()[server.location].ok
        True
    """

    def health(self) -> dict[str, HealthReply]:
        """The ``health`` answer of every node; an unreachable node answers ``ok=False`` with the ``error``."""

        def one(n: str) -> HealthReply:
            try:
                return self._calls.action(n, "health", HealthReply, retry=False)
            except Exception as exc:  # health reports, it does not raise
                return HealthReply(ok=False, node=n, error=str(exc))

        return self._fan_out(self._nodes, one)

    def cluster(self) -> dict[str, ClusterReply]:
        """The ``cluster`` answer of every node (its id, and its configured membership)."""
        return self._cluster_answers()

    def set_cluster(self, version: int, down: Iterable[str] = ()) -> dict[str, ClusterReply]:
        """Tell every node that answers the view ``version`` with the member ids ``down`` left out of routing
        (``flight_store.membership``); the view each then holds (a node that does not answer is left out)."""
        body = SetClusterBody(version=version, down=sorted(down)).to_bytes()
        return self._fan_out(self._nodes, lambda n: self._calls.action(n, "set_cluster", ClusterReply, body,
                                                                       retry=False, quick=True),
                             partial=True, what="set_cluster")
