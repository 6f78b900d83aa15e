"""Planner state: what has been admitted, where the current train batch stands, its quota use.

The state is immutable; :func:`admission.planner.plan` returns a new one. It holds the ids of the
groups settled (admitted or dropped) whose rows may still be in a frame, plus a few counters, and can
be checkpointed with :meth:`PlannerState.to_dict`. A long-running caller keeps it bounded with
:meth:`PlannerState.forget`: once a settled group's rows are out of its frame for good (the trainer's
``train.planning.PlanSource`` removes them after each call and scans each store row only once), its
id is no longer needed, so the state holds only the groups settled since the caller last pruned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
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

    def forget(self, group_ids: Iterable[str]) -> PlannerState:
        """This state without ``group_ids`` among the admitted and dropped groups.

        Only for groups whose rows will never be in a frame passed to ``plan`` again: a forgotten group
        whose rows came back would be planned anew (guarantee 1 holds for the frames ``plan`` is given).
        """
        ids = frozenset(group_ids)
        return replace(self, admitted=self.admitted - ids, dropped=self.dropped - ids)

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
