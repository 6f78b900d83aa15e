"""How off-policy each optimizer step was: the per-step metrics the loss reports, completed with the staleness
the trainer alone knows (the run's summary of them is ``launcher.offpolicy_report``'s).

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
"""

from __future__ import annotations

from typing import Any


def with_token_staleness(metrics: dict[str, Any], version: int) -> dict[str, Any]:
    """``metrics`` of a step that trained the weights of ``version``, with the token staleness added (None when its
    rows carried no token versions)."""
    mean, low = metrics.get("token_version_mean"), metrics.get("token_version_min")
    metrics["token_staleness_mean"] = None if mean is None else version - float(mean)
    metrics["token_staleness_max"] = None if low is None else version - int(low)
    return metrics
