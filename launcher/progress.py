"""Live progress of ``knit run`` (rich) and the final summary table.

On a terminal: a live panel with progress bars (groups written by the rollout, admitted by the
planner, consumed by the trainer; optimizer steps) and a status line (policy version, architectural
staleness so far, phase, the store nodes down and being restarted). Elsewhere (logs, tests,
``--plain``): one plain line every few seconds, and one at once when a store node goes down or is back.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.run_folder import RunFolderError, parse
from schemas.run_records import ProgressLine

if TYPE_CHECKING:
    from schemas.replies import NodeStats
    from schemas.run_summary import RunSummary


@dataclass(slots=True)
class LiveState:
    """What the progress display shows, refreshed from the stores and the trainer's progress file."""

    phase: str = "starting"
    written: int = 0
    admitted: int = 0
    consumed: int = 0
    version: int = 0
    stores_down: list[str] = field(default_factory=list)
    steps: list[ProgressLine] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def staleness_mean(self) -> float:
        rows = sum(s.rows for s in self.steps if s.arch_staleness_mean is not None)
        if not rows:
            return 0.0
        return sum(s.arch_staleness_mean * s.rows for s in self.steps if s.arch_staleness_mean is not None) / rows

    @property
    def staleness_max(self) -> int:
        return max((s.arch_staleness_max or 0 for s in self.steps), default=0)

    def read_progress(self, path: Path) -> None:
        """Take the trainer's new progress lines (one JSON object per optimizer step)."""
        if not path.exists():
            return
        for n, line in enumerate(path.read_text().splitlines(keepends=True)[len(self.steps):], start=len(self.steps)):
            if not line.endswith("\n"):
                break  # a line being written: read it next time
            try:
                self.steps.append(parse(ProgressLine, json.loads(line), path, line=n + 1))
            except (ValueError, RunFolderError):
                break
        if self.steps:
            self.admitted = max(self.admitted, self.steps[-1].admitted_groups)
            self.phase = "training"

    def read_stats(self, stats: dict[str, NodeStats]) -> None:
        """Take the stores' counters."""
        self.written = sum(s.groups.stored + s.groups.released for s in stats.values())
        self.consumed = sum(s.groups.released for s in stats.values())
        self.version = max(s.policy_version for s in stats.values())


class Display:
    """Progress output of the driver.

    Example::

        d = Display(plain=True)
        with d.live("mini_batch", total_groups=24, total_steps=6) as update:
            update(state)
    """

    def __init__(self, *, plain: bool = False) -> None:
        from rich.console import Console

        self.console = Console()
        self.plain = plain or not self.console.is_terminal

    def note(self, text: str) -> None:
        """One line of output."""
        if self.plain:
            print(text, flush=True)
        else:
            self.console.print(text, highlight=False)

    @contextlib.contextmanager
    def live(self, policy: str, total_groups: int, total_steps: int) -> Iterator[Callable[[Any], None]]:
        """A context whose value is ``update(state)`` (state: :class:`LiveState`)."""
        if self.plain:
            last: list[Any] = [0.0, []]  # time of the last line, the stores down then

            def update_plain(state: Any) -> None:
                now = time.monotonic()
                if now - last[0] < 5.0 and state.phase != "finishing" and state.stores_down == last[1]:
                    return
                last[0], last[1] = now, list(state.stores_down)
                print(f"[{policy}] {state.phase}: written {state.written}/{total_groups} admitted {state.admitted} "
                      f"consumed {state.consumed} steps {len(state.steps)}/{total_steps} version v{state.version} "
                      f"arch staleness mean {state.staleness_mean:.2f} max {state.staleness_max}{_down(state)} "
                      f"({now - state.started:.0f} s)", flush=True)

            yield update_plain
            return

        from rich.console import Group
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.text import Text

        bars = Progress(TextColumn("{task.description:<26}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=self.console)
        written = bars.add_task("groups written (rollout)", total=total_groups)
        admitted = bars.add_task("groups admitted (planner)", total=total_groups)
        consumed = bars.add_task("groups consumed (trainer)", total=total_groups)
        steps = bars.add_task("optimizer steps", total=total_steps)
        status = Text("")

        def update(state: Any) -> None:
            bars.update(written, completed=state.written)
            bars.update(admitted, completed=state.admitted)
            bars.update(consumed, completed=state.consumed)
            bars.update(steps, completed=len(state.steps))
            loss = state.steps[-1].loss if state.steps else float("nan")
            status.plain = (f"{policy}: {state.phase} | policy version v{state.version} | arch. staleness so far: "
                            f"mean {state.staleness_mean:.2f}, max {state.staleness_max} | last loss {loss:.4f}"
                            f"{_down(state)}")

        with Live(Group(bars, status), console=self.console, refresh_per_second=4, transient=False):
            yield update

    def summary(self, doc: RunSummary) -> None:
        """The summary table (rows: figures; columns: policies), then the staleness reduction."""
        from rich.table import Table

        from launcher.report import table_rows

        results = doc.policies
        table = Table(title="knit run: summary")
        table.add_column("")
        for name in results:
            table.add_column(name)
        per = {name: table_rows(r) for name, r in results.items()}
        first = next(iter(per.values()))
        for i, (label, _) in enumerate(first):
            table.add_row(label, *(per[name][i][1] for name in results))
        self.console.print(table)
        if doc.arch_staleness_reduction is not None:
            self.console.print(f"architectural staleness: mini_batch is {100 * doc.arch_staleness_reduction:.1f}% "
                               f"lower than train_batch (throughput ratio {doc.throughput_ratio})",
                               highlight=False)


def _down(state: Any) -> str:
    """`` | store nodes down (restarting): node1`` while some are, else nothing."""
    return f" | store nodes down (restarting): {', '.join(state.stores_down)}" if state.stores_down else ""
