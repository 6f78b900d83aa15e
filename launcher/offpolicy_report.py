"""The off-policy part of a run's report: per-run figures from the step records, and one plot per policy.

The step records (``trainer_rank0.json``) carry the off-policy metrics of each step (``train.offpolicy``): the
importance weight's mean and max, the fraction truncated, the clip fraction, KL(pi_rollout || pi_theta) by k3,
and the token staleness. :func:`figures` summarises them for ``summary.json`` under ``offpolicy``;
:func:`plot` draws them per step (``offpolicy_per_step.png``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from train.offpolicy import summary


def figures(steps: Sequence[Mapping[str, Any]], objective: str | None) -> dict[str, Any]:
    """``{"offpolicy": {...}}``: the objective the run trained with and its steps' off-policy figures."""
    return {"offpolicy": {"objective": objective, **summary(steps)}}


def plot(plt: Any, save: Callable[[Any, Path], Path], steps: Sequence[Mapping[str, Any]], path: Path,
         name: str) -> Path:
    """Per step: the token staleness (mean and max, versions) on the left axis; the importance weight's mean,
    the truncated and clipped fractions and the k3 KL on the right."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = [s["step"] for s in steps]

    def series(key: str) -> list[float]:
        return [float("nan") if s.get(key) is None else float(s[key]) for s in steps]

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
