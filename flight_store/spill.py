"""The durable spill log of one store node: framed Arrow IPC records, fsynced before a write returns.

One append-only file, ``<spill_dir>/store.log``. Each record is a frame::

    b"KNIT" | u32 header length | u64 body length | u32 crc32(header + body) | header | body

where the header is a small JSON document (``{"kind": "group", "group_id": ...}``, ``release``,
``images``, ``weights``, ``version``, ...) and the body, when there is one, is an Arrow IPC stream of
the record batches committed. :meth:`SpillLog.append` writes one frame and fsyncs it; the store calls
it under its lock right before it commits in memory, so the log order is the commit order.

Reading it back (:meth:`SpillLog.records`) tells two kinds of damage apart:

* a **torn tail**: the last frame is cut short (its header, or the bytes its lengths announce, run
  past the end of the file; or the file ends in zeros). That is an append a crash interrupted, before
  its fsync, so before anything was acknowledged: it is dropped (the file is cut back to the last
  whole frame) with a warning;
* **corruption**: anything else (a bad magic, a checksum that fails, an unreadable header, inside the
  file or in its last whole frame). Acknowledged records may be lost there, so the node refuses to
  start with :class:`SpillCorruptionError` naming the file, the offset and what is wrong, and never
  truncates. ``recovery="salvage"`` (``StoreConfig.spill_recovery``) keeps every intact frame
  instead: it resynchronises on the next frame whose magic and checksum hold, moves the damaged file
  aside (``store.log.corrupt-<time>``) and writes a new log of the intact frames, logging each
  skipped byte range.

:meth:`SpillLog.rewrite` replaces the whole log atomically (a new file, fsynced, renamed over the old
one): the store's compaction writes only what is live.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias, cast

import pyarrow as pa

log = logging.getLogger(__name__)

MAGIC = b"KNIT"
_FRAME = struct.Struct("<4sIQI")
LOG_NAME = "store.log"
Recovery = Literal["refuse", "salvage"]
"""What a node does with a spill log damaged inside: refuse to start, or keep every intact frame."""


Piece: TypeAlias = bytes | mmap.mmap | pa.Buffer
"""Bytes in any of the forms a store holds them (a stored block is an ``mmap`` or a ``pa.Buffer``)."""
Body: TypeAlias = bytes | Sequence[Piece]
"""A record's body: bytes, or pieces written one after the other (a group's blocks, never joined)."""
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""The end-of-stream marker of the Arrow IPC stream format."""


def stream_of_messages(schema: pa.Schema, messages: Sequence[Piece]) -> list[Piece]:
    """An Arrow IPC stream, as pieces, of encapsulated record batch ``messages`` (``RecordBatch.serialize``).

    The same bytes :func:`encode_batches` writes for those batches, without serializing them again.
    """
    return [schema.serialize(), *messages, _EOS]


def _pieces(body: Body) -> list[Piece]:
    return [body] if isinstance(body, bytes) else list(cast("Sequence[Piece]", body))


def body_size(body: Body) -> int:
    """Bytes of a record body."""
    return sum(memoryview(piece).nbytes for piece in _pieces(body))


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
        >>> spill.append({"kind": "version", "version": 3})  # the frame's bytes
        50
        >>> spill.close()
        >>> again = SpillLog(d)
        >>> [r.header for r in again.records()]
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

    def records(self, *, recovery: Recovery = "refuse") -> list[Frame]:
        """Every intact record, in log order; a torn tail is dropped, corruption refused (see the module)."""
        with self._lock:
            self._file.seek(0)
            data = self._file.read()
        records, end, problem = scan(data)
        if problem is None:
            if end < len(data):
                log.warning("spill log %s: dropping a torn tail of %d bytes at offset %d (an interrupted append); "
                            "%d intact records kept", self.path, len(data) - end, end, len(records))
                self._truncate(end)
            return records
        offset, reason = problem
        if recovery != "salvage":
            msg = (f"spill log {self.path} is corrupt at offset {offset} ({reason}); {len(records)} intact records "
                   f"before it. The node does not start: acknowledged data may be lost there. Inspect the file, or "
                   f"start with spill_recovery='salvage' to keep every intact frame")
            raise SpillCorruptionError(msg, path=str(self.path), offset=offset)
        return self._salvage(data)

    def _salvage(self, data: bytes) -> list[Frame]:
        """Keep every intact frame of a damaged log (resynchronising past damage); the original moves aside."""
        records, skipped = salvage(data)
        aside = self.path.with_name(f"{LOG_NAME}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        for start, stop in skipped:
            log.warning("spill log %s: skipping damaged bytes [%d, %d)", self.path, start, stop)
        os.replace(self.path, aside)
        self.rewrite([(r.header, r.body) for r in records])
        log.warning("spill log %s: salvaged %d intact records; the damaged file is kept as %s", self.path,
                    len(records), aside)
        return records

    def _truncate(self, size: int) -> None:
        with self._lock:
            self._file.truncate(size)
            self._file.flush()
            os.fsync(self._file.fileno())

    def rewrite(self, records: Sequence[tuple[dict[str, Any], Body]]) -> None:
        """Replace the log by ``records``, atomically: a new file, fsynced, renamed over the old one."""
        tmp = self.path.with_name(LOG_NAME + ".tmp")
        with open(tmp, "wb") as f:
            for header, body in records:
                f.writelines(frame_pieces(header, body))
            f.flush()
            os.fsync(f.fileno())
        with self._lock:
            self._file.close()
            os.replace(tmp, self.path)
            _fsync_dir(self.directory)
            self._file = open(self.path, "ab+")  # noqa: SIM115 - kept open for the store's lifetime

    def append(self, header: dict[str, Any], body: Body = b"") -> int:
        """Write one record and fsync it; returns its frame's bytes. On failure the partial frame is cut off
        and the error raised."""
        pieces = frame_pieces(header, body)
        with self._lock:
            self._file.seek(0, os.SEEK_END)
            offset = self._file.tell()
            try:
                self._file.writelines(pieces)
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError:
                log.exception("spill log %s: append failed; cutting back to %d bytes", self.path, offset)
                with contextlib.suppress(OSError):  # the disk is gone: replay drops the torn tail
                    self._file.truncate(offset)
                raise
            return self._file.tell() - offset

    def write_file(self, name: str, header: dict[str, Any], body: Body = b"") -> int:
        """Write one record as the file ``name`` beside the log, atomically (a temporary file, fsynced, renamed
        over any file of that name); returns its bytes. For records too large to copy again at each compaction
        (a weights table), which therefore never enter the log."""
        path = self.directory / name
        tmp = path.with_name(f"{name}.{uuid.uuid4().hex}.tmp")  # two writers of one name never share it
        try:
            with open(tmp, "wb") as f:
                f.writelines(frame_pieces(header, body))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.directory)
        return path.stat().st_size

    def read_files(self, pattern: str, *, recovery: Recovery = "refuse") -> list[tuple[Path, Frame]]:
        """The records of the files written by :meth:`write_file` whose names match ``pattern`` (a glob), by name.

        A file whose one frame is not whole and intact is corruption (it was renamed into place only once
        fsynced): the node refuses to start, naming it, or with ``recovery="salvage"`` moves it aside and
        goes on without it. Leftover temporary files of an interrupted write are removed.
        """
        for tmp in self.directory.glob(pattern + ".*.tmp"):
            tmp.unlink(missing_ok=True)
        out = []
        for path in sorted(self.directory.glob(pattern)):
            data = path.read_bytes()
            record, end, reason = _read_frame(data, 0)
            if record is not None and end == len(data):
                out.append((path, record))
                continue
            msg = f"spill file {path} is corrupt ({reason or 'bytes after its record'})"
            if recovery != "salvage":
                raise SpillCorruptionError(f"{msg}; the node does not start (spill_recovery='salvage' skips it)",
                                           path=str(path), offset=0)
            aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, aside)
            log.warning("%s; skipped (salvage), kept aside as %s", msg, aside)
        return out

    def remove_file(self, name: str) -> None:
        """Remove the file ``name`` beside the log (no error when it is not there)."""
        (self.directory / name).unlink(missing_ok=True)

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


@dataclass(frozen=True, slots=True)
class Frame:
    """One intact frame: where it starts, its header and its body."""

    offset: int
    header: dict[str, Any]
    body: bytes


class SpillCorruptionError(RuntimeError):
    """The spill log is damaged inside (not a torn tail); ``path`` and ``offset`` say where."""

    def __init__(self, message: str, *, path: str, offset: int) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset


def frame_pieces(header: dict[str, Any], body: Body = b"") -> list[Piece]:
    """One record as the pieces of its frame (the body's pieces are not copied)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    pieces = _pieces(body)
    crc = zlib.crc32(head)
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return [_FRAME.pack(MAGIC, len(head), body_size(body), crc) + head, *pieces]


def frame_size(header: dict[str, Any], body: Body = b"") -> int:
    """Bytes of the frame of a record."""
    return _FRAME.size + len(json.dumps(header, separators=(",", ":")).encode()) + body_size(body)


def _read_frame(data: bytes, pos: int) -> tuple[Frame | None, int, str]:
    """The frame at ``pos``: ``(record, end, "")``, or ``(None, pos, reason)`` (reason ``"torn"`` for a cut)."""
    if len(data) - pos < _FRAME.size:
        return None, pos, "torn"
    magic, hlen, blen, crc = _FRAME.unpack_from(data, pos)
    if magic != MAGIC:
        return None, pos, f"bad magic {magic!r}"
    start = pos + _FRAME.size
    end = start + hlen + blen
    if end > len(data):
        return None, pos, "torn"
    if zlib.crc32(data[start:end]) != crc:
        return None, pos, "a checksum mismatch"
    try:
        header = json.loads(data[start:start + hlen])
    except ValueError:
        return None, pos, "an unreadable header"
    return Frame(offset=pos, header=header, body=data[start + hlen:end]), end, ""


def scan(data: bytes) -> tuple[list[Frame], int, tuple[int, str] | None]:
    """The whole frames of ``data`` from its start, where they end, and the first damage that is not a torn tail."""
    records: list[Frame] = []
    pos = 0
    while pos < len(data):
        record, end, reason = _read_frame(data, pos)
        if record is None:
            if reason == "torn" or not data[pos:].strip(b"\0"):  # cut short, or zeros a crash left: not acked
                return records, pos, None
            return records, pos, (pos, reason)
        records.append(record)
        pos = end
    return records, pos, None


def salvage(data: bytes) -> tuple[list[Frame], list[tuple[int, int]]]:
    """Every intact frame of ``data``, resynchronising on the next magic after damage; and the skipped ranges."""
    records: list[Frame] = []
    skipped: list[tuple[int, int]] = []
    pos = 0
    while pos < len(data):
        record, end, _ = _read_frame(data, pos)
        if record is not None:
            records.append(record)
            pos = end
            continue
        nxt = data.find(MAGIC, pos + 1)
        stop = len(data) if nxt < 0 else nxt
        skipped.append((pos, stop))
        pos = stop
    return records, skipped
