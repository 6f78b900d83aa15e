"""What every RPC of the store node does alike: typed errors at the boundary, the bearer-token check, the
descriptor's bytes, and receiving a DoPut's stream against the memory budget.

Used by :class:`flight_store.server.StoreServer`; nothing here knows the store's contents.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from flight_store.errors import KnitError, LimitExceededError, SchemaMismatchError, WireDecodeError, error_info
from flight_store.memory import Incoming
from flight_store.write_slots import Write
from schemas.wire import WireError, WireLimitError

log = logging.getLogger(__name__)
T = TypeVar("T")


def guard(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` and turn any error into one a Flight client receives typed.

    A bug (any other exception) is logged here with its traceback under a short id; the client sees
    only the id, never internal names or the traceback.
    """
    try:
        return fn()
    except WireLimitError as exc:
        raise LimitExceededError(str(exc), limit=exc.limit, value=exc.value) from None
    except WireError as exc:
        raise WireDecodeError(str(exc)) from None
    except (KnitError, flight.FlightError):
        raise
    except Exception:
        incident = secrets.token_hex(4)
        log.exception("%s failed (incident %s)", what, incident)
        msg = f"{what} failed: an internal error (incident {incident}, logged by the node)"
        raise flight.FlightInternalError(msg) from None

class TokenAuthFactory(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    """Refuses every call whose ``authorization`` header is not ``Bearer <token>`` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = b"Bearer " + token.encode()

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[Any]]) -> None:
        values = headers.get("authorization", [])
        for v in values:
            got = v.encode() if isinstance(v, str) else bytes(v)
            if hmac.compare_digest(got, self._expected):
                return None
        what = "no bearer token" if not values else "a wrong bearer token"
        msg = f"unauthenticated: the call to {info.method} carried {what}"
        raise flight.FlightUnauthenticatedError(msg)

def descriptor_bytes(descriptor: flight.FlightDescriptor) -> bytes:
    if descriptor.descriptor_type == flight.DescriptorType.CMD:
        return bytes(descriptor.command)
    path = descriptor.path or []
    if len(path) != 1:
        msg = f"a path descriptor must hold exactly one JSON document, got {len(path)} elements"
        raise WireError(msg)
    return bytes(path[0])

def receive(reader: flight.MetadataRecordBatchReader, write: Write, incoming: Incoming, rows: int | None,
             what: str) -> list[pa.RecordBatch]:
    """The stream's batches, each counted against the budget as it arrives (so an oversized write is refused
    at the batch that makes it too large, not after all of it arrived); ``rows``: the most rows a group
    may send."""
    batches: list[pa.RecordBatch] = []
    got = 0
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            write.touch()
            return batches
        except (OSError, pa.ArrowException) as exc:  # Arrow could not decode the message (a FlightError passes)
            msg = (f"{what}: message {len(batches) + 1} of the stream is not an Arrow IPC record batch of its "
                   f"schema ({exc}); nothing stored")
            raise WireError(msg) from exc
        data = chunk.data  # each access wraps the batch anew
        if data is None or not data.num_rows:  # not a delivery: a stream of empty messages stays idle
            continue
        write.touch()
        incoming.add(data.get_total_buffer_size())  # the buffers received (nbytes costs ~40 us a batch)
        got += data.num_rows
        if rows is not None and got > rows:
            msg = f"{what} declares {rows} rows but its stream carried more; nothing stored"
            raise SchemaMismatchError(msg, column="sample_idx")
        batches.append(data)

def error_json(exc: Exception) -> dict[str, Any]:
    """A refused read's error as a read channel sends it (a project error's JSON; any other Flight error's message)."""
    if isinstance(exc, KnitError):
        return error_info(exc)
    retryable = isinstance(exc, flight.FlightUnavailableError)
    return {"error": type(exc).__name__, "message": str(exc), "retryable": retryable}
