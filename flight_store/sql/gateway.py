"""The Flight SQL gateway: one server any Flight SQL client (ADBC, JDBC, DBeaver, Grafana, polars) queries for
the trajectory metadata of a whole store cluster (``knit sql``).

It is a client of the store nodes like any other (:class:`~flight_store.reading.StoreReader`): it reads
their metadata (:mod:`flight_store.sql.tables`) and answers SQL over it with DuckDB
(:mod:`flight_store.sql.engine`), in its own process, so query CPU and memory never compete with the
nodes' write path. Each RPC decodes its Flight SQL command (:mod:`flight_store.sql.protocol`), calls the
engine or the catalog, and encodes the answer:

=================  ==============================================================================
RPC                Flight SQL commands served
=================  ==============================================================================
GetFlightInfo      ``CommandStatementQuery``, ``CommandPreparedStatementQuery`` (the query runs here,
                   bounded; its result waits under the returned ticket), ``CommandGetSqlInfo``,
                   ``CommandGetCatalogs``, ``CommandGetDbSchemas``, ``CommandGetTables``,
                   ``CommandGetTableTypes``, ``CommandGetPrimaryKeys`` (none: always empty)
GetSchema          the same commands, without running a query
DoGet              ``TicketStatementQuery``: the result, streamed as record batches
DoPut              ``CommandPreparedStatementQuery``: bind parameters; updates and ingestion are refused
DoAction           ``CreatePreparedStatement``, ``ClosePreparedStatement``, ``CancelFlightInfo``,
                   ``CancelQuery``
=================  ==============================================================================

Security is the store nodes': ``grpc+tls://`` with ``tls_cert_file``/``tls_key_file``, and with
``auth_token_file`` every call must carry ``authorization: Bearer <token>``
(:class:`~flight_store.rpc.TokenAuthFactory`, the same check the nodes run).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from flight_store.node import serve_until_signalled
from flight_store.reading import StoreReader
from flight_store.rpc import TokenAuthFactory, guard
from flight_store.secrets import read_public, read_secret, read_token_file
from flight_store.sql import protocol
from flight_store.sql.config import SqlConfig
from flight_store.sql.engine import SqlEngine, read_only_statement, statement_parameters
from flight_store.sql.errors import QueryError, ReadOnlyError, UnsupportedCommandError
from flight_store.sql.statements import Held, Prepared
from flight_store.sql.tables import CATALOG, SCHEMA, VIEWS, Snapshots

TABLE_TYPE = "TABLE"
MAX_PARAM_ROWS = 1024
"""Most parameter rows one DoPut may bind (each runs the statement once)."""
CANCEL_STATUS_CANCELLED = 1
"""``CancelStatus.CANCEL_STATUS_CANCELLED`` of Flight's ``CancelFlightInfoResult``."""

_SERVED = ("CommandStatementQuery", "CommandPreparedStatementQuery", "CommandGetSqlInfo", "CommandGetCatalogs",
           "CommandGetDbSchemas", "CommandGetTables", "CommandGetTableTypes", "CommandGetPrimaryKeys")
ACTIONS = {
    "CreatePreparedStatement": "prepare a read-only query (ActionCreatePreparedStatementRequest)",
    "ClosePreparedStatement": "let go of a prepared statement (ActionClosePreparedStatementRequest)",
    "CancelFlightInfo": "drop a result not fetched yet (CancelFlightInfoRequest)",
    "CancelQuery": "drop a result not fetched yet (ActionCancelQueryRequest, the older form)",
}


def _version() -> str:
    try:
        return importlib.metadata.version("knittrans")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class SqlGateway(flight.FlightServerBase):
    """A Flight SQL server over the metadata of the store nodes ``config.stores``.

    The server listens as soon as it is constructed (port 0 picks a free port: read :attr:`location`).

    Example:
        >>> from flight_store.server import StoreServer
        >>> import adbc_driver_flightsql.dbapi as flightsql
        >>> with StoreServer() as node, SqlGateway(SqlConfig(stores=[node.location])) as gateway:
        ...     with flightsql.connect(gateway.location, autocommit=True) as conn, conn.cursor() as cur:
        ...         _ = cur.execute("SELECT count(*) FROM trajectories")
        ...         cur.fetchone()
        (0,)
    """

    def __init__(self, config: SqlConfig) -> None:
        kwargs: dict[str, Any] = {}
        if config.tls_cert_file is not None and config.tls_key_file is not None:
            kwargs["tls_certificates"] = [
                flight.CertKeyPair(read_public(config.tls_cert_file), read_secret(config.tls_key_file, "TLS key"))]
        if config.auth_token_file is not None:
            kwargs["middleware"] = {"knit_auth": TokenAuthFactory(read_token_file(config.auth_token_file))}
        self.config = config
        self.engine = SqlEngine(config)
        self._reader = StoreReader.from_config(config.stores, config.client)
        self.snapshots = Snapshots(self._reader, config.snapshot_max_age_s)
        """The nodes' metadata as the queries see it (read again when older than ``snapshot_max_age_s``)."""
        self._held = Held(config.max_handles, config.handle_ttl_s)
        super().__init__(f"{config.scheme}://{config.host}:{config.port}", **kwargs)
        self.location = f"{config.scheme}://{config.host}:{self.port}"
        """Where clients connect (the real port when configured with port 0)."""

    # ---- GetFlightInfo / GetSchema / DoGet -----------------------------------------------------

    def get_flight_info(self, context: flight.ServerCallContext,
                        descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        def run() -> flight.FlightInfo:
            name, cmd = protocol.unpack(_command(descriptor), "the FlightDescriptor's command")
            table = self._answer(name, cmd, context.is_cancelled)
            ticket = protocol.pack(protocol.make("TicketStatementQuery", statement_handle=self._held.put(table)))
            return flight.FlightInfo(table.schema, descriptor, [flight.FlightEndpoint(ticket, [])], table.num_rows,
                                     table.nbytes)

        return guard("GetFlightInfo", run)

    def get_schema(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor) -> flight.SchemaResult:
        def run() -> flight.SchemaResult:
            name, cmd = protocol.unpack(_command(descriptor), "the FlightDescriptor's command")
            if name == "CommandStatementQuery":
                return flight.SchemaResult(self.engine.schema(cmd.query, self.snapshots.get()))
            if name == "CommandPreparedStatementQuery":
                query = self._held.prepared(cmd.prepared_statement_handle).query
                return flight.SchemaResult(self.engine.schema(query, self.snapshots.get()))
            return flight.SchemaResult(self._answer(name, cmd, context.is_cancelled).schema)

        return guard("GetSchema", run)

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.RecordBatchStream:
        def run() -> flight.RecordBatchStream:
            name, cmd = protocol.unpack(ticket.ticket, "the ticket")
            if name != "TicketStatementQuery":
                raise UnsupportedCommandError(f"DoGet reads a TicketStatementQuery, got a {name}", command=name)
            return flight.RecordBatchStream(self._held.result(cmd.statement_handle))

        return guard("DoGet", run)

    def _answer(self, name: str, cmd: Any, cancelled: Callable[[], bool]) -> pa.Table:
        """The table answering the command ``name``: a query's result, or a catalog answer."""
        if name == "CommandStatementQuery":
            return self.engine.run(cmd.query, self.snapshots.get(), cancelled=cancelled)
        if name == "CommandPreparedStatementQuery":
            prepared = self._held.prepared(cmd.prepared_statement_handle)
            return self.engine.run(prepared.query, self.snapshots.get(), prepared.params, cancelled)
        if name == "CommandGetSqlInfo":
            return self._sql_info(list(cmd.info))
        if name == "CommandGetCatalogs":
            return pa.table({"catalog_name": [CATALOG]}, schema=protocol.CATALOGS_SCHEMA)
        if name == "CommandGetDbSchemas":
            keep = _matches(cmd, "catalog", CATALOG) and _like(cmd, "db_schema_filter_pattern", SCHEMA)
            rows = [{"catalog_name": CATALOG, "db_schema_name": SCHEMA}] if keep else []
            return pa.Table.from_pylist(rows, schema=protocol.DB_SCHEMAS_SCHEMA)
        if name == "CommandGetTables":
            return self._tables(cmd)
        if name == "CommandGetTableTypes":
            return pa.table({"table_type": [TABLE_TYPE]}, schema=protocol.TABLE_TYPES_SCHEMA)
        if name == "CommandGetPrimaryKeys":
            return protocol.KEYS_SCHEMA.empty_table()
        msg = f"this endpoint does not serve {name} (it serves {', '.join(_SERVED)})"
        raise UnsupportedCommandError(msg, command=name)

    def _tables(self, cmd: Any) -> pa.Table:
        keep = (_matches(cmd, "catalog", CATALOG) and _like(cmd, "db_schema_filter_pattern", SCHEMA)
                and (not cmd.table_types or TABLE_TYPE in cmd.table_types))
        names = [n for n in VIEWS if keep and _like(cmd, "table_name_filter_pattern", n)]
        rows: list[dict[str, Any]] = [{"catalog_name": CATALOG, "db_schema_name": SCHEMA, "table_name": n,
                                       "table_type": TABLE_TYPE} for n in names]
        if not cmd.include_schema:
            return pa.Table.from_pylist(rows, schema=protocol.TABLES_SCHEMA)
        schemas = self.engine.table_schemas(self.snapshots.get()) if names else {}
        for row in rows:
            row["table_schema"] = schemas[row["table_name"]].serialize().to_pybytes()
        return pa.Table.from_pylist(rows, schema=protocol.TABLES_WITH_SCHEMA)

    def _sql_info(self, wanted: list[int]) -> pa.Table:
        info: dict[int, str | bool | int | list[str]] = {
            0: "knittrans", 1: _version(), 2: pa.__version__,
            3: True,  # FLIGHT_SQL_SERVER_READ_ONLY
            4: True,  # FLIGHT_SQL_SERVER_SQL
            5: False,  # FLIGHT_SQL_SERVER_SUBSTRAIT
            8: 0,  # FLIGHT_SQL_SERVER_TRANSACTION: none
            9: True,  # FLIGHT_SQL_SERVER_CANCEL
            100: int(self.config.handle_ttl_s * 1000),  # FLIGHT_SQL_SERVER_STATEMENT_TIMEOUT (ms)
            500: False, 501: False, 502: False,  # SQL_DDL_CATALOG / _SCHEMA / _TABLE
            503: 1,  # SQL_IDENTIFIER_CASE: case-insensitive
            504: '"',  # SQL_IDENTIFIER_QUOTE_CHAR
            531: "catalog", 529: "schema",  # SQL_CATALOG_TERM, SQL_SCHEMA_TERM
        }
        return protocol.sql_info_table({k: v for k, v in info.items() if not wanted or k in wanted})

    # ---- DoPut ---------------------------------------------------------------------------------

    def do_put(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader, writer: flight.FlightMetadataWriter) -> None:
        def run() -> None:
            name, cmd = protocol.unpack(_command(descriptor), "the FlightDescriptor's command")
            if name == "CommandPreparedStatementQuery":
                writer.write(self._bind(cmd.prepared_statement_handle, reader))
                return
            if name == "CommandStatementUpdate":
                read_only_statement(cmd.query)  # a statement that changes something is refused, naming its type
                msg = "this Flight SQL endpoint is read-only: run a SELECT as a query (execute), not as an update"
                raise QueryError(msg)
            what = {"CommandPreparedStatementUpdate": "prepared updates", "CommandStatementIngest": "bulk ingestion"}
            if name in what:
                msg = f"this Flight SQL endpoint is read-only: it refuses {what[name]} ({name})"
                raise ReadOnlyError(msg, statement=name)
            raise UnsupportedCommandError(f"DoPut does not serve {name}", command=name)

        guard("DoPut", run)

    def _bind(self, handle: bytes, reader: flight.MetadataRecordBatchReader) -> pa.Buffer:
        """Bind the parameter rows ``reader`` carries to the prepared statement ``handle`` (positional, by column
        order); the answer is a ``DoPutPreparedStatementResult`` naming the same handle."""
        prepared = self._held.prepared(handle)
        rows: list[list[Any]] = []
        for chunk in reader:
            if chunk.data is None:
                continue
            columns = chunk.data.to_pydict().values()
            rows.extend([list(r) for r in zip(*columns, strict=True)] if columns else [[]] * chunk.data.num_rows)
            if len(rows) > MAX_PARAM_ROWS:
                msg = f"a prepared statement takes at most {MAX_PARAM_ROWS} parameter rows per execution"
                raise QueryError(msg)
        prepared.params = rows or None
        result = protocol.make("DoPutPreparedStatementResult", prepared_statement_handle=handle)
        return pa.py_buffer(result.SerializeToString())

    # ---- DoAction ------------------------------------------------------------------------------

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return list(ACTIONS.items())

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator[bytes]:
        body = action.body.to_pybytes() if action.body is not None else b""
        return iter(guard(f"action {action.type!r}", lambda: self._act(action.type, body)))

    def _act(self, kind: str, body: bytes) -> list[bytes]:
        if kind == "CreatePreparedStatement":
            _, request = protocol.unpack(body, "the CreatePreparedStatement body")
            read_only_statement(request.query)
            params = statement_parameters(request.query)
            dataset = b""
            if not params:  # a parameterized query's result types are known once its values are
                dataset = self.engine.schema(request.query, self.snapshots.get()).serialize().to_pybytes()
            handle = self._held.put(Prepared(query=request.query))
            result = protocol.make("ActionCreatePreparedStatementResult", prepared_statement_handle=handle,
                                   dataset_schema=dataset, parameter_schema=params.serialize().to_pybytes())
            return [protocol.pack(result)]
        if kind == "ClosePreparedStatement":
            _, request = protocol.unpack(body, "the ClosePreparedStatement body")
            self._held.drop(request.prepared_statement_handle)
            return []
        if kind in ("CancelFlightInfo", "CancelQuery"):
            request = (protocol.parse("CancelFlightInfoRequest", body) if kind == "CancelFlightInfo"
                       else protocol.unpack(body, "the CancelQuery body")[1])
            for endpoint in flight.FlightInfo.deserialize(request.info).endpoints:
                _, ticket = protocol.unpack(endpoint.ticket.ticket, "the ticket")
                self._held.drop(ticket.statement_handle)
            if kind == "CancelFlightInfo":
                return [protocol.make("CancelFlightInfoResult", status=CANCEL_STATUS_CANCELLED).SerializeToString()]
            return [protocol.pack(protocol.make("ActionCancelQueryResult", result=protocol.CANCEL_RESULT_CANCELLED))]
        msg = f"this endpoint does not serve the action {kind!r} (it serves {', '.join(ACTIONS)})"
        raise UnsupportedCommandError(msg, command=kind)

    # ---- lifetime ------------------------------------------------------------------------------

    def __enter__(self) -> SqlGateway:
        return self

    def shutdown(self) -> None:
        """Stop serving, then close the connections to the store nodes."""
        super().shutdown()
        self._reader.close()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def serve(config: SqlConfig) -> int:
    """Run the gateway as ``config`` says until SIGINT/SIGTERM (``knit sql``); returns the exit code.

    Prints ``knit sql: listening on <location>`` once it serves, and ``knit sql: stopped`` after a clean stop.
    Must run in the main thread (it installs signal handlers).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.nice(config.nice)  # before DuckDB starts its threads: they inherit it
    try:
        gateway = SqlGateway(config)
    except (PermissionError, OSError, ValueError) as exc:
        print(f"knit sql: cannot start: {exc}", file=sys.stderr, flush=True)
        return 2
    serve_until_signalled("sql", [f"listening on {gateway.location}"], gateway.shutdown)
    return 0


def _command(descriptor: flight.FlightDescriptor) -> bytes:
    if descriptor.descriptor_type != flight.DescriptorType.CMD:
        raise UnsupportedCommandError("a Flight SQL request is a command descriptor, got a path", command=None)
    return bytes(descriptor.command)


def _matches(cmd: Any, field: str, value: str) -> bool:
    """Whether the optional exact-name filter ``field`` of ``cmd`` (absent = any) admits ``value``."""
    return not cmd.HasField(field) or getattr(cmd, field) == value


def _like(cmd: Any, field: str, value: str) -> bool:
    """Whether the optional SQL LIKE pattern ``field`` of ``cmd`` (``%``: any run, ``_``: one character; absent =
    any) matches ``value``."""
    if not cmd.HasField(field):
        return True
    pattern = "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in getattr(cmd, field))
    return re.fullmatch(pattern, value) is not None
