"""The driver's step loop of the peers benchmark: every path's train steps, the paths taking turns.

Each path is a :data:`StepFn` that runs one train step on every rank and returns the ranks' records. At each
compute value the paths take turns step by step, in a rotating order (so no path is always first after
another's step), and the first step of each (path, compute) is a warm-up that computes nothing and is not
recorded. The text cells (:mod:`bench.peers.harness`) and the multimodal cells (:mod:`bench.peers.mm`) both
run their paths through it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.peers.common import MicroSpec

log = logging.getLogger(__name__)

StepFn = Callable[[int, list[list[MicroSpec]], float], list[dict[str, Any]]]
"""One path's train step: ``(step, per-rank micro-batches, compute ms per 1k tokens) -> per-rank records``
(``start``, ``first_wait_s``, ``wait_s``, ``tokens``, ``bytes``, optionally ``encoder_passes``)."""


def steps_in_turn(steppers: dict[str, StepFn], specs: list[list[list[MicroSpec]]],
           computes: Sequence[float]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every path's train steps at every compute value, paths taking turns; records without warm-ups."""
    names = list(steppers)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in names}
    for c in computes:
        for s, per_rank in enumerate(specs):
            k = s % len(names)
            for name in names[k:] + names[:k]:
                t_wall = time.time()
                t0 = time.perf_counter()
                ranks = steppers[name](s, per_rank, c if s else 0.0)  # the warm-up step computes nothing
                step_s = time.perf_counter() - t0
                if s == 0:
                    continue  # warm-up
                out[name].setdefault(f"{c:g}", []).append({
                    "step_s": step_s,
                    "first_wait_s": max(r["start"] - t_wall + r["first_wait_s"] for r in ranks),
                    "wait_s": max(r["start"] - t_wall + r["wait_s"] for r in ranks),
                    "tokens": sum(r["tokens"] for r in ranks), "bytes": sum(r["bytes"] for r in ranks),
                    "encoder_passes": sum(r.get("encoder_passes", 0) for r in ranks)})
            log.info("compute %s ms/1k tok: step %d done", c, s)
    return out
