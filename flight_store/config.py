"""The configs of a store node: :class:`StoreConfig` (the store) and :class:`ServerConfig` (the whole node).

A node process receives one :class:`ServerConfig` as a JSON document (``schemas.documents``) and
runs it with :func:`flight_store.node.serve`; in-process nodes (tests, the demo) pass the same
object to :class:`~flight_store.server.StoreServer`. Every value is checked when the config is
built, and an error names the bad value.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

HISTORY_ROW_BYTES = 220
"""Resident bytes of one metadata row kept for a released group (measured: ~217)."""
TOMBSTONE_BYTES = 900
"""Resident bytes of one released group's tombstone (measured: ~897)."""
BOOKKEEPING_SHARE = 16
"""The history and the tombstones each get at most ``memory_budget // BOOKKEEPING_SHARE`` by default."""
MIN_BOOKKEEPING, MAX_BOOKKEEPING = 64, 100_000
"""The derived bounds of the history rows and the tombstones stay within these."""


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """Settings of one store (the node-local state, no gRPC).

    Example:
        >>> StoreConfig(memory_budget=1 << 30).spill_dir is None
        True
        >>> StoreConfig(memory_budget=0)
        Traceback (most recent call last):
        ...
        ValueError: memory_budget must be positive bytes or None, got 0
    """

    memory_budget: int | None = None
    """Bytes of memory the node's groups, images and weights may hold; ``None`` = unlimited.

    What counts is resident memory, not ``RecordBatch.nbytes``: each stored batch's block (its
    whole pages, see :func:`flight_store.blocks.pack`) plus an estimate of its objects and index
    entries, and the memory writes in flight hold (copies of their batches; their server thread, see
    :meth:`flight_store.store.Store.incoming`). A write is committed only if the stored groups,
    the new group and the other writes in flight fit together."""
    node_name: str = "local"
    """Name reported by ``health``/``stats`` and in error messages (a server names its store itself, see
    :attr:`ServerConfig.node_name`)."""
    spill_dir: str | None = None
    """Directory of the durable spill log (created if missing); ``None`` = memory only."""
    weights_versions: int = 2
    """Weights versions kept (the newest ones); storing one more frees the oldest."""
    history_rows: int | None = None
    """Metadata rows of released groups kept for scans (``released`` true); beyond them the oldest are dropped,
    so memory follows the live data. ``None`` = as many as a sixteenth of ``memory_budget`` holds (~220 bytes a
    row), at most 100,000 (100,000 without a budget)."""
    tombstones: int | None = None
    """Released groups remembered (id, row count, content digests) so a retried write of one is recognised;
    beyond them the oldest are forgotten. ``None`` = as many as a sixteenth of ``memory_budget`` holds (~900
    bytes a group), at most 100,000 (100,000 without a budget)."""
    spill_recovery: Literal["refuse", "salvage"] = "refuse"
    """A spill log damaged inside (not a torn tail): ``refuse`` to start, naming the file and offset, or
    ``salvage`` every intact frame (the damaged file is kept aside)."""
    spill_compact_bytes: int = 64 << 20
    """Rewrite the spill log with only what is live once it is larger than this and twice the live bytes."""
    rss_guard: bool = False
    """Also hold the process's resident memory to the budget (for a store that owns its process, as a node run
    by :func:`flight_store.node.serve` does: it turns this on): a group or image write is refused, retryably,
    while the process's RSS is more than ``memory_budget`` above what it was when the store opened, unless the
    store holds nothing (so a write is never refused forever). This covers what no count sees (gRPC buffers,
    thread stacks, allocator caches, the metadata history); needs ``/proc/self/statm`` and a budget, else it is
    off."""

    def __post_init__(self) -> None:
        if self.memory_budget is not None and self.memory_budget <= 0:
            msg = f"memory_budget must be positive bytes or None, got {self.memory_budget}"
            raise ValueError(msg)
        for name in ("weights_versions", "history_rows", "tombstones", "spill_compact_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                msg = f"{name} must be >= 1, got {getattr(self, name)}"
                raise ValueError(msg)
        if not self.node_name:
            msg = f"node_name must be a non-empty string, got {self.node_name!r}"
            raise ValueError(msg)
        if self.spill_dir is not None and not self.spill_dir:
            msg = f"spill_dir must be a directory path or None, got {self.spill_dir!r}"
            raise ValueError(msg)


    def bookkeeping(self) -> tuple[int, int]:
        """``(history_rows, tombstones)``: the bounds given, or those derived from the budget (see the fields).

        What a node keeps of its released groups must never crowd out the groups it stores: with the
        derived bounds it holds 9/64 of the budget at most (the history is trimmed once past 5/4 of its
        bound), so releasing consumed groups always makes room.

        Example:
            >>> StoreConfig(memory_budget=64 << 20).bookkeeping()
            (19065, 4660)
            >>> StoreConfig().bookkeeping(), StoreConfig(history_rows=10).bookkeeping()[0]
            ((100000, 100000), 10)
        """
        share = None if self.memory_budget is None else self.memory_budget // BOOKKEEPING_SHARE

        def bound(given: int | None, each: int) -> int:
            if given is not None:
                return given
            return MAX_BOOKKEEPING if share is None else max(MIN_BOOKKEEPING, min(MAX_BOOKKEEPING, share // each))

        return bound(self.history_rows, HISTORY_ROW_BYTES), bound(self.tombstones, TOMBSTONE_BYTES)


@dataclass(kw_only=True, slots=True)
class ClientConfig:
    """How a part talks to the stores (``StoreNodes.from_config``): timeouts, retries, credentials.

    Secrets are never part of the config: the token and the CA are read from the files named here.
    """

    timeout_s: float | None = 30.0
    """Seconds per call (``None`` = no limit)."""
    retries: int = 3
    """Extra attempts of a call that failed with a retryable error (a node unavailable, its budget full)."""
    backoff_s: float = 0.1
    """Seconds before the first retry; doubled for each further one, at most 5 s (``retries=20`` waits ~80 s)."""
    token_file: str | None = None
    """File holding the bearer token the stores require; ``None`` = ``$KNIT_TOKEN`` (or none)."""
    tls_root_certs_file: str | None = None
    """PEM root certificates for ``grpc+tls://`` stores."""

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0:
            msg = f"retries and backoff_s must be >= 0, got retries={self.retries}, backoff_s={self.backoff_s}"
            raise ValueError(msg)
        if self.timeout_s is not None and self.timeout_s <= 0:
            msg = f"timeout_s must be positive seconds or None, got {self.timeout_s}"
            raise ValueError(msg)


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterMember:
    """One node of a store cluster, as every node and client sees it."""

    id: str
    """The node's id: what routing hashes (``schemas.routing``); its ``node_name``."""
    location: str
    """Where it listens (``grpc://host:port``)."""

    def __post_init__(self) -> None:
        if not self.id or not self.location:
            msg = f"a cluster member needs an id and a location, got id={self.id!r} location={self.location!r}"
            raise ValueError(msg)


def _check_port(name: str, port: int | None) -> None:
    if port is not None and not 0 <= port <= 65535:
        msg = f"{name} must be in 0..65535 (0 = a free port), got {port}"
        raise ValueError(msg)


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Everything one store node needs: where it listens, its security, its metrics, its store.

    Secrets are never part of the config: the node reads them from the files named here when it
    starts (a config document can be logged or passed on without leaking them).

    Example:
        >>> cfg = ServerConfig(port=8815, store=StoreConfig(memory_budget=1 << 30))
        >>> cfg.location
        'grpc://127.0.0.1:8815'
        >>> ServerConfig(tls_cert_file="node.pem")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: tls_cert_file and tls_key_file must be given together, got tls_cert_file='node.pem', ...
    """

    host: str = "127.0.0.1"
    """Interface to bind (``0.0.0.0`` = every interface)."""
    advertise_host: str | None = None
    """Address clients reach the node at, in its :attr:`location` (``None`` = :attr:`host`; give it when
    :attr:`host` is ``0.0.0.0`` or the node is reached through another address)."""
    port: int = 0
    """TCP port to listen on; 0 = a free one (read it back from ``StoreServer.location``)."""
    node_name: str | None = None
    """Name reported by ``health``/``stats`` and in error messages; ``None`` = the node's location."""
    coalesce_below: int = 1 << 20
    """A slices answer of several batches under this many payload bytes is sent as one copied batch
    (0 = never; see :meth:`flight_store.store.Store.slices`)."""
    tls_cert_file: str | None = None
    """PEM certificate chain to serve ``grpc+tls://`` with; needs :attr:`tls_key_file`."""
    tls_key_file: str | None = None
    """PEM private key of :attr:`tls_cert_file`."""
    auth_token_file: str | None = None
    """File holding the bearer token every call must carry (``authorization: Bearer <token>``; surrounding
    whitespace is stripped); ``None`` = no authentication."""
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` on this port (0 = a free one); ``None`` = no metrics."""
    log_level: str = "INFO"
    """Logging level of a node process run by :func:`flight_store.node.serve` (``DEBUG``, ``INFO``, ...)."""
    max_writers: int = 64
    """DoPuts the node receives at once; one more is refused, retryably (``TooManyWritersError``)."""
    max_writers_per_peer: int = 16
    """DoPuts one peer (one client connection) may have in progress on the node; one more is refused, retryably
    (``TooManyPeerWritersError``), so a client holding idle streams fills its own share, never the node. Take it
    above the writes one client sends at once (the project's clients send at most a few)."""
    write_idle_timeout_s: float = 30.0
    """A DoPut whose stream delivers nothing for this long is given up: its slot and reserved memory are freed and
    it is refused when it resumes (``WriteTimedOutError``, retryable)."""
    write_evict_idle_s: float = 1.0
    """When the node holds ``max_writers`` DoPuts, a new one takes the slot of the one idle longest if that one has
    delivered no rows for this long (it is refused as an idle one is), so no number of idle connections locks
    honest writers out; a stream that delivers rows at least this often is never evicted."""
    cluster: list[ClusterMember] = field(default_factory=list)
    """Every node of the cluster, this one included (its id is :attr:`node_name`), for routing: the node refuses
    a group that routing gives another node. Empty = a cluster of this node alone (it takes every group)."""
    cluster_version: int = 1
    """Version of the cluster view (raise it when the membership changes), reported by the ``cluster`` action."""
    store: StoreConfig = field(default_factory=StoreConfig)
    """The node's store (its ``node_name`` is replaced by :attr:`node_name` or the location)."""

    def __post_init__(self) -> None:
        if not self.host:
            msg = f"host must be a non-empty interface name or address, got {self.host!r}"
            raise ValueError(msg)
        if self.advertise_host is not None and self.advertise_host.strip("[]") in ("", "0.0.0.0", "::"):
            msg = f"advertise_host must be an address clients can reach (or None), got {self.advertise_host!r}"
            raise ValueError(msg)
        _check_port("port", self.port)
        _check_port("metrics_port", self.metrics_port)
        if self.node_name is not None and not self.node_name:
            msg = f"node_name must be a non-empty string or None, got {self.node_name!r}"
            raise ValueError(msg)
        if self.coalesce_below < 0:
            msg = f"coalesce_below must be >= 0 bytes, got {self.coalesce_below}"
            raise ValueError(msg)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            msg = (
                "tls_cert_file and tls_key_file must be given together, got "
                f"tls_cert_file={self.tls_cert_file!r}, tls_key_file={self.tls_key_file!r}"
            )
            raise ValueError(msg)
        if self.max_writers < 1 or self.max_writers_per_peer < 1 or self.write_idle_timeout_s <= 0:
            msg = (f"max_writers and max_writers_per_peer must be >= 1 and write_idle_timeout_s > 0, got "
                   f"{self.max_writers}, {self.max_writers_per_peer} and {self.write_idle_timeout_s}")
            raise ValueError(msg)
        if not 0 < self.write_evict_idle_s <= self.write_idle_timeout_s:
            msg = (f"write_evict_idle_s must be > 0 and at most write_idle_timeout_s ({self.write_idle_timeout_s}), "
                   f"got {self.write_evict_idle_s}")
            raise ValueError(msg)
        ids = [m.id for m in self.cluster]
        if len(set(ids)) != len(ids):
            msg = f"cluster ids must be unique, got {ids}"
            raise ValueError(msg)
        if self.cluster and self.node_name not in ids:
            msg = f"node_name={self.node_name!r} must be one of the cluster's ids {ids} (the node's own id)"
            raise ValueError(msg)
        if self.cluster_version < 1:
            msg = f"cluster_version must be >= 1, got {self.cluster_version}"
            raise ValueError(msg)
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            msg = f"log_level must be a logging level name (DEBUG, INFO, WARNING, ERROR), got {self.log_level!r}"
            raise ValueError(msg)

    @property
    def location(self) -> str:
        """``grpc://host:port``, or ``grpc+tls://host:port`` with TLS (the configured port, 0 included; the host is
        :attr:`advertise_host` when given): where clients connect."""
        return f"{self.scheme}://{self.advertised_host}:{self.port}"

    @property
    def bind_location(self) -> str:
        """``grpc://host:port`` with the interface the node binds (:attr:`host`)."""
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def scheme(self) -> str:
        return "grpc+tls" if self.tls_cert_file is not None else "grpc"

    @property
    def advertised_host(self) -> str:
        """The host of :attr:`location`: :attr:`advertise_host`, else :attr:`host`."""
        return self.advertise_host if self.advertise_host is not None else self.host
