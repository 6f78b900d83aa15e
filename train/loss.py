"""The policy loss over Megatron's per-token cross-entropy, its off-policy report, and their reduction.

``GPTModel(..., labels=labels)`` returns the per-token cross entropy, i.e. ``-logprob`` of each label under the
current policy (vocab-parallel under TP). :func:`policy_loss` turns it into the loss of the configured objective
(``train.objectives``: ``ppo_rollout_old``, ``decoupled_ppo``, ``tis``; the clip range is
``admission.GrpoConfig``'s, the same config that sets how the planner computes the advantages). It returns the
masked *sum* and the token count; Megatron (``calculate_per_token_loss``) divides the gradients by the token
count of the whole mini-batch across DP ranks, so the result is a token mean over the mini-batch.

Beside the loss, every micro-batch reports how off-policy its tokens were, whatever the objective:

* ``is_weight``: the behaviour importance weight before truncation (pi_theta / pi_rollout; ``decoupled_ppo``:
  pi_prox / pi_rollout), its token mean and max, and ``is_truncated``, the fraction above ``is_cap``;
* ``kl_k3``: KL(pi_rollout || pi_theta) by the k3 estimator over the sampled tokens,
  ``(r - 1) - log r`` with ``r = pi_theta / pi_rollout`` (Schulman's "Approximating KL divergence": unbiased, never
  negative, low variance);
* ``clip_frac``: the tokens whose gradient the objective's clip removed;
* ``token_version``: the token mean and the minimum of the tokens' policy versions (``token_versions``), from which
  the loop derives the staleness in versions (``train.loop``).

:func:`reduce_reports` turns the per-micro-batch reports into the step's metrics: exact token means over the DP
group, and maxima.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from admission.config import GrpoConfig
from train.config import ObjectiveConfig

REPORT_KEYS: tuple[str, ...] = ("pg_loss", "ratio", "clip_frac", "logp_diff", "is_weight", "is_truncated", "kl_k3",
                                "token_version")
"""What :func:`policy_loss` reports per micro-batch as ``[sum, token count]`` tensors (token means)."""
MAX_KEYS: tuple[str, ...] = ("is_weight_max", "neg_token_version_max")
"""What it reports as maxima over the micro-batch's trained tokens (``-inf`` for none); the second is the negated
minimum token version."""


def policy_loss(per_token_ce: Any, batch: dict[str, Any], cfg: GrpoConfig,
                objective: ObjectiveConfig | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """``(masked loss sum, token count, report)`` in the form Megatron's schedules expect.

    ``objective``: the loss (``ppo_rollout_old`` when None). ``report`` holds ``[sum, count]`` tensors
    (:data:`REPORT_KEYS`) and maxima (:data:`MAX_KEYS`) so that micro-batches and DP ranks reduce exactly.
    """
    import torch

    from train.objectives import token_loss

    objective = objective or ObjectiveConfig()
    logp = -per_token_ce.float()
    mask = batch["loss_mask"]
    out = token_loss(logp, batch, cfg, objective)
    loss_sum = (out.loss * mask).sum()
    count = mask.sum()
    with torch.no_grad():
        log_r = (logp.detach() - batch["rollout_logprobs"]) * mask
        versions = batch.get("token_versions")
        version = versions.to(mask.dtype) if versions is not None else torch.zeros_like(mask)
        trained = mask > 0
        none = torch.tensor(-math.inf, device=mask.device)
        report = {
            "pg_loss": torch.stack([loss_sum.detach(), count]),
            "ratio": torch.stack([(out.ratio.detach() * mask).sum(), count]),
            "clip_frac": torch.stack([(out.clipped * mask).sum(), count]),
            "logp_diff": torch.stack([log_r.abs().sum(), count]),
            "is_weight": torch.stack([(out.weight * mask).sum(), count]),
            "is_truncated": torch.stack([((out.weight > objective.is_cap).float() * mask).sum(), count]),
            "kl_k3": torch.stack([((torch.exp(log_r) - 1.0 - log_r) * mask).sum(), count]),
            "token_version": torch.stack([(version * mask).sum(), count if versions is not None else count * 0]),
            "is_weight_max": torch.where(trained, out.weight, none).max() if trained.any() else none,
            "neg_token_version_max": (torch.where(trained, -version, none).max()
                                      if versions is not None and trained.any() else none),
        }
    return loss_sum, count.to(torch.int), report


def reduce_reports(reports: Sequence[dict[str, Any]], rows: int, *, group: Any, device: Any) -> dict[str, Any]:
    """The step's loss metrics: token means over every micro-batch of every rank of the DP ``group``, and maxima.

    ``rows`` is this rank's row count. Returns ``loss``, ``ratio``, ``clip_frac``, ``abs_logp_diff``,
    ``is_weight_mean``, ``is_truncated_frac``, ``kl_behaviour_k3`` (token means), ``is_weight_max``,
    ``token_version_mean`` and ``token_version_min`` (None when the rows carried no ``token_versions``),
    ``loss_tokens`` and ``rows`` (sums over the DP group).
    """
    import torch
    import torch.distributed as dist

    sums = torch.zeros(2 * len(REPORT_KEYS) + 1, dtype=torch.float64, device=device)
    maxima = torch.full((len(MAX_KEYS),), -math.inf, dtype=torch.float64, device=device)
    for r in reports:
        for j, k in enumerate(REPORT_KEYS):
            sums[2 * j: 2 * j + 2] += r[k].to(sums)
        for j, k in enumerate(MAX_KEYS):
            maxima[j] = torch.maximum(maxima[j], r[k].to(maxima))
    sums[-1] = rows
    dist.all_reduce(sums, group=group)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    s, m = sums.tolist(), maxima.tolist()
    mean = {k: s[2 * j] / max(s[2 * j + 1], 1.0) for j, k in enumerate(REPORT_KEYS)}
    versioned = s[2 * REPORT_KEYS.index("token_version") + 1] > 0
    return {"loss": mean["pg_loss"], "ratio": mean["ratio"], "clip_frac": mean["clip_frac"],
            "abs_logp_diff": mean["logp_diff"], "is_weight_mean": mean["is_weight"],
            "is_weight_max": m[0] if math.isfinite(m[0]) else None, "is_truncated_frac": mean["is_truncated"],
            "kl_behaviour_k3": mean["kl_k3"],
            "token_version_mean": mean["token_version"] if versioned else None,
            "token_version_min": int(-m[1]) if versioned and math.isfinite(m[1]) else None,
            "loss_tokens": int(s[1]), "rows": int(s[-1])}
