"""The weight-sync poller: follows the policy version the trainer publishes, loads its weights.

The trainer publishes a version (``client.publish_version``) after it stores that version's weights
(``client.put_weights``). ``WeightSync.poll`` reads the published version at most every ``poll_s``
seconds; when it is newer than the engine's, and ``load`` is on, it fetches that version's weights
and loads them into the running engine (``RolloutEngine.load_weights``) before adopting the version. Weights
not readable yet leave the engine on its current version (retried at the next poll), and so does a
store that cannot be reached for the version (``NodeUnavailableError``, e.g. while ``knit run``
restarts it): the engine keeps generating with its weights and the next poll asks again. Without
``load``, the version is adopted as is (the weights are synced some other way).

An engine that pulls a version's weights itself (``load_version``: ``connectors.served.ServedEngine``, whose
server reads them from the stores) is asked to load the version instead: the rollout never reads the table. A load
that fails leaves the engine on its version; it is logged, counted (``failed_loads``) and tried again at the next
poll.

``version`` is what the rollout tags its groups with: the version of the weights the engine runs.

Example::

    sync = WeightSync(client, engine, version=0, poll_s=1.0, load=True)
    sync.poll(force=True); sync.version
    # -> 3
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from connectors.engine import RolloutEngine
from flight_store.errors import NodeUnavailableError
from flight_store.writing import StoreWriter

logger = logging.getLogger(__name__)


class WeightSync:
    """Tracks the engine's policy version and loads newly published weights into the engine.

    Args:
        client: the rollout's store client (``get_version``, ``get_weights``).
        engine: the engine to load weights into.
        version: the version of the weights the engine starts with.
        poll_s: seconds between two ``get_version`` calls.
        load: load published weights into the engine (else only adopt the version number).
    """

    def __init__(self, client: StoreWriter, engine: RolloutEngine, *, version: int, poll_s: float, load: bool) -> None:
        self._client = client
        self._engine = engine
        self._poll_s = poll_s
        self._load = load
        self._next_poll = 0.0
        self._unreachable_since: float | None = None  # when a poll first found a store unreachable
        self.version = version
        """Policy version of the weights the engine runs."""
        self.failed_loads = 0
        """Versions the engine failed to load (each attempt counted)."""
        self.loads: list[tuple[int, float, float]] = []
        """``(version, unix time the engine ran it from, seconds the load took)`` of each load, reading the weights
        included."""

    def wait_initial(self, timeout_s: float, *, stopped: Callable[[], bool] = lambda: False) -> None:
        """Wait for the weights of ``version``, or of a newer version the stores publish already, and load them
        (returns early if ``stopped()``). A run taken up again may have trained past its checkpoint's version
        before its rollout's engine started, and the stores keep only the newest versions' weights.

        Raises:
            TimeoutError: naming the version, when its weights are not readable after ``timeout_s``.
        """
        deadline = time.perf_counter() + timeout_s
        while not stopped():
            try:
                version = max(self.version, int(self._client.get_version()))
                self._into_engine(version)
                self.version = version
            except Exception as exc:  # not published yet
                if time.perf_counter() >= deadline:
                    msg = f"no weights of version {self.version} in the stores after {timeout_s} s: {exc}"
                    raise TimeoutError(msg) from None
                time.sleep(0.2)
                continue
            logger.info("loaded the initial weights (version %d) into the engine", self.version)
            return

    def poll(self, *, force: bool = False) -> None:
        """Adopt a newer published version (loading its weights first); at most every ``poll_s`` unless ``force``."""
        now = time.perf_counter()
        if not force and now < self._next_poll:
            return
        self._next_poll = now + self._poll_s
        try:
            published = int(self._client.get_version())
        except NodeUnavailableError as exc:  # keep generating with the current weights; ask at the next poll
            if self._unreachable_since is None:
                self._unreachable_since = now
                logger.warning("published version unknown: %s; staying on version %d until it answers", exc,
                               self.version)
            return
        if self._unreachable_since is not None:
            logger.info("every store answers get_version again (after %.1f s)", now - self._unreachable_since)
            self._unreachable_since = None
        if published <= self.version:
            return
        if self._load:
            try:
                self._into_engine(published)
            except Exception as exc:  # weights not there yet, or the engine failed them: keep the old ones
                self.failed_loads += 1
                logger.warning("version %d published but not loaded (the engine stays on version %d): %s",
                               published, self.version, exc)
                return
            logger.info("loaded weights of version %d into the engine", published)
        self.version = published

    def _into_engine(self, version: int) -> None:
        """Load ``version`` into the engine: pulled by the engine itself when it can, else read here and handed over."""
        t0 = time.perf_counter()
        pull = getattr(self._engine, "load_version", None)
        if callable(pull):
            pull(version)
        else:
            self._engine.load_weights(self._client.get_weights(version), version)
        self.loads.append((version, time.time(), time.perf_counter() - t0))
