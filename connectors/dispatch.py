"""The dispatch order: which committed prompt the rollout worker hands the engine next.

The worker draws prompts from the stream ``commit_ahead`` early (each a :class:`Drawn`, registered with its
node as ``queued``) and keeps them in a :class:`DispatchQueue` until the engine has room.
``RolloutConfig.dispatch_order`` picks which goes out next:

* ``loader``: the stream's order;
* ``slow_first``: a prompt of the data source with the longest latency (a source not measured yet counts as
  the slowest, so each is measured early);
* ``slow_ahead``: each prompt goes out ahead of its place in the stream by its source's lead
  (:func:`measured_leads`), so that groups complete in about the stream's order and a train batch's quota
  does not wait on its slow class.

An aborted group's prompt, dispatched again, goes out first under every order. A source's latency
(:func:`source_latency`) is the upper quartile of its last groups' dispatch-to-completion seconds, with the
ages of its groups still generating: a quota waits for a slow class's tail, not its mean, and the ages give a
slow source its lead from the first seconds of a run on. ``bench.staleness``'s simulator uses the same rule
(:func:`measured_leads`).

Example:
    >>> source_latency([1.0, 2.0, 3.0, 4.0, 5.0]), slow_ahead_leads(10.0, {"fast": 0.5, "slow": 2.0})
    (4.0, {'fast': 0.0, 'slow': 15.0})
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from connectors.tasks import Prompt

__all__ = ["LATENCY_QUANTILE", "LATENCY_WINDOW", "RATE_WINDOW", "DispatchQueue", "Drawn", "measured_leads",
           "slow_ahead_leads", "source_latency"]

LATENCY_WINDOW = 64
"""Groups per data source whose dispatch-to-completion seconds the dispatch order looks at (the last ones)."""
RATE_WINDOW = 64
"""Completed groups (the last ones, of every source) whose completion times give the rollout's completion rate."""
LATENCY_QUANTILE = 0.75
"""The latency a data source is given: the upper quartile of its window (with its running groups' ages, see
:func:`source_latency`). A quota waits for a slow class's tail, not its mean: in ``bench.staleness`` the upper
quartile reduces architectural staleness more than the window's mean or the 0.9 quantile, and as much as the
median at a wide latency spread and more at a narrow one."""


def source_latency(window: Sequence[float], running: Sequence[float] = ()) -> float:
    """A data source's latency: the :data:`LATENCY_QUANTILE` of its last groups' dispatch-to-completion seconds
    together with the ages of its groups still generating (each a lower bound of that group's latency).

    The ages are what a source's first groups say before any completes, so a slow source gets its lead from
    the first seconds of a run on, not after its first groups are done. Once its groups complete, the young
    ones among those running pull the figure down a little. Each age counts as if it were a latency, not as a
    censored one (a Kaplan-Meier quantile): ``bench.staleness`` shows less staleness with the simple rule.

    Example:
        >>> source_latency([1.0, 2.0, 3.0, 4.0, 5.0]), source_latency([], running=[2.0, 4.0])
        (4.0, 3.5)
    """
    return float(np.quantile(np.concatenate((np.asarray(window, dtype=np.float64),
                                             np.asarray(running, dtype=np.float64))), LATENCY_QUANTILE))


def slow_ahead_leads(rate: float, latency: Mapping[str, float]) -> dict[str, float]:
    """The ``slow_ahead`` dispatch order's lead per data source, in places of the prompt stream: the groups
    completed (``rate``, groups a second) while a group of the source generates beyond the fastest source's
    ``latency`` (seconds, dispatch to completion: :func:`source_latency`), so that groups complete in about the
    stream's order."""
    fastest = min(latency.values())
    return {src: rate * (lat - fastest) for src, lat in latency.items()}


def measured_leads(completed_at: Sequence[float], windows: Mapping[str, Sequence[float]],
                   running: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """:func:`slow_ahead_leads` from what was measured: the completion rate over ``completed_at`` (the last
    groups' completion times, oldest first) and, per data source with groups completed or running, the
    :func:`source_latency` of its ``windows`` entry (its last groups' latencies) and its ``running`` entry (the
    ages of its groups still generating). Empty until two groups completed. The rule of the rollout worker's
    ``slow_ahead`` order and of ``bench.staleness``'s simulator."""
    if len(completed_at) < 2 or completed_at[-1] <= completed_at[0]:
        return {}
    latency = {src: source_latency(windows.get(src, ()), running.get(src, ()))
               for src in {*windows, *running} if len(windows.get(src, ())) or len(running.get(src, ()))}
    return slow_ahead_leads((len(completed_at) - 1) / (completed_at[-1] - completed_at[0]), latency)


@dataclass(frozen=True, slots=True, kw_only=True)
class Drawn:
    """A prompt drawn from the stream, with the group id and node it will be written under."""

    group_id: str
    node: str
    prompt: Prompt
    prompt_id: str
    """The prompt's first group id (kept when it is dispatched again after an abort)."""
    index: int = 0
    """Its place in the prompt stream (0 = the first prompt drawn)."""
    attempt: int = 0
    """0 for the prompt's first dispatch, n for its n-th dispatch again (after the engine aborted it, or a resume)."""
    reason: str | None = None
    """Why this attempt goes out again (``aborted``, ``interrupted``, ``rolled_back``, ...); None for the first."""


RunningAges = Callable[[], Mapping[str, Sequence[float]]]
"""Returns, per data source, the ages in seconds of its groups generating now."""


class DispatchQueue:
    """The committed prompts waiting for dispatch, and what the dispatch order measures to choose among them.

    Args:
        order: ``RolloutConfig.dispatch_order`` (``slow_ahead``, ``slow_first`` or ``loader``).

    Example:
        >>> from connectors.tasks import Prompt
        >>> queue = DispatchQueue("loader")
        >>> queue.append(Drawn(group_id="g0", node="n", prompt=Prompt("a", "1+1"), prompt_id="g0"))
        >>> queue.take_next(lambda d: True, dict).group_id, len(queue)
        ('g0', 0)
    """

    def __init__(self, order: str) -> None:
        self._order = order
        self._committed: deque[Drawn] = deque()
        self._latencies: dict[str, deque[float]] = {}  # data source -> its last groups' dispatch-to-completion s
        self._completed_at: deque[float] = deque(maxlen=RATE_WINDOW)  # when the last groups completed

    def __len__(self) -> int:
        return len(self._committed)

    def __iter__(self) -> Iterator[Drawn]:
        return iter(self._committed)

    def append(self, drawn: Drawn) -> None:
        """A prompt drawn from the stream joins the end."""
        self._committed.append(drawn)

    def put_first(self, drawn: Drawn) -> None:
        """An aborted group's prompt, going out again: it is dispatched before every other."""
        self._committed.appendleft(drawn)

    def take(self, drawn: Drawn) -> Drawn:
        """Remove ``drawn`` (chosen by the caller) and return it."""
        self._committed.remove(drawn)
        return drawn

    def clear(self) -> list[Drawn]:
        """Remove and return every prompt waiting."""
        out = list(self._committed)
        self._committed.clear()
        return out

    def note_completed(self, data_source: str, took_s: float, at: float) -> None:
        """A group of ``data_source`` completed at ``at`` (``time.perf_counter()``), ``took_s`` after dispatch."""
        self._latencies.setdefault(data_source, deque(maxlen=LATENCY_WINDOW)).append(took_s)
        self._completed_at.append(at)

    def leads(self, running: Mapping[str, Sequence[float]]) -> dict[str, float]:
        """``slow_ahead``: per data source, how many places ahead of its place in the stream a prompt goes out
        (:func:`measured_leads` over this queue's measurements and the ``running`` groups' ages)."""
        return measured_leads(self._completed_at, self._latencies, running)

    def take_next(self, may_go: Callable[[Drawn], bool], running: RunningAges) -> Drawn | None:
        """Remove and return the prompt to dispatch next among those ``may_go`` allows (``None``: none)."""
        ready = [d for d in self._committed if may_go(d)]
        if not ready:
            return None
        if self._order == "loader" or len(ready) == 1 or ready[0].attempt:  # an aborted group's prompt goes first
            chosen = ready[0]
        elif self._order == "slow_first":
            latency = {src: source_latency(window) for src, window in self._latencies.items()}
            chosen = max(ready, key=lambda d: latency.get(d.prompt.data_source, float("inf")))
        else:
            leads = self.leads(running())
            chosen = min(ready, key=lambda d: d.index - leads.get(d.prompt.data_source, 0.0))
        return self.take(chosen)
