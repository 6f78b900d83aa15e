"""Polars SQL over the live trajectory metadata of every node (``knit meta --sql ...``).

The metadata of all nodes is registered as the table ``trajectories`` (one row per trajectory,
the metadata columns of ``schemas.arrow.METADATA_SCHEMA`` plus ``node``). Payload columns are
never read: a query moves only metadata.

Example:
    knit meta --stores grpc://127.0.0.1:7001,grpc://127.0.0.1:7002 \\
        --sql "SELECT data_source, avg(reward) AS reward, count(*) AS n FROM trajectories GROUP BY 1"
"""

from __future__ import annotations

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
