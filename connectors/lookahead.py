"""The lookahead limit: when the rollout worker may dispatch another prompt group.

The trainer consumes groups (releases them); the rollout must not run arbitrarily far ahead of it.
``LookaheadLimit`` pauses dispatch while too many groups are written but not yet consumed:

* ``limit``: pause while the stores together hold ``limit`` or more unreleased groups (checked every
  ``poll_s`` seconds with one ``stats`` call per store);
* ``counts_running``: also count the groups this worker has running in the engine and those it wrote
  since the last check, so ``limit`` bounds every group dispatched and not yet consumed;
* ``hook``: a caller's own rule over the stores' stats (``LookaheadHook``), checked with ``limit``;
* **demand**: while the trainer waits for data, its planner publishes, through the stores' stats, the
  groups per data source its current train batch still needs and nothing running will bring
  (``StoreReader.publish_demand``; withdrawn once the trainer has plans again).
  While paused with nothing running, the worker may dispatch prompts of those classes, one at a time
  (:meth:`take_demand`):
  otherwise a lookahead full of groups of other classes would wait forever for the one the quota
  needs. Each check replaces what is left of the last demand.

A store that cannot be reached (``NodeUnavailableError``, e.g. while ``knit run`` restarts it) skips
the check: the last decision and counts stay, and the groups written since keep counting toward
``limit`` (so the limit never loosens during an outage); the next check after the store is back
takes the stores' counts again.

Example:
    >>> from schemas.replies import GroupCounts
    >>> held = NodeStats.model_construct(groups=GroupCounts(stored=3, released=0, inflight=0), demand={})
    >>> LookaheadLimit(lambda: {"grpc://a:1": held}, limit=3, poll_s=0.0).allows(running=0)
    False
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from flight_store.errors import NodeUnavailableError
from schemas.replies import NodeStats

logger = logging.getLogger(__name__)

StoreStats = Mapping[str, NodeStats]
"""``StoreNodes.stats()``: store location -> that store's stats."""

LookaheadHook = Callable[[StoreStats], bool]
"""Called with ``StoreNodes.stats()`` (store -> stats); returns True to pause dispatch."""


def unreleased_groups(stats: StoreStats) -> int:
    """Groups the stores hold and the trainer has not released yet, over all stores."""
    return sum(s.groups.stored for s in stats.values())


class LookaheadLimit:
    """Decides whether the worker may dispatch another group, from the stores' stats.

    Args:
        stats: returns the stores' stats; called at most once per ``poll_s`` (the worker flushes its
            queued writes first, so the counts include them).
        limit: most unreleased groups (``None``: no count limit, only ``hook``).
        counts_running: count running and freshly written groups toward ``limit`` between checks.
        poll_s: seconds between two ``stats`` calls.
        hook: an extra rule over the stats; True pauses.
    """

    def __init__(
        self,
        stats: Callable[[], StoreStats],
        *,
        limit: int | None = None,
        counts_running: bool = False,
        poll_s: float = 0.5,
        hook: LookaheadHook | None = None,
    ) -> None:
        self._stats = stats
        self._limit = limit
        self._counts_running = counts_running and limit is not None
        self._poll_s = poll_s
        self._hook = hook
        self._next_poll = 0.0
        self._paused = False
        self._stored_at_poll = 0  # unreleased groups in the stores at the last check
        self._written_since_poll = 0
        self._unreachable_since: float | None = None  # when a check first found a store unreachable
        self._demand: dict[str, int] = {}  # groups per data source the trainer needs past the limit

    def note_written(self) -> None:
        """Count one group this worker wrote (the stores will count it at the next check)."""
        self._written_since_poll += 1

    def allows(self, running: int) -> bool:
        """Whether one more group may be dispatched while ``running`` groups run in the engine."""
        if self._limit is None and self._hook is None:
            return True
        now = time.perf_counter()
        if now >= self._next_poll:
            self._next_poll = now + self._poll_s
            try:
                stats = self._stats()
            except NodeUnavailableError as exc:  # keep the last counts (the limit stays as tight)
                if self._unreachable_since is None:
                    self._unreachable_since = now
                    logger.warning("lookahead check skipped: %s; keeping the last counts until it answers", exc)
            else:
                if self._unreachable_since is not None:
                    logger.info("lookahead check: every store answers again (after %.1f s)",
                                   now - self._unreachable_since)
                    self._unreachable_since = None
                self._check(stats)
        if self._counts_running and self._limit is not None:
            # between checks: what the stores held, plus what this worker wrote since, plus what runs
            outstanding = self._stored_at_poll + self._written_since_poll + running
            if outstanding >= self._limit:
                return False
        return not self._paused

    def take_demand(self, data_source: str) -> bool:
        """Whether a prompt of ``data_source`` may go out past the limit (the trainer needs it); counts it."""
        if self._demand.get(data_source, 0) < 1:
            return False
        self._demand[data_source] -= 1
        return True

    @property
    def demanded(self) -> bool:
        """Whether any class is still demanded."""
        return any(n > 0 for n in self._demand.values())

    def _check(self, stats: StoreStats) -> None:
        self._demand = {}
        for s in stats.values():
            for source, n in s.demand.items():
                self._demand[source] = max(self._demand.get(source, 0), n)
        self._stored_at_poll = unreleased_groups(stats)
        self._written_since_poll = 0
        paused = self._limit is not None and self._stored_at_poll >= self._limit
        paused = paused or (self._hook is not None and self._hook(stats))
        if paused != self._paused:
            logger.info("rollout dispatch %s by the lookahead limit", "paused" if paused else "resumed")
        self._paused = paused
