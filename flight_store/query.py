"""Polars SQL over the live trajectory metadata of every node (``knit meta --sql ...``).

The metadata of all nodes is registered as the table ``trajectories`` (one row per trajectory,
the metadata columns of ``schemas.arrow.METADATA_SCHEMA`` plus ``node``). Payload columns are
never read: a query moves only metadata.

Example:
    knit meta --nodes grpc://127.0.0.1:7001,grpc://127.0.0.1:7002 \\
        --sql "SELECT data_source, avg(reward) AS reward, count(*) AS n FROM trajectories GROUP BY 1"
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import polars as pl

TABLE = "trajectories"


def query_metadata(metadata: pl.LazyFrame | pl.DataFrame, sql: str) -> pl.DataFrame:
    """Run ``sql`` against ``metadata`` registered as ``trajectories``."""
    ctx = pl.SQLContext({TABLE: metadata.lazy()}, eager=False)
    try:
        return ctx.execute(sql).collect()
    except (pl.exceptions.SQLInterfaceError, pl.exceptions.SQLSyntaxError, pl.exceptions.ColumnNotFoundError) as exc:
        msg = f"cannot run query {sql!r} over table {TABLE!r}: {exc}"
        raise ValueError(msg) from None


def main(argv: Sequence[str] | None = None) -> int:
    from flight_store.client import StoreClient

    ap = argparse.ArgumentParser(prog="knit meta", description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", required=True, help="comma-separated store locations, e.g. grpc://127.0.0.1:7001")
    ap.add_argument("--sql", default=f"SELECT * FROM {TABLE} LIMIT 20", help=f"a polars SQL query over {TABLE!r}")
    ap.add_argument("--format", choices=["table", "csv", "json"], default="table")
    ap.add_argument("--token", default=None, help="bearer token (default: $KNIT_TOKEN)")
    args = ap.parse_args(argv)
    with StoreClient([n for n in args.nodes.split(",") if n], token=args.token) as client:
        try:
            out = query_metadata(client.metadata(), args.sql)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.format == "csv":
        sys.stdout.write(out.write_csv())
    elif args.format == "json":
        sys.stdout.write(out.write_json() + "\n")
    else:
        with pl.Config(tbl_rows=100, tbl_cols=30, fmt_str_lengths=60):
            print(out)
    return 0
