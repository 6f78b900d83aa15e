"""A read channel's messages, made and read once per micro-batch (see :class:`~schemas.wire.ReadChannelDescriptor`).

A request is a ``slices`` ticket: :func:`slices_by_hand` makes the checks of :class:`~schemas.wire.SlicesTicket`
by hand on a ticket in canonical JSON (:data:`CANONICAL_JSON`, the form :func:`flight_store.streams.slices_ticket`
writes); any other bytes go to :func:`~schemas.wire.decode_ticket`, which decides and names what is wrong. An
answer ends with :func:`encode_read_end`'s message, which the client parses with :func:`loads_compact`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import repeat
from typing import Any, cast

from schemas.arrow import SCHEMA_VERSION
from schemas.wire import GROUP_ID_MAX_CHARS, LIMITS, MAX_NON_NEG

CANONICAL_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""Compact JSON with UTF-8 as is: the bytes pydantic's ``model_dump_json`` writes for the same document, and the
form clients send requests in (:func:`slices_by_hand` decodes a ticket in this form without the model)."""
_SCAN: Callable[[str, int], tuple[Any, int]] = cast(Any, json.JSONDecoder()).scan_once  # json's C scanner


def loads_compact(raw: bytes) -> Any:
    """``raw``, one UTF-8 JSON value with no whitespace around it, parsed by ``json``'s C scanner in one call
    (``json.loads`` adds three Python frames and an encoding guess, a share of a small read's time on a cold node);
    :class:`ValueError` for anything else. Repeated keys are not detected: the last one wins."""
    text = raw.decode()
    try:
        value, end = _SCAN(text, 0)
    except StopIteration:
        msg = "not a JSON value"
        raise ValueError(msg) from None
    if end != len(text):
        msg = f"data after the JSON value at {end}"
        raise ValueError(msg)
    return value


def encode_read_end(rows: int, metadata: dict[str, str]) -> bytes:
    """The app metadata ending a read channel's answer of ``rows`` rows, ``{"rows": N, "metadata": {...}}`` (the
    ``knittrans.*`` schema metadata its groups share, as a DoGet's schema carries it); a refused request gets one
    metadata-only message ``{"error": {...}}`` (the typed error's JSON) instead."""
    return json.dumps({"rows": rows, "metadata": metadata}).encode()


_SLICES_KEYS = frozenset({"v", "kind", "slices", "columns"})


def slices_by_hand(raw: bytes) -> tuple[list[tuple[str, int, int]], list[str] | None] | None:
    """A ``slices`` ticket in canonical form (:data:`CANONICAL_JSON`) as its ``(group_id, start, stop)`` slices
    and its columns, checked by hand exactly as :class:`~schemas.wire.SlicesTicket` checks it; ``None`` for any other
    bytes, which :func:`~schemas.wire.decode_ticket` then decides on (and names what is wrong).

    Why: a read channel decodes one ticket per micro-batch, and on a node that waited between reads (its
    caches cold) the model's validation is a noticeable share of a read; this costs about half of it
    (figures: docs/benchmarks.md, diagnostic timings). Canonical
    form (the bytes re-encoded are the bytes received) proves no key is repeated, which ``json.loads`` would
    hide. ``tests/test_schemas.py`` holds the two decoders to the same verdicts.
    """
    if len(raw) > LIMITS["ticket_bytes"]:
        return None
    try:
        doc = loads_compact(raw)
    except ValueError:
        return None
    if type(doc) is not dict or doc.get("kind") != "slices" or not doc.keys() <= _SLICES_KEYS:
        return None
    version, slices, columns = doc.get("v"), doc.get("slices"), doc.get("columns")
    if type(version) is not int or version != SCHEMA_VERSION or type(slices) is not list:
        return None
    if not 1 <= len(slices) <= LIMITS["slices_per_ticket"]:
        return None
    if columns is not None and (type(columns) is not list or not all(map(isinstance, columns, repeat(str)))):
        return None
    out = []
    for s in slices:
        if type(s) is not dict or len(s) != 3:
            return None
        group_id, start, stop = s.get("group_id"), s.get("start"), s.get("stop")
        if (type(group_id) is not str or not 1 <= len(group_id) <= GROUP_ID_MAX_CHARS or type(start) is not int
                or type(stop) is not int or not 0 <= start < stop <= MAX_NON_NEG):
            return None
        out.append((group_id, start, stop))
    if CANONICAL_JSON.encode(doc).encode() != raw:
        return None
    return out, columns
