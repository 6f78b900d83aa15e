"""Planner state: what has been admitted, where the current train batch stands, its quota use.

The state is immutable; :func:`admission.planner.plan` returns a new one. It is small (group ids
plus a few counters) and can be checkpointed with :meth:`PlannerState.to_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, slots=True, frozen=True)
class PlannerState:
    """Immutable admission state.

    Example:
        >>> s = PlannerState()
        >>> s.train_batch, s.position, s.used()
        (0, 0, {})
    """

    train_batch: int = 0
    """t, the train batch now being filled."""
    position: int = 0
    """k, the position of the next mini-batch inside train batch t."""
    admitted: frozenset[str] = frozenset()
    """Group ids admitted so far (never admitted again)."""
    dropped: frozenset[str] = frozenset()
    """Group ids dropped so far (aborted, filtered, stale, unmatched); never admitted."""
    quota_used: tuple[tuple[str, str, int], ...] = ()
    """(column, value, groups admitted) for the current train batch; absent pairs are 0."""

    def __post_init__(self) -> None:
        if self.train_batch < 0 or self.position < 0:
            msg = f"PlannerState: negative train_batch={self.train_batch} or position={self.position}"
            raise ValueError(msg)

    def used(self) -> dict[tuple[str, str], int]:
        """Quota use of the current train batch as a dict."""
        return {(c, v): n for c, v, n in self.quota_used}

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for checkpoints)."""
        return {"train_batch": self.train_batch, "position": self.position,
                "admitted": sorted(self.admitted), "dropped": sorted(self.dropped),
                "quota_used": [list(x) for x in self.quota_used]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlannerState:
        """Inverse of :meth:`to_dict`."""
        return cls(train_batch=int(d["train_batch"]), position=int(d["position"]),
                   admitted=frozenset(d["admitted"]), dropped=frozenset(d["dropped"]),
                   quota_used=tuple((str(c), str(v), int(n)) for c, v, n in d["quota_used"]))
