"""Prometheus metrics of one store node, served over HTTP.

``StoreMetrics`` owns a private registry (so several nodes can live in one process, as in tests):
counters of bytes in and out per RPC, request-latency histograms per RPC, and gauges read from the
store's own ``stats()`` at scrape time (groups by state, rows, memory budget and use). The server
calls ``observe`` around each RPC; ``serve(port)`` exposes ``/metrics``. prometheus_client is an
optional dependency (the ``run`` extra), imported only when metrics are enabled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from schemas.replies import NodeStats


def _import_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover - depends on the environment
        msg = "store metrics need prometheus_client: pip install 'knittrans[run]'"
        raise ImportError(msg) from exc
    return prometheus_client


class StoreMetrics:
    """Request, byte and state metrics of one node.

    Example:
        >>> import urllib.request
        >>> from flight_store.store import Store
        >>> m = StoreMetrics(node="n0", stats=Store().stats)
        >>> with m.observe("do_get") as rec:
        ...     rec.bytes_out += 1024
        >>> port = m.serve(0)
        >>> text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        >>> 'knit_bytes_out_total{rpc="do_get"} 1024.0' in text, "knit_rows 0.0" in text
        (True, True)
        >>> m.close()
    """

    def __init__(self, *, node: str, stats: Callable[[], NodeStats]) -> None:
        prom = _import_prometheus()
        from prometheus_client.core import GaugeMetricFamily

        self.node = node
        self.registry = prom.CollectorRegistry()
        self.requests = prom.Histogram(
            "knit_request_seconds", "Flight RPC latency", ["rpc", "outcome"], registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
        )
        self.bytes_in = prom.Counter("knit_bytes_in", "payload bytes received", ["rpc"], registry=self.registry)
        self.bytes_out = prom.Counter("knit_bytes_out", "payload bytes sent", ["rpc"], registry=self.registry)
        self._server: Any = None
        stats_fn = stats

        class _StateCollector:
            def collect(self) -> Iterator[Any]:
                s = stats_fn()
                groups = GaugeMetricFamily("knit_groups", "groups by state", labels=["state"])
                for state, n in s.groups.model_dump().items():
                    groups.add_metric([state], float(n))
                yield groups
                for key, help_ in (
                    ("rows", "trajectory rows held"),
                    ("bytes", "payload bytes held"),
                    ("memory_budget", "memory budget in bytes (0 = unlimited)"),
                    ("memory_used", "bytes counted against the memory budget"),
                    ("memory_in_flight", "bytes writes in flight hold"),
                    ("memory_rss", "resident memory of the node process (with the RSS guard)"),
                    ("memory_rss_limit", "resident memory above which writes are refused (with the RSS guard)"),
                    ("images", "distinct images held"),
                    ("policy_version", "newest published policy version"),
                ):
                    value = getattr(s, key)
                    if value is not None:
                        yield GaugeMetricFamily(f"knit_{key}", help_, value=float(value))

        self.registry.register(_StateCollector())  # type: ignore[arg-type]

    @contextmanager
    def observe(self, rpc: str) -> Iterator[RpcBytes]:
        """Time one RPC; the caller adds the bytes it moved to the yielded record."""
        rec = RpcBytes()
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            yield rec
        except BaseException:
            outcome = "error"
            raise
        finally:
            self.requests.labels(rpc, outcome).observe(time.perf_counter() - t0)
            if rec.bytes_in:
                self.bytes_in.labels(rpc).inc(rec.bytes_in)
            if rec.bytes_out:
                self.bytes_out.labels(rpc).inc(rec.bytes_out)

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Expose ``/metrics`` on ``host:port`` (0 = a free port); returns the port."""
        prom = _import_prometheus()
        server, _thread = prom.start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class RpcBytes:
    """The bytes one RPC moved (the server adds to it; :meth:`StoreMetrics.observe` counts it)."""

    __slots__ = ("bytes_in", "bytes_out")

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0
