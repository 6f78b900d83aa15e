"""The plumbing under the store clients (:mod:`flight_store.client`): one Flight client per node, how a call is made.

:class:`NodeCalls` holds the connections, the call options (deadline, bearer token) and a thread
pool, and gives every client call the same four things: a typed error for every Flight failure
(:func:`flight_store.errors.from_flight_error`, naming the node), retries of exactly the retryable
errors with exponential backoff, a fan-out over several nodes at once, and the three raw Flight
calls the client builds on (an action, a DoPut of one table, a DoGet read whole), and reads over
read channels (:meth:`NodeCalls.read`: long-lived DoExchanges kept per node and projection). Answers
are parsed with their ``schemas.replies`` model, the one the server builds them with.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from flight_store.errors import KnitError, NodeUnavailableError, WireDecodeError, from_flight_error
from flight_store.streams import ChannelBrokenError, ReadChannel
from schemas.replies import Reply, ReplyError

T = TypeVar("T")
K = TypeVar("K")
R = TypeVar("R", bound=Reply)
log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
"""The longest wait between two attempts of a call."""
CHANNEL_LIFETIME_S = 2.0
"""How long a read channel lives (its call's deadline; the client's ``timeout`` when shorter). A channel serves
reads for the first half of it, so a read waits at most that long on it before it is made again by DoGet, and
a node that stops waits at most this long for a client's open channel to end."""
QUICK_TIMEOUT_S = 2.0
"""Deadline of the calls that decide routing (the client's ``timeout`` when shorter)."""
RECONNECT_AFTER = 3
"""Attempts after which a call to a node still unavailable is made over a fresh connection."""
IDLE_CHANNELS = 4
"""Read channels kept open per node and projection between reads (one per thread reading at once)."""


class NodeCalls:
    """Calls to a fixed set of store nodes (see :class:`flight_store.client.StoreNodes` for the arguments).

    Several clients may share one (:meth:`share`); the connections close when the last of them closes.
    """

    def __init__(self, locations: Sequence[str], *, token: str | None, tls_root_certs: bytes | None,
                 timeout: float | None, retries: int, backoff: float) -> None:
        if retries < 0 or backoff < 0:
            msg = f"retries and backoff must be >= 0, got retries={retries}, backoff={backoff}"
            raise ValueError(msg)
        if not locations:
            msg = "a store client needs at least one location"
            raise ValueError(msg)
        if len(set(locations)) != len(locations):
            msg = f"duplicate locations in {list(locations)}"
            raise ValueError(msg)
        token = token if token is not None else os.environ.get("KNIT_TOKEN") or None
        if token is not None and not (token.isascii() and token.isprintable()):
            msg = "token must be printable ASCII (it travels as a gRPC header value)"
            raise ValueError(msg)
        self.nodes = list(locations)
        """The node names (= locations), in the order given."""
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        self.headers = [(b"authorization", b"Bearer " + token.encode())] if token else []
        """The headers every call carries (the bearer token)."""
        self.options = flight.FlightCallOptions(timeout=timeout, headers=self.headers)
        kwargs: dict[str, Any] = {} if tls_root_certs is None else {"tls_root_certs": tls_root_certs}
        self._connect = lambda loc: flight.FlightClient(loc, **kwargs)
        self._clients = {loc: self._connect(loc) for loc in self.nodes}
        self._replaced: list[flight.FlightClient] = []  # connections a reconnect replaced, closed at close()
        self.quick = flight.FlightCallOptions(timeout=QUICK_TIMEOUT_S if timeout is None else min(QUICK_TIMEOUT_S,
                                                                                                  timeout),
                                              headers=self.headers)
        """Call options of the short calls that decide routing (``cluster``): a node cut off must not hold them."""
        self.down: Callable[[str], bool] | None = None
        """Whether the cluster's newest view leaves a node out (set by the client that keeps the view): a routed
        call stops retrying that node, and its caller routes again."""
        self._pool = ThreadPoolExecutor(max_workers=max(2, min(32, 2 * len(self.nodes))),
                                        thread_name_prefix="knit-client")
        self._channel_lifetime = CHANNEL_LIFETIME_S if timeout is None else min(CHANNEL_LIFETIME_S, timeout)
        self._idle: dict[tuple[str, tuple[str, ...] | None], list[ReadChannel]] = {}  # by _channel_key
        self._idle_lock = threading.Lock()
        self._closed = False
        self._users = 1
        self._users_lock = threading.Lock()

    def share(self) -> NodeCalls:
        """These calls, for one more client (each of them closes once; the last close ends the connections)."""
        with self._users_lock:
            if self._users == 0:
                msg = "these store connections are closed"
                raise ValueError(msg)
            self._users += 1
        return self

    def client(self, node: str) -> flight.FlightClient:
        """The Flight client of ``node``; ``ValueError`` for a node this client does not know."""
        try:
            return self._clients[node]
        except KeyError:
            msg = f"unknown node {node!r}; this client knows {self.nodes}"
            raise ValueError(msg) from None

    def call(self, node: str, fn: Callable[[flight.FlightClient], T]) -> T:
        """``fn(client of node)``, its Flight and Arrow errors turned into the project's typed errors."""
        client = self.client(node)
        try:
            return fn(client)
        except (flight.FlightError, pa.ArrowException) as exc:
            raise from_flight_error(exc, node=node) from None

    def retrying(self, node: str, call: Callable[[], T], *, routed: bool = False) -> T:
        """``call()`` retried with exponential backoff while it fails with a retryable error.

        A node still unavailable after :data:`RECONNECT_AFTER` attempts gets a fresh connection (the old one may
        sit in gRPC's reconnect backoff long after a long partition ended). A ``routed`` call stops as soon as
        the cluster's view leaves the node out (:attr:`down`), raising its last error.
        """
        delay = self.backoff
        for attempt in range(self.retries):
            try:
                return call()
            except KnitError as exc:
                if not exc.retryable or (routed and self.down is not None and self.down(node)):
                    raise
                log.warning("call to %s failed (attempt %d): %s; retrying in %.2fs", node, attempt + 1, exc, delay)
                time.sleep(delay)
                delay = min(MAX_BACKOFF_S, delay * 2)
                if attempt + 1 >= RECONNECT_AFTER and isinstance(exc, NodeUnavailableError):
                    self._reconnect(node)
        return call()

    def _reconnect(self, node: str) -> None:
        """A fresh connection to ``node`` for the calls that follow; the old one closes with the others (a call
        another thread makes on it goes on, and fails or answers as it would have)."""
        with self._idle_lock:
            self._replaced.append(self._clients[node])
            self._clients[node] = self._connect(node)

    def fan_out(self, nodes: Iterable[K], fn: Callable[[K], T], *, partial: bool = False,
                what: str = "call") -> tuple[dict[K, T], list[K]]:
        """``fn(node)`` for every node, concurrently (the first on this thread): the answers in node order, and
        the nodes left out.

        Strict (default): the error of the first node (in order) that failed is raised. With
        ``partial``, a node that raises :class:`NodeUnavailableError` is left out of the answers and
        listed; other errors still raise.
        """
        todo = list(nodes)
        futures: dict[K, Callable[[], T]] = {n: self._pool.submit(fn, n).result for n in todo[1:]}
        if todo:  # the first node on this thread: one thread handoff fewer (each costs a GIL switch)
            futures = {todo[0]: _outcome(fn, todo[0]), **futures}
        out: dict[K, T] = {}
        failed: list[K] = []
        for n, result in futures.items():
            try:
                out[n] = result()
            except NodeUnavailableError as exc:
                if not partial:
                    raise
                log.warning("%s: node %s is unavailable (%s); its answer is left out", what, n, exc)
                failed.append(n)
        return out, failed

    def action(self, node: str, name: str, reply: type[R], body: bytes = b"", *, retry: bool = True,
               routed: bool = False, quick: bool = False) -> R:
        """Flight action ``name`` on ``node``: its answer, parsed by ``reply`` (the action's model in
        ``schemas.replies.ACTION_REPLIES``); retried unless ``retry=False`` (``routed``: see :meth:`retrying`;
        ``quick``: under :attr:`quick`'s deadline)."""
        options = self.quick if quick else self.options

        def run(c: flight.FlightClient) -> R:
            results = list(c.do_action(flight.Action(name, body), options))
            return _parse(reply, results[0].body.to_pybytes() if results else b"{}", node)

        return self.retrying(node, lambda: self.call(node, run), routed=routed) if retry else self.call(node, run)

    def put(self, node: str, descriptor: bytes, data: pa.Table | pa.RecordBatch, reply: type[R], *,
            routed: bool = False) -> R:
        """DoPut ``data`` under ``descriptor``, ended cleanly (the node commits only then): its answer; retried
        (``routed``: see :meth:`retrying`)."""
        def run(c: flight.FlightClient) -> R:
            writer, reader = c.do_put(flight.FlightDescriptor.for_command(descriptor), data.schema, self.options)
            try:
                writer.write(data)
                writer.done_writing()
                buf = reader.read()
            finally:
                writer.close()
            return _parse(reply, buf.to_pybytes() if buf is not None else b"{}", node)

        return self.retrying(node, lambda: self.call(node, run), routed=routed)

    def get(self, node: str, ticket: bytes, *, routed: bool = False) -> pa.Table:
        """DoGet ``ticket`` from ``node``, read whole; retried (``routed``: see :meth:`retrying`)."""
        return self.retrying(node, lambda: self.call(node, lambda c: c.do_get(flight.Ticket(ticket),
                                                                               self.options).read_all()),
                             routed=routed)

    def read(self, tickets: Mapping[str, bytes], columns: list[str] | None,
             fallback: Callable[[str], pa.Table]) -> dict[str, pa.Table]:
        """Each node's answer to its ``slices`` ticket (of ``columns``), over read channels, in node order.

        Every request is sent before any answer is read, so the nodes work at once without a thread per
        node, and no call is made per read. A node whose channel cannot be opened or fails on the way is read
        by ``fallback(node)`` instead (a DoGet with its retries and errors); a node's typed refusal (an
        unknown group, a bad column) is raised, the first in node order.
        """
        sent: dict[str, ReadChannel] = {}
        try:
            for node, ticket in tickets.items():
                channel = self._channel(node, columns)
                if channel is not None:
                    try:
                        channel.send(ticket)
                        sent[node] = channel
                    except ChannelBrokenError:
                        pass
            out: dict[str, pa.Table] = {}
            for node in tickets:
                channel = sent.pop(node, None)
                if channel is not None:
                    try:
                        out[node] = channel.receive()
                        self._keep(channel)
                        continue
                    except ChannelBrokenError as exc:
                        log.debug("%s; reading by DoGet", exc)
                    except KnitError as exc:
                        self._keep(channel)  # its answer ended: the channel goes on
                        if not exc.retryable:
                            raise
                out[node] = fallback(node)
            return out
        finally:
            for channel in sent.values():  # answers never read (an error came first): those channels end
                channel.close()

    def _channel(self, node: str, columns: list[str] | None) -> ReadChannel | None:
        """An idle fresh read channel to ``node`` for ``columns``, or a new one (``None`` if it cannot be opened)."""
        key = _channel_key(node, columns)
        stale = []
        found = None
        with self._idle_lock:
            idle = self._idle.get(key, [])
            while idle and found is None:
                channel = idle.pop()
                if channel.fresh:
                    found = channel
                else:
                    stale.append(channel)
        for channel in stale:
            channel.close()
        if found is not None:
            return found
        try:
            return ReadChannel(self.client(node), node, columns, self._channel_lifetime, self.headers)
        except ChannelBrokenError as exc:
            log.debug("no read channel to %s (%s); reading by DoGet", node, exc)
            return None

    def _keep(self, channel: ReadChannel) -> None:
        """Keep ``channel`` for the next read (while fresh, up to :data:`IDLE_CHANNELS` a key), or end it."""
        key = _channel_key(channel.node, channel.columns)
        with self._idle_lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and channel.fresh and len(idle) < IDLE_CHANNELS:
                idle.append(channel)
                return
        channel.close()

    def close(self) -> None:
        """End the read channels, stop the pool and close every connection (once no client shares them)."""
        with self._users_lock:
            self._users = max(0, self._users - 1)
            if self._users:
                return
        with self._idle_lock:
            self._closed = True
            channels = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for channel in channels:
            channel.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in [*self._clients.values(), *self._replaced]:
            c.close()


def _parse(reply: type[R], raw: bytes, node: str) -> R:
    """``raw`` as a ``reply``; an answer that is not one is a :class:`WireDecodeError` naming the node."""
    try:
        return reply.from_bytes(raw)  # type: ignore[no-any-return]
    except ReplyError as exc:
        msg = f"node {node} answered what this client cannot read: {exc}"
        raise WireDecodeError(msg) from None


def _channel_key(node: str, columns: list[str] | None) -> tuple[str, tuple[str, ...] | None]:
    """What read channels are kept under: the node and the projection."""
    return node, None if columns is None else tuple(columns)


def _outcome(fn: Callable[[K], T], node: K) -> Callable[[], T]:
    """``fn(node)`` run now; a callable that returns its result or raises its error (as a future's ``result``)."""
    try:
        value = fn(node)
    except BaseException as exc:  # re-raised by the caller, in node order
        error = exc

        def fail() -> T:
            raise error

        return fail
    return lambda: value
