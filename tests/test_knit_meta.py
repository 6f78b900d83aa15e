"""``knit meta`` (polars SQL over the live metadata of every node) and ``StoreReader.metadata()`` on real nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl

from flight_store.client import StoreNodes
from flight_store.query import query_metadata
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter

ROOT = Path(__file__).resolve().parents[1]
SQL = "SELECT data_source, avg(reward) AS reward, count(*) AS n FROM trajectories GROUP BY 1 ORDER BY 1"


def _write(client: StoreNodes, make_group, spread_ids) -> None:  # type: ignore[no-untyped-def]
    # 6 groups of 4 over 3 sources, owned by every node; make_group's rewards are i % 2 -> 0.5 per group
    for g, gid in enumerate(spread_ids(client, 6)):
        source = ("math", "code", "chat")[g % 3]
        with StoreWriter.sharing(client) as writer:
            writer.put_group(make_group(gid, size=4, data_source=source, policy_version=g // 2))


def test_knit_meta_sql_over_two_live_nodes(store_nodes, make_group, spread_ids) -> None:  # type: ignore[no-untyped-def]
    servers = store_nodes(2)
    nodes = [s.location for s in servers]
    with StoreReader(nodes) as client:
        _write(client, make_group, spread_ids)
        assert set(client.scan_metadata(columns=["group_id"])["node"].unique()) == set(nodes)  # both nodes hold data
    res = subprocess.run([sys.executable, "-m", "launcher", "meta", "--stores", ",".join(nodes), "--sql", SQL,
                          "--format", "json"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["data_source"] for r in rows] == ["chat", "code", "math"]
    assert [r["n"] for r in rows] == [8, 8, 8]
    assert all(abs(r["reward"] - 0.5) < 1e-9 for r in rows)


def test_knit_meta_refuses_a_bad_query(store_nodes, make_group, spread_ids) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client:
        _write(client, make_group, spread_ids)
    res = subprocess.run([sys.executable, "-m", "launcher", "meta", "--stores", server.location, "--sql",
                          "SELECT no_such_column FROM trajectories"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 2
    assert "no_such_column" in res.stderr


def test_metadata_lazyframe_api(store_nodes, make_group, spread_ids) -> None:  # type: ignore[no-untyped-def]
    servers = store_nodes(2)
    with StoreReader([s.location for s in servers]) as client:
        _write(client, make_group, spread_ids)
        lazy = client.metadata()
        assert isinstance(lazy, pl.LazyFrame)
        per_version = (lazy.group_by("policy_version").agg(pl.len().alias("n"), pl.col("response_len").sum())
                       .sort("policy_version").collect())
        assert per_version["policy_version"].to_list() == [0, 1, 2]
        assert per_version["n"].to_list() == [8, 8, 8]
        # payload columns never travel with metadata
        assert "response_ids" not in lazy.collect_schema().names()
        out = query_metadata(lazy, "SELECT node, count(*) AS n FROM trajectories GROUP BY node ORDER BY node")
        assert out["n"].sum() == 24 and out.height == 2
