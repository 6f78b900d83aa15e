"""Tiny helpers every benchmark shares: the JSON result file, a wall-clock timer and pyplot."""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_result(
    path: str | Path,
    metrics: Mapping[str, Any],
    ratios: Mapping[str, Any],
    params: Mapping[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """Write ``{"metrics", "ratios", "params", ...extra}`` as JSON to ``path`` (parents created); returns it."""
    doc: dict[str, Any] = {
        "metrics": dict(metrics),
        "ratios": dict(ratios),
        "params": {**params, "python": platform.python_version(), "machine": platform.machine()},
        **extra,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return doc


@contextmanager
def timer() -> Iterator[list[float]]:
    """``with timer() as t: ...`` then ``t[0]`` holds the elapsed seconds."""
    box = [0.0]
    start = time.perf_counter()
    try:
        yield box
    finally:
        box[0] = time.perf_counter() - start


def pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg backend, or ``None`` without matplotlib (plots are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger(__name__).warning("matplotlib not installed (the bench extra); no plot written")
        return None
    return plt
