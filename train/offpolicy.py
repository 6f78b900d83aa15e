"""How off-policy each optimizer step was: the per-step metrics the loss reports, completed with the staleness
the trainer alone knows, and their summary over a run.

The loss (``train.loss``) reports per step, over the trained tokens: the behaviour importance weight's mean and
max (``is_weight_mean``, ``is_weight_max``), the fraction above the cap (``is_truncated_frac``), the clip
fraction (``clip_frac``), KL(pi_rollout || pi_theta) by the k3 estimator (``kl_behaviour_k3``), and the tokens'
policy versions (``token_version_mean``, ``token_version_min``, from ``token_versions``). The loop adds, with the
version of the weights the step trained (:func:`with_token_staleness`):

* ``token_staleness_mean``: ``version - token_version_mean``, versions between the weights that made a token and
  the weights that trained on it, averaged over the tokens;
* ``token_staleness_max``: ``version - token_version_min``.

A partial rollout's response spans versions, so its tokens are less stale than its row's ``policy_version_min``
says; the trajectory-level figures (``admission.staleness``) count a row by its versions, these count tokens.
:func:`summary` gives the run's figures of these (``launcher.report``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

OFFPOLICY_KEYS: tuple[str, ...] = ("is_weight_mean", "is_weight_max", "is_truncated_frac", "clip_frac",
                                   "kl_behaviour_k3", "token_staleness_mean", "token_staleness_max")
"""The per-step off-policy metrics, as the step records hold them (a step without token versions has None for
the staleness)."""


def with_token_staleness(metrics: dict[str, Any], version: int) -> dict[str, Any]:
    """``metrics`` of a step that trained the weights of ``version``, with the token staleness added (None when its
    rows carried no token versions)."""
    mean, low = metrics.get("token_version_mean"), metrics.get("token_version_min")
    metrics["token_staleness_mean"] = None if mean is None else version - float(mean)
    metrics["token_staleness_max"] = None if low is None else version - int(low)
    return metrics


def summary(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's off-policy figures from its step records, under the steps' own keys: each metric's mean over the
    steps (``_max`` ones: their maximum), ``None`` where no step had it."""
    out: dict[str, Any] = {}
    for key in OFFPOLICY_KEYS:
        values = [float(s[key]) for s in steps if s.get(key) is not None]
        out[key] = (round(max(values) if key.endswith("_max") else sum(values) / len(values), 6)
                    if values else None)
    return out
