"""What the Flight SQL gateway (``knit sql``) is configured with: where it listens, its security, which store
nodes it reads, and the limits every query runs under."""

from __future__ import annotations

from dataclasses import dataclass, field

from flight_store.config import ClientConfig


@dataclass(kw_only=True, slots=True)
class SqlConfig:
    """The gateway: a Flight SQL server over the metadata of the store nodes :attr:`stores`.

    Secrets are never part of the config: the token and the TLS key are read from the files named here.

    Example:
        >>> SqlConfig(stores=["grpc://127.0.0.1:7001"], query_timeout_s=5).location
        'grpc://127.0.0.1:0'
        >>> SqlConfig(stores=[])
        Traceback (most recent call last):
        ...
        ValueError: stores must name at least one store node location (grpc://host:port), got []
    """

    stores: list[str]
    """Locations of every store node the gateway reads (``grpc://host:port``); each is the ``node`` of its rows."""
    host: str = "127.0.0.1"
    """Interface to bind (``0.0.0.0`` = every interface)."""
    port: int = 0
    """TCP port to listen on; 0 = a free one (read it back from ``SqlGateway.location``)."""
    tls_cert_file: str | None = None
    """PEM certificate chain to serve ``grpc+tls://`` with; needs :attr:`tls_key_file`."""
    tls_key_file: str | None = None
    """PEM private key of :attr:`tls_cert_file`."""
    auth_token_file: str | None = None
    """File holding the bearer token every call must carry (``authorization: Bearer <token>``); ``None`` = none."""
    client: ClientConfig = field(default_factory=ClientConfig)
    """How the gateway reaches the store nodes (their token and CA, timeouts)."""
    snapshot_max_age_s: float = 1.0
    """Queries within this many seconds of the last read of the nodes share it; an older one reads them again."""
    query_timeout_s: float = 30.0
    """A query running longer is interrupted and fails with ``QueryTimeoutError``."""
    max_result_rows: int = 1_000_000
    """A result of more rows fails with ``LimitExceededError`` (aggregate, filter or LIMIT the query)."""
    max_result_bytes: int = 256 << 20
    """A result of more Arrow bytes fails with ``LimitExceededError``."""
    max_queries: int = 4
    """Queries run at once; one more waits for a free slot up to :attr:`query_timeout_s`."""
    threads: int = 2
    """Threads DuckDB runs one query on."""
    memory_limit: str = "1GB"
    """DuckDB's memory limit (a query needing more fails with DuckDB's out-of-memory error)."""
    nice: int = 10
    """Niceness the ``knit sql`` process adds to itself (0 = none): on a host it shares with store nodes, queries
    then run on the CPU the nodes' writes and reads leave."""
    max_handles: int = 256
    """Results waiting to be fetched plus open prepared statements; the oldest is dropped past this."""
    handle_ttl_s: float = 600.0
    """A result not fetched, or a prepared statement not used, for this long is dropped."""

    def __post_init__(self) -> None:
        if not self.stores or not all(isinstance(s, str) and "://" in s for s in self.stores):
            msg = f"stores must name at least one store node location (grpc://host:port), got {self.stores}"
            raise ValueError(msg)
        if not 0 <= self.port <= 65535:
            msg = f"port must be in 0..65535, got {self.port}"
            raise ValueError(msg)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            msg = (f"tls_cert_file and tls_key_file must be given together, got tls_cert_file={self.tls_cert_file!r}, "
                   f"tls_key_file={self.tls_key_file!r}")
            raise ValueError(msg)
        for name in ("snapshot_max_age_s", "query_timeout_s", "handle_ttl_s"):
            if getattr(self, name) < 0 or (name != "snapshot_max_age_s" and getattr(self, name) == 0):
                msg = f"{name} must be positive seconds, got {getattr(self, name)}"
                raise ValueError(msg)
        if not 0 <= self.nice <= 19:
            msg = f"nice must be in 0..19, got {self.nice}"
            raise ValueError(msg)
        for name in ("max_result_rows", "max_result_bytes", "max_queries", "threads", "max_handles"):
            if getattr(self, name) < 1:
                msg = f"{name} must be >= 1, got {getattr(self, name)}"
                raise ValueError(msg)

    @property
    def scheme(self) -> str:
        return "grpc+tls" if self.tls_cert_file is not None else "grpc"

    @property
    def location(self) -> str:
        """Where clients connect (the configured port, 0 included)."""
        return f"{self.scheme}://{self.host}:{self.port}"
