"""Any-client SQL over the live trajectory metadata: a Flight SQL gateway over the store nodes (``knit sql``).

:class:`~flight_store.sql.gateway.SqlGateway` serves Flight SQL (ADBC, JDBC, DBeaver, Grafana, polars)
from its own process: it reads the nodes' metadata through the ordinary store client
(:mod:`flight_store.sql.tables`) and runs read-only, bounded DuckDB queries over it
(:mod:`flight_store.sql.engine`). Needs the ``sql`` extra (DuckDB, protobuf); importing
:mod:`flight_store` itself does not.
"""

from __future__ import annotations

from flight_store.sql.config import SqlConfig
from flight_store.sql.gateway import SqlGateway

__all__ = ["SqlConfig", "SqlGateway"]
