"""The durable spill log of one store node: framed Arrow IPC records, fsynced before a write returns.

One append-only file, ``<spill_dir>/store.log``. Each record is a frame::

    b"KNIT" | u32 header length | u64 body length | u32 crc32(header + body) | header | body

where the header is a small JSON document (``{"kind": "group", "group_id": ...}``, ``release``,
``images``, ``weights``, ``version``) and the body, when there is one, is an Arrow IPC stream of
the record batches committed (empty for ``release`` and ``version``). :meth:`SpillLog.append`
writes one frame and fsyncs it; the store calls it under its lock right before it commits in
memory, so the log order is the commit order (and replaying it assigns the same ``seq``).

:meth:`SpillLog.replay` yields the intact records in order. A torn or corrupt tail (a frame cut
short by a crash, or whose checksum fails) is dropped with a warning and the file is truncated
to the last intact frame, so later appends continue from there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

log = logging.getLogger(__name__)

MAGIC = b"KNIT"
_FRAME = struct.Struct("<4sIQI")
LOG_NAME = "store.log"


def encode_batches(batches: Sequence[pa.RecordBatch], schema: pa.Schema | None = None) -> bytes:
    """``batches`` as one Arrow IPC stream (``b""`` when there are none and no ``schema``)."""
    if not batches and schema is None:
        return b""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema if schema is not None else batches[0].schema) as writer:
        for b in batches:
            writer.write_batch(b)
    return bytes(sink.getvalue())


def decode_batches(body: bytes) -> list[pa.RecordBatch]:
    """The record batches of an IPC stream written by :func:`encode_batches`."""
    if not body:
        return []
    return list(pa.ipc.open_stream(pa.py_buffer(body)))


class SpillLog:
    """An fsynced, append-only log of framed records in ``directory``.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> spill = SpillLog(d)
        >>> spill.append({"kind": "version", "version": 3})
        >>> spill.close()
        >>> again = SpillLog(d)
        >>> [h for h, _ in again.replay()]
        [{'kind': 'version', 'version': 3}]
        >>> again.close()
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / LOG_NAME
        created = not self.path.exists()
        self._file = open(self.path, "ab+")  # noqa: SIM115 - kept open for the store's lifetime
        self._lock = threading.Lock()
        if created:
            _fsync_dir(self.directory)

    def replay(self) -> Iterator[tuple[dict[str, Any], bytes]]:
        """Yield ``(header, body)`` of every intact record; drop (truncate) a torn or corrupt tail."""
        with self._lock:
            self._file.seek(0)
            data = self._file.read()
        pos = 0
        good = 0
        records: list[tuple[dict[str, Any], bytes]] = []
        reason = ""
        while pos < len(data):
            if len(data) - pos < _FRAME.size:
                reason = "a frame header cut short"
                break
            magic, hlen, blen, crc = _FRAME.unpack_from(data, pos)
            if magic != MAGIC:
                reason = f"bad magic {magic!r}"
                break
            start = pos + _FRAME.size
            end = start + hlen + blen
            if end > len(data):
                reason = f"a frame of {hlen + blen} bytes cut short at {len(data) - start}"
                break
            if zlib.crc32(data[start:end]) != crc:
                reason = "a checksum mismatch"
                break
            try:
                header = json.loads(data[start : start + hlen])
            except ValueError:
                reason = "an unreadable header"
                break
            records.append((header, data[start + hlen : end]))
            pos = good = end
        if good < len(data):
            log.warning(
                "spill log %s: dropping a torn tail of %d bytes at offset %d (%s); %d intact records kept",
                self.path, len(data) - good, good, reason, len(records),
            )
            with self._lock:
                self._file.truncate(good)
                self._file.flush()
                os.fsync(self._file.fileno())
        yield from records

    def append(self, header: dict[str, Any], body: bytes = b"") -> None:
        """Write one record and fsync it; on failure the partial frame is cut off and the error raised."""
        head = json.dumps(header, separators=(",", ":")).encode()
        frame = _FRAME.pack(MAGIC, len(head), len(body), zlib.crc32(head + body)) + head + body
        with self._lock:
            self._file.seek(0, os.SEEK_END)
            offset = self._file.tell()
            try:
                self._file.write(frame)
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError:
                log.exception("spill log %s: append failed; cutting back to %d bytes", self.path, offset)
                with contextlib.suppress(OSError):  # the disk is gone: replay drops the torn tail
                    self._file.truncate(offset)
                raise

    def close(self) -> None:
        """Close the file (appends after this fail)."""
        with self._lock:
            self._file.close()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
