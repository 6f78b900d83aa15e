"""The Flight SQL wire: the protobuf messages a Flight SQL client sends, and the Arrow schemas of its catalog answers.

Flight SQL (Arrow's ``FlightSql.proto``, package ``arrow.flight.protocol.sql``) rides on plain Flight: a
command is a protobuf message packed in a ``google.protobuf.Any`` and carried as a ``FlightDescriptor``'s
command, an ``Action``'s body or a ``Ticket``. The messages this endpoint reads or writes are declared
here field for field (the numbers and types of ``FlightSql.proto``) and built by protobuf itself
(:data:`MESSAGES`), in a descriptor pool of their own; :func:`unpack` reads an ``Any`` and names what it
cannot read. ``optional`` fields are declared with proto2 labels: the same bytes on the wire as proto3's
``optional``, with presence (``HasField``).

The catalog answers have fixed schemas (:data:`CATALOGS_SCHEMA`, :data:`DB_SCHEMAS_SCHEMA`,
:data:`TABLES_SCHEMA`, :data:`TABLE_TYPES_SCHEMA`, :data:`SQL_INFO_SCHEMA`), as the protocol defines them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message, message_factory

from flight_store.sql.errors import UnsupportedCommandError

PACKAGE = "arrow.flight.protocol.sql"
TYPE_URL_PREFIX = "type.googleapis.com/"

_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {"string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "bool": _F.TYPE_BOOL, "int32": _F.TYPE_INT32,
          "uint32": _F.TYPE_UINT32, "int64": _F.TYPE_INT64}
_LABELS = {"": _F.LABEL_OPTIONAL, "optional": _F.LABEL_OPTIONAL, "repeated": _F.LABEL_REPEATED}

FIELDS: dict[str, list[tuple[str, int, str]]] = {
    # catalog requests (GetFlightInfo / GetSchema)
    "CommandGetSqlInfo": [("info", 1, "repeated uint32")],
    "CommandGetXdbcTypeInfo": [("data_type", 1, "optional int32")],
    "CommandGetCatalogs": [],
    "CommandGetDbSchemas": [("catalog", 1, "optional string"), ("db_schema_filter_pattern", 2, "optional string")],
    "CommandGetTables": [("catalog", 1, "optional string"), ("db_schema_filter_pattern", 2, "optional string"),
                         ("table_name_filter_pattern", 3, "optional string"), ("table_types", 4, "repeated string"),
                         ("include_schema", 5, "bool")],
    "CommandGetTableTypes": [],
    "CommandGetPrimaryKeys": [("catalog", 1, "optional string"), ("db_schema", 2, "optional string"),
                              ("table", 3, "string")],
    # statements
    "CommandStatementQuery": [("query", 1, "string"), ("transaction_id", 2, "optional bytes")],
    "CommandStatementUpdate": [("query", 1, "string"), ("transaction_id", 2, "optional bytes")],
    "CommandStatementSubstraitPlan": [],  # recognised only to be refused by name
    "CommandStatementIngest": [],  # recognised only to be refused by name
    "TicketStatementQuery": [("statement_handle", 1, "bytes")],
    "CommandPreparedStatementQuery": [("prepared_statement_handle", 1, "bytes")],
    "CommandPreparedStatementUpdate": [("prepared_statement_handle", 1, "bytes")],
    "DoPutUpdateResult": [("record_count", 1, "int64")],
    "DoPutPreparedStatementResult": [("prepared_statement_handle", 1, "optional bytes")],
    # actions
    "ActionCreatePreparedStatementRequest": [("query", 1, "string"), ("transaction_id", 2, "optional bytes")],
    "ActionCreatePreparedStatementResult": [("prepared_statement_handle", 1, "bytes"), ("dataset_schema", 2, "bytes"),
                                            ("parameter_schema", 3, "bytes")],
    "ActionClosePreparedStatementRequest": [("prepared_statement_handle", 1, "bytes")],
    "ActionCancelQueryRequest": [("info", 1, "bytes")],  # a serialized FlightInfo
    "ActionCancelQueryResult": [("result", 1, "int32")],  # enum CancelResult
    # Flight's own CancelFlightInfo action (package arrow.flight.protocol; sent bare, not in an Any)
    "CancelFlightInfoRequest": [("info", 1, "bytes")],  # a serialized FlightInfo
    "CancelFlightInfoResult": [("status", 1, "int32")],  # enum CancelStatus
}
"""Message -> ``(field, number, "[label] type")`` as ``FlightSql.proto`` declares them (enums as int32, which
is how they travel)."""

CANCEL_RESULT_CANCELLED = 1
"""``ActionCancelQueryResult.CancelResult.CANCEL_RESULT_CANCELLED`` (the value ``CancelFlightInfo`` shares)."""


def _build() -> dict[str, type[message.Message]]:
    proto = descriptor_pb2.FileDescriptorProto(name="knittrans_flight_sql.proto", package=PACKAGE, syntax="proto2")
    for name, fields in FIELDS.items():
        msg = proto.message_type.add(name=name)
        for field, number, spec in fields:
            label, _, kind = spec.rpartition(" ")
            msg.field.add(name=field, number=number, type=_TYPES[kind], label=_LABELS[label])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in FIELDS}


MESSAGES: dict[str, type[message.Message]] = _build()
"""Message name -> its protobuf class."""


def make(name: str, **fields: Any) -> Any:
    """A ``name`` message with ``fields`` set."""
    return MESSAGES[name](**fields)


def pack(msg: message.Message) -> bytes:
    """``msg`` packed in an ``Any`` and serialized: a command, ticket or action body as Flight SQL sends it."""
    wrapper = any_pb2.Any()
    wrapper.Pack(msg)
    return wrapper.SerializeToString()


def unpack(data: bytes, what: str) -> tuple[str, Any]:
    """``(message name, message)`` of a packed command; ``what`` names the carrier in the error.

    Raises:
        UnsupportedCommandError: the bytes are not an ``Any``, or it holds a message of another protocol.
    """
    wrapper = any_pb2.Any()
    try:
        wrapper.ParseFromString(data)
    except message.DecodeError:
        msg = f"{what} is not a Flight SQL command (a protobuf Any): {len(data)} bytes that do not parse"
        raise UnsupportedCommandError(msg, command=None) from None
    full = wrapper.type_url.removeprefix(TYPE_URL_PREFIX)
    name = full.removeprefix(PACKAGE + ".")
    if full == name or name not in MESSAGES:
        msg = f"{what} holds {wrapper.type_url or 'no type'!r}, not a Flight SQL command this endpoint reads"
        raise UnsupportedCommandError(msg, command=wrapper.type_url or None)
    out = MESSAGES[name]()
    try:
        out.ParseFromString(wrapper.value)
    except message.DecodeError:
        msg = f"{what} holds a {name} whose bytes do not parse"
        raise UnsupportedCommandError(msg, command=name) from None
    return name, out


def parse(name: str, data: bytes) -> Any:
    """A bare (not ``Any``-packed) ``name`` message from ``data``."""
    out = MESSAGES[name]()
    out.ParseFromString(data)
    return out


# ---- catalog answers -----------------------------------------------------------------------------

CATALOGS_SCHEMA = pa.schema([pa.field("catalog_name", pa.string(), nullable=False)])
DB_SCHEMAS_SCHEMA = pa.schema([pa.field("catalog_name", pa.string()),
                               pa.field("db_schema_name", pa.string(), nullable=False)])
TABLES_SCHEMA = pa.schema([pa.field("catalog_name", pa.string()), pa.field("db_schema_name", pa.string()),
                           pa.field("table_name", pa.string(), nullable=False),
                           pa.field("table_type", pa.string(), nullable=False)])
TABLES_WITH_SCHEMA = TABLES_SCHEMA.append(pa.field("table_schema", pa.binary(), nullable=False))
TABLE_TYPES_SCHEMA = pa.schema([pa.field("table_type", pa.string(), nullable=False)])
KEYS_SCHEMA = pa.schema([pa.field("catalog_name", pa.string()), pa.field("db_schema_name", pa.string()),
                         pa.field("table_name", pa.string(), nullable=False),
                         pa.field("column_name", pa.string(), nullable=False), pa.field("key_name", pa.string()),
                         pa.field("key_sequence", pa.int32(), nullable=False)])
"""``CommandGetPrimaryKeys``' answer (the tables here have no keys: always empty)."""

_SQL_INFO_VALUE = pa.dense_union([
    pa.field("string_value", pa.string()),
    pa.field("bool_value", pa.bool_()),
    pa.field("bigint_value", pa.int64()),
    pa.field("int32_bitmask", pa.int32()),
    pa.field("string_list", pa.list_(pa.string())),
    pa.field("int32_to_int32_list_map", pa.map_(pa.int32(), pa.list_(pa.int32()))),
])
SQL_INFO_SCHEMA = pa.schema([pa.field("info_name", pa.uint32(), nullable=False),
                             pa.field("value", _SQL_INFO_VALUE, nullable=False)])


def sql_info_table(values: Mapping[int, str | bool | int | list[str]]) -> pa.Table:
    """``CommandGetSqlInfo``'s answer: one row per info id, its value in the union's member for its Python type
    (``int``: ``int32_bitmask``, which is what every integer info the protocol defines is)."""
    ids = sorted(values)
    members: list[list[Any]] = [[], [], [], [], []]
    codes, offsets = [], []
    for i in ids:
        v = values[i]
        code = 1 if isinstance(v, bool) else 0 if isinstance(v, str) else 4 if isinstance(v, list) else 3
        codes.append(code)
        offsets.append(len(members[code]))
        members[code].append(v)
    children = [pa.array(members[0], pa.string()), pa.array(members[1], pa.bool_()), pa.array([], pa.int64()),
                pa.array(members[3], pa.int32()), pa.array(members[4], pa.list_(pa.string())),
                pa.array([], pa.map_(pa.int32(), pa.list_(pa.int32())))]
    union = pa.UnionArray.from_dense(pa.array(codes, pa.int8()), pa.array(offsets, pa.int32()), children,
                                     [f.name for f in _SQL_INFO_VALUE], list(range(6)))
    return pa.Table.from_arrays([pa.array(ids, pa.uint32()), union], schema=SQL_INFO_SCHEMA)
