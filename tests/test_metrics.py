"""Prometheus /metrics of a node: bytes, latency and group gauges move with a write, a fetch, a release."""

from __future__ import annotations

import urllib.request

import pytest

from flight_store.config import ServerConfig, StoreConfig
from flight_store.reading import StoreReader
from flight_store.server import StoreServer
from flight_store.writing import StoreWriter
from schemas.plan import PlannedSlice

pytest.importorskip("prometheus_client")


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_metrics_follow_write_fetch_release(make_group) -> None:
    with StoreServer(ServerConfig(metrics_port=0, store=StoreConfig(memory_budget=1 << 24))) as server:
        assert server.metrics_port is not None and server.metrics_port > 0
        before = _scrape(server.metrics_port)
        assert before['knit_groups{state="stored"}'] == 0
        assert before["knit_memory_budget"] == 1 << 24
        with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
            node = writer.put_group(make_group("g", size=4, response_len=32))
            mid = _scrape(server.metrics_port)
            table = client.fetch([PlannedSlice(node=node, group_id="g", start=0, stop=2)], columns=["response_ids"])
            after = _scrape(server.metrics_port)
            client.release(["g"])
            released = _scrape(server.metrics_port)
    assert mid['knit_groups{state="stored"}'] == 1 and mid["knit_bytes"] > 0 and mid["knit_rows"] == 4
    assert mid['knit_bytes_in_total{rpc="do_put"}'] >= mid["knit_bytes"]
    assert mid['knit_request_seconds_count{outcome="ok",rpc="do_put"}'] == 1
    assert mid['knit_request_seconds_sum{outcome="ok",rpc="do_put"}'] > 0
    assert after['knit_bytes_out_total{rpc="read"}'] == pytest.approx(table.nbytes, rel=0.01)
    assert after['knit_request_seconds_count{outcome="ok",rpc="read"}'] == 1
    assert released['knit_groups{state="stored"}'] == 0 and released['knit_groups{state="released"}'] == 1
    assert released["knit_memory_used"] == 0


def test_failed_rpc_is_counted_as_error() -> None:
    with StoreServer(ServerConfig(metrics_port=0)) as server, StoreReader(server.location) as client:
        with pytest.raises(Exception, match="ghost"):
            client.fetch([PlannedSlice(node=server.location, group_id="ghost", start=0, stop=1)])
        assert server.metrics_port is not None
        assert _scrape(server.metrics_port)['knit_request_seconds_count{outcome="error",rpc="read"}'] == 1


def test_node_process_metrics_port(node_process) -> None:
    proc, location = node_process(ServerConfig(metrics_port=0, store=StoreConfig(memory_budget=1 << 30)))
    assert location.startswith("grpc://")
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "knit serve: metrics on http://" in line, line
    port = int(line.rsplit(":", 1)[1].split("/")[0])
    scraped = _scrape(port)
    assert "knit_memory_used" in scraped
    # a node process guards its resident memory (without asking): the limit is its RSS at start + the budget
    assert 0 < scraped["knit_memory_rss"] < scraped["knit_memory_rss_limit"] - (1 << 29)
