"""The rollout's side of the prompt ledger: its event log, and taking a stopped run's prompt stream up again.

:class:`RolloutEvents` appends one line per prompt drawn, per group dispatched to the engine and per group
written (``schemas.ledger`` says the lines), flushed at once; a dispatch line is written before the engine gets
the group, so a group a store holds always has its dispatch line, and a written line names the node that took
the group (so the groups of a node lost for good are known: ``launcher.ledger``). :func:`resume_stream` takes a
stopped run up again from a ``RolloutResume`` document: the prompt stream (deterministic: the seeded mix, or a
prompts file) goes on after the prompts the earlier lives drew, and the prompts the document names come back as
new attempts, first.

Example:
    >>> from connectors.tasks import Prompt
    >>> stream = iter([Prompt("a", str(i)) for i in range(5)])
    >>> doc = RolloutResume(life=1, drawn=3, reissue=[Reissue(index=1, prompt_id="p1", attempt=1,
    ...                                                           reason="interrupted")])
    >>> rest, again = resume_stream(stream, doc)
    >>> [p.text for _, p in again], next(rest).text
    (['1'], '3')
"""

from __future__ import annotations

from collections.abc import Iterator

from connectors.dispatch import Drawn
from connectors.tasks import Prompt
from schemas.ledger import Dispatch, Draw, Reissue, RolloutEvent, RolloutResume, Written
from schemas.run_folder import LineWriter

__all__ = ["RolloutEvents", "resume_stream"]


class RolloutEvents:
    """The rollout's ledger events, appended to ``path`` (None: nothing is written); thread-safe (the writer thread
    logs the groups written)."""

    def __init__(self, path: str | None) -> None:
        self._log = LineWriter(path)

    def drawn(self, drawn: Drawn) -> None:
        """A prompt was drawn from the stream (it has a place and a first group id)."""
        self._write(Draw(index=drawn.index, prompt_id=drawn.prompt_id, group_id=drawn.group_id))

    def dispatched(self, drawn: Drawn, version: int) -> None:
        """A group of a prompt goes to the engine now, generated from ``version``'s weights."""
        self._write(Dispatch(index=drawn.index, prompt_id=drawn.prompt_id, attempt=drawn.attempt,
                             group_id=drawn.group_id, version=version, reason=drawn.reason))

    def written(self, group_id: str, node: str) -> None:
        """The store node ``node`` (its location) took the group ``group_id``."""
        self._write(Written(group_id=group_id, node=node))

    def _write(self, event: RolloutEvent) -> None:
        self._log.write(event)

    def close(self) -> None:
        self._log.close()


def resume_stream(prompts: Iterator[Prompt], doc: RolloutResume) -> tuple[Iterator[Prompt], list[tuple[Reissue,
                                                                                                           Prompt]]]:
    """The prompt stream after the ``doc.drawn`` prompts drawn before, and the prompts ``doc`` re-issues.

    Raises:
        ValueError: the stream ends before ``doc.drawn`` prompts (another stream than the run's), or a re-issued
            index is not among those drawn.
    """
    wanted = {r.index: r for r in doc.reissue}
    if any(i >= doc.drawn for i in wanted):
        msg = f"resume document re-issues prompt indices {sorted(i for i in wanted if i >= doc.drawn)} " \
              f"beyond the {doc.drawn} drawn"
        raise ValueError(msg)
    again: list[tuple[Reissue, Prompt]] = []
    for index in range(doc.drawn):
        prompt = next(prompts, None)
        if prompt is None:
            msg = f"the prompt stream ended after {index} prompts; the run being resumed drew {doc.drawn}"
            raise ValueError(msg)
        if index in wanted:
            again.append((wanted[index], prompt))
    return prompts, again
