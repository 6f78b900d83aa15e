"""A minimal pyarrow Flight server: the floor a Flight write or read of the same batches cannot go below.

DoPut reads the stream and keeps its batches under the descriptor's command (no validation, no
copy, no metadata). DoGet takes a JSON ticket ``[[key, start, stop], ...]`` and streams those row
ranges of the kept batches as zero-copy slices, in order. DoExchange is the same read without a call
per read: each metadata-only message the client sends is such a ticket, answered by its rows, the
last batch marked (:func:`open_channel`, :func:`send`, :func:`receive`). It runs in a process of its
own (:func:`start`), as the store nodes it is compared with do.

With ``own_pages`` its DoPut copies each received batch into memory of its own, as a store node does
(:func:`flight_store.blocks.pack`: one block in pages of its own, the received message let go), and
does nothing else: the floor of a write for a store that owns its memory, without a rule check or
an index (a diagnostic of ``bench.write_path``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from flight_store.blocks import Block, pack, view
from flight_store.net import free_port


class MinimalFlight(flight.FlightServerBase):  # type: ignore[misc]
    """Keeps what DoPut sends (``own_pages``: a copy in pages of its own); DoGet streams row ranges of it. Nothing
    else."""

    def __init__(self, location: str, *, own_pages: bool = False) -> None:
        super().__init__(location)
        self.own_pages = own_pages
        self.kept: dict[bytes, pa.Table | tuple[pa.Schema, list[Block]]] = {}

    def do_put(self, context: Any, descriptor: flight.FlightDescriptor, reader: Any, writer: Any) -> None:
        batches = [chunk.data for chunk in reader]
        self.kept[descriptor.command] = ((reader.schema, [pack(b)[0] for b in batches]) if self.own_pages
                                         else pa.Table.from_batches(batches))
        writer.write(pa.py_buffer(b"{}"))

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        return flight.RecordBatchStream(self._rows(ticket.ticket))

    def do_exchange(self, context: Any, descriptor: flight.FlightDescriptor, reader: Any, writer: Any) -> None:
        began = False
        for chunk in reader:  # until the client half-closes
            batches = self._rows(chunk.app_metadata.to_pybytes()).to_batches()
            if not began:
                writer.begin(batches[0].schema)
                began = True
            for batch in batches[:-1]:
                writer.write_batch(batch)
            writer.write_with_metadata(batches[-1], b"end")

    def _rows(self, ticket: bytes) -> pa.Table:
        return pa.concat_tables([self._table(key.encode()).slice(start, stop - start)
                                 for key, start, stop in json.loads(ticket)])

    def _table(self, key: bytes) -> pa.Table:
        kept = self.kept[key]
        if isinstance(kept, pa.Table):
            return kept
        schema, blocks = kept
        return pa.Table.from_batches([view(block, schema) for block in blocks], schema=schema)


def start(*, own_pages: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """The server (``own_pages``: see the module's docstring) in a process of its own on a loopback port; returns
    the process and its location."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.minimal_flight", str(port), *(["--own-pages"] * own_pages)])
    location = f"grpc://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            client = flight.connect(location)
            client.wait_for_available(timeout=1)
            client.close()
            return proc, location
        except flight.FlightError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the minimal Flight server did not start within 30 s")


def put(client: flight.FlightClient, key: str, data: pa.RecordBatch | pa.Table) -> None:
    """One DoPut of ``data`` under ``key``, waiting for the server's answer."""
    writer, reader = client.do_put(flight.FlightDescriptor.for_command(key.encode()), data.schema)
    if isinstance(data, pa.Table):
        writer.write_table(data)
    else:
        writer.write_batch(data)
    writer.done_writing()
    reader.read()
    writer.close()


def get(client: flight.FlightClient, ranges: list[tuple[str, int, int]]) -> pa.Table:
    """One DoGet of the row ranges ``[(key, start, stop), ...]``, in order."""
    return client.do_get(flight.Ticket(json.dumps(ranges).encode())).read_all()


def open_channel(client: flight.FlightClient) -> tuple[Any, Any]:
    """A DoExchange to read row ranges on, one request after another (its writer and reader)."""
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(b"reads"))
    writer.begin(pa.schema([]))
    return writer, reader


def send(channel: tuple[Any, Any], ranges: list[tuple[str, int, int]]) -> None:
    """Ask ``channel`` for the row ranges ``[(key, start, stop), ...]``."""
    channel[0].write_metadata(json.dumps(ranges).encode())


def receive(channel: tuple[Any, Any]) -> pa.Table:
    """The rows of the request sent last on ``channel``."""
    batches = []
    while True:
        chunk = channel[1].read_chunk()
        batches.append(chunk.data)
        if chunk.app_metadata is not None:
            return pa.Table.from_batches(batches)


if __name__ == "__main__":
    MinimalFlight(f"grpc://127.0.0.1:{int(sys.argv[1])}", own_pages="--own-pages" in sys.argv[2:]).serve()
