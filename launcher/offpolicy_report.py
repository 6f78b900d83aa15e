"""The off-policy part of a run's report: per-run figures from the step records, and one plot per policy.

The step records (``trainer_rank0.json``) carry the off-policy metrics of each step (``train.offpolicy``): the
importance weight's mean and max, the fraction truncated, the clip fraction, KL(pi_rollout || pi_theta) by k3,
and the token staleness. :func:`figures` summarises them for ``summary.json`` under ``offpolicy``;
:func:`plot` draws them per step (``offpolicy_per_step.png``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from schemas.run_records import OFFPOLICY_KEYS, StepLine
from schemas.run_summary import OffPolicyFigures


def figures(steps: Sequence[StepLine], objective: str | None) -> OffPolicyFigures:
    """The objective the run trained with and its steps' off-policy figures: each metric's mean over the steps
    (``_max`` ones: their maximum), None where no step had it."""
    out: dict[str, float | None] = {}
    for key in OFFPOLICY_KEYS:
        values = [float(v) for v in (getattr(s, key) for s in steps) if v is not None]
        out[key] = (round(max(values) if key.endswith("_max") else sum(values) / len(values), 6)
                    if values else None)
    return OffPolicyFigures(objective=objective, **out)


def plot(plt: Any, save: Callable[[Any, Path], Path], steps: Sequence[StepLine], path: Path,
         name: str) -> Path:
    """Per step: the token staleness (mean and max, versions) on the left axis; the importance weight's mean,
    the truncated and clipped fractions and the k3 KL on the right."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = [s.step for s in steps]

    def series(key: str) -> list[float]:
        return [float("nan") if v is None else float(v) for v in (getattr(s, key) for s in steps)]

    ax.plot(x, series("token_staleness_mean"), "o-", color="tab:blue", label="token staleness, mean")
    ax.plot(x, series("token_staleness_max"), "o--", color="tab:blue", alpha=0.5, label="token staleness, max")
    ax.set(xlabel="optimizer step", ylabel="versions", title=f"{name}: how off-policy each step was")
    right = ax.twinx()
    for key, color in (("is_weight_mean", "tab:green"), ("is_truncated_frac", "tab:red"),
                       ("clip_frac", "tab:orange"), ("kl_behaviour_k3", "tab:purple")):
        right.plot(x, series(key), ".-", color=color, label=key)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)
    return save(fig, path)
