"""DuckDB over a :class:`~flight_store.sql.tables.Snapshot`: read-only, bounded in time and in result size.

One in-memory DuckDB database holds the catalog ``knit`` with the views of
:data:`~flight_store.sql.tables.VIEWS`; each query gets its own connection (a DuckDB cursor) on which the
snapshot's Arrow tables are registered, so DuckDB scans them where they lie (no copy in) and concurrent
queries each see their own snapshot.

Guarantees:

* **Read-only.** A query is exactly one statement whose DuckDB statement type is ``SELECT`` (``SELECT``,
  ``WITH``, ``VALUES``, ``DESCRIBE``, ``SHOW``, ``SUMMARIZE``); anything else (``INSERT``, ``CREATE``,
  ``SET``, ``ATTACH``, ``COPY``, ``PRAGMA``, ``CALL``, ...) is refused with :class:`ReadOnlyError` naming
  its type, before it runs. The database also has external access turned off (no file, network or
  extension reads: ``read_csv('/etc/passwd')`` fails) and its configuration locked.
* **Bounded.** A query runs at most ``query_timeout_s``: a watchdog interrupts it
  (``connection.interrupt()``) and it fails with :class:`QueryTimeoutError`; when the client's call is
  cancelled it is interrupted the same way (:class:`QueryCancelledError`). Its result is read batch by
  batch and fails with :class:`LimitExceededError` past ``max_result_rows`` or ``max_result_bytes``. At
  most ``max_queries`` run at once, each on ``threads`` DuckDB threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from flight_store.errors import LimitExceededError
from flight_store.sql.config import SqlConfig
from flight_store.sql.errors import QueryCancelledError, QueryError, QueryTimeoutError, ReadOnlyError
from flight_store.sql.tables import CATALOG, SCHEMA, VIEWS, Snapshot, empty_snapshot

BATCH_ROWS = 65536
"""Rows per record batch of a result."""
WATCH_S = 0.05
"""How often the watchdog looks at the clock and at the client's call."""

try:
    import duckdb
except ImportError as exc:  # pragma: no cover - the extra is installed where the gateway runs
    msg = "the Flight SQL gateway needs DuckDB: install the `sql` extra (pip install 'knittrans[sql]')"
    raise ImportError(msg) from exc


def read_only_statement(sql: str) -> str:
    """The text of the one ``SELECT``-type statement ``sql`` holds.

    Raises:
        QueryError: ``sql`` does not parse, or holds no statement or several.
        ReadOnlyError: the statement is of another type (it would change something, or configure the engine).
    """
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryError(f"cannot parse the query: {exc}") from None
    if len(statements) != 1:
        msg = f"a query must be exactly one SQL statement, got {len(statements)}"
        raise QueryError(msg)
    kind = statements[0].type.name
    if kind != "SELECT":
        msg = (f"this Flight SQL endpoint is read-only: it runs SELECT queries over the trajectory metadata, "
               f"and refused a statement of type {kind}")
        raise ReadOnlyError(msg, statement=kind)
    return str(statements[0].query).strip().rstrip(";")


def statement_parameters(sql: str) -> pa.Schema:
    """The parameters of the one statement ``sql`` holds, in binding order (``?`` and ``$1``: named by position;
    ``$name``: by name), of type null: DuckDB takes any value its use of the parameter can be cast from."""
    names = duckdb.extract_statements(sql)[0].named_parameters
    ordered = sorted(names, key=lambda n: (0, int(n), "") if n.isdigit() else (1, 0, n))
    return pa.schema([pa.field(n, pa.null()) for n in ordered])


class SqlEngine:
    """Runs read-only queries over snapshots (see the module docstring for the guarantees).

    Example:
        >>> from flight_store.sql.tables import empty_snapshot
        >>> engine = SqlEngine(SqlConfig(stores=["grpc://127.0.0.1:1"]))
        >>> engine.run("SELECT count(*) AS n FROM trajectories", empty_snapshot()).to_pylist()
        [{'n': 0}]
    """

    def __init__(self, config: SqlConfig) -> None:
        self.config = config
        self._db = duckdb.connect(config={
            "enable_external_access": False, "autoinstall_known_extensions": False,
            "autoload_known_extensions": False, "threads": config.threads, "memory_limit": config.memory_limit})
        setup = self._connect(empty_snapshot())
        setup.execute(f"ATTACH ':memory:' AS {CATALOG}")
        for name, body in VIEWS.items():
            setup.execute(f"CREATE VIEW {CATALOG}.{SCHEMA}.{name} AS {body}")
        setup.execute("SET lock_configuration = true")
        setup.close()
        self._slots = threading.BoundedSemaphore(config.max_queries)
        self._lock = threading.Lock()
        self.interrupted = {"timeout": 0, "cancelled": 0}
        """Queries interrupted so far, by why: past ``query_timeout_s``, or their call cancelled by the client."""

    def _connect(self, snapshot: Snapshot) -> Any:
        cur = self._db.cursor()
        for name, table in snapshot.sources.items():
            cur.register(name, table)
        return cur

    def schema(self, sql: str, snapshot: Snapshot) -> pa.Schema:
        """The result schema of ``sql`` (a parameterless query; run with ``LIMIT 0``)."""
        return self.run(sql, snapshot, limit_zero=True).schema

    def table_schemas(self, snapshot: Snapshot) -> dict[str, pa.Schema]:
        """Each table's Arrow schema."""
        return {name: self.schema(f"SELECT * FROM {name}", snapshot) for name in VIEWS}

    def run(self, sql: str, snapshot: Snapshot, params: Sequence[Sequence[Any]] | None = None,
            cancelled: Callable[[], bool] = lambda: False, *, limit_zero: bool = False) -> pa.Table:
        """The result of ``sql`` over ``snapshot``, once per row of ``params`` (positional values) and concatenated.

        Raises:
            ReadOnlyError, QueryError, QueryTimeoutError, QueryCancelledError, LimitExceededError: see the
                module docstring; ``flight.FlightUnavailableError`` when no query slot frees within the timeout.
        """
        text = read_only_statement(sql)
        deadline = time.monotonic() + self.config.query_timeout_s
        if not self._slots.acquire(timeout=self.config.query_timeout_s):
            msg = f"the SQL gateway is running {self.config.max_queries} queries already; retry shortly"
            raise flight.FlightUnavailableError(msg)
        try:
            cur = self._connect(snapshot)
            cur.execute(f"USE {CATALOG}.{SCHEMA}")
            stop = _Watchdog(cur, deadline, cancelled, self.config.query_timeout_s)
            try:
                return self._collect(cur, text, params, limit_zero, stop)
            finally:
                stop.done()
                cur.close()
                if stop.reason is not None:
                    with self._lock:
                        self.interrupted[stop.reason] += 1
        finally:
            self._slots.release()

    def _collect(self, cur: Any, text: str, params: Sequence[Sequence[Any]] | None, limit_zero: bool,
                 stop: _Watchdog) -> pa.Table:
        batches: list[pa.RecordBatch] = []
        schema: pa.Schema | None = None
        rows = nbytes = 0
        for values in params if params else [None]:
            try:
                rel = cur.sql(text, params=list(values)) if values is not None else cur.sql(text)
                if rel is None:
                    raise QueryError(f"the query returned no result: {text!r}")
                if limit_zero:
                    rel = rel.limit(0)
                reader = rel.to_arrow_reader(BATCH_ROWS)
                schema = schema or reader.schema
                for batch in reader:
                    rows += batch.num_rows
                    nbytes += batch.get_total_buffer_size()
                    self._check_size(rows, nbytes)
                    batches.append(batch)
            except duckdb.Error as exc:
                raise stop.error(exc) from None
        return pa.Table.from_batches(batches, schema=schema)

    def _check_size(self, rows: int, nbytes: int) -> None:
        c = self.config
        if rows > c.max_result_rows:
            msg = (f"the query's result has more than max_result_rows={c.max_result_rows} rows: aggregate, filter "
                   "or LIMIT it")
            raise LimitExceededError(msg, limit="max_result_rows", value=rows)
        if nbytes > c.max_result_bytes:
            msg = (f"the query's result is larger than max_result_bytes={c.max_result_bytes}: select fewer columns "
                   "or rows")
            raise LimitExceededError(msg, limit="max_result_bytes", value=nbytes)


class _Watchdog:
    """Interrupts a DuckDB connection's query when the deadline passes or the client's call is cancelled."""

    def __init__(self, cur: Any, deadline: float, cancelled: Callable[[], bool], limit_s: float) -> None:
        self._cur = cur
        self._deadline = deadline
        self._cancelled = cancelled
        self._limit_s = limit_s
        self._stop = threading.Event()
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._watch, name="knit-sql-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            if self._cancelled():
                self.reason = "cancelled"
            elif time.monotonic() > self._deadline:
                self.reason = "timeout"
            if self.reason is not None:
                self._cur.interrupt()
                return

    def done(self) -> None:
        self._stop.set()
        self._thread.join()

    def error(self, exc: Exception) -> Exception:
        """The error to raise for DuckDB's ``exc``: why the query was interrupted, or DuckDB's own message."""
        if self.reason == "timeout":
            msg = f"the query ran longer than query_timeout_s={self._limit_s} s and was cancelled"
            return QueryTimeoutError(msg, limit_s=self._limit_s)
        if self.reason == "cancelled":
            return QueryCancelledError("the client cancelled the call; its query was interrupted")
        return QueryError(f"the query failed: {exc}")
