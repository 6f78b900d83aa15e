"""The errors of the Flight SQL endpoint: project errors (:class:`~flight_store.errors.KnitError`) that cross
the wire as the gRPC status a Flight SQL client maps to its own error kinds.

=========================  ==================  ==============================================
error                      gRPC status         when
=========================  ==================  ==============================================
:class:`ReadOnlyError`     PERMISSION_DENIED   a statement that would change something
:class:`QueryError`        UNKNOWN             DuckDB refused the query (syntax, names, types)
:class:`QueryTimeoutError` DEADLINE_EXCEEDED   the query ran past ``query_timeout_s``
:class:`QueryCancelledError` CANCELLED         the client cancelled the call running it
:class:`UnknownStatementError` UNKNOWN         a ticket or prepared-statement handle not held
:class:`UnsupportedCommandError` UNKNOWN       a Flight SQL command this endpoint does not serve
=========================  ==================  ==============================================

A result over ``max_result_rows`` / ``max_result_bytes`` is :class:`~flight_store.errors.LimitExceededError`,
as every other documented limit of the store.
"""

from __future__ import annotations

import pyarrow.flight as flight

from flight_store.errors import KnitError


class ReadOnlyError(KnitError, flight.FlightUnauthorizedError):
    """The endpoint is read-only: ``statement`` names the kind of statement refused (INSERT, CREATE, SET, ...)."""

    _attrs = ("statement",)
    statement: str | None


class QueryError(KnitError, flight.FlightServerError):
    """The SQL engine refused the query (a syntax error, an unknown table or column, a bad parameter)."""


class QueryTimeoutError(KnitError, flight.FlightTimedOutError):
    """The query ran longer than ``limit_s`` seconds and was interrupted; nothing was returned."""

    _attrs = ("limit_s",)
    limit_s: float | None


class QueryCancelledError(KnitError, flight.FlightCancelledError):
    """The client cancelled the call while its query ran; the query was interrupted."""


class UnknownStatementError(KnitError, flight.FlightServerError):
    """A result ticket or prepared-statement handle this endpoint does not hold (fetched, closed or expired)."""


class UnsupportedCommandError(KnitError, flight.FlightServerError):
    """Bytes that are not a Flight SQL command, or a command this endpoint does not serve (transactions,
    Substrait plans, bulk ingestion); ``command`` names it when known."""

    _attrs = ("command",)
    command: str | None
