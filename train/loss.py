"""GRPO/PPO clipped policy-gradient loss over Megatron's per-token cross-entropy, and its reduction.

``GPTModel(..., labels=labels)`` returns the per-token cross entropy, i.e. ``-logprob`` of each
label under the current policy (vocab-parallel under TP). With the rollout engine's logprobs
``old`` and the planner's advantage ``A`` at each response position:

    ratio = exp(logp - old)
    loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)

(the clip range is ``admission.GrpoConfig``'s, the same config that sets how the planner computes
``A``). :func:`policy_loss` returns the masked *sum* and the token count; Megatron
(``calculate_per_token_loss``) divides the gradients by the token count of the whole mini-batch
across DP ranks, so the result is a token mean over the mini-batch. :func:`reduce_reports` turns the
per-micro-batch reports into the step's metrics the same way (exact token means over the DP group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from admission.config import GrpoConfig

REPORT_KEYS: tuple[str, ...] = ("pg_loss", "ratio", "clip_frac", "logp_diff")
"""What :func:`policy_loss` reports per micro-batch, each as a ``[sum, token count]`` tensor."""


def policy_loss(per_token_ce: Any, batch: dict[str, Any], cfg: GrpoConfig) -> tuple[Any, Any, dict[str, Any]]:
    """``(masked loss sum, token count, report)`` in the form Megatron's schedules expect.

    ``report`` holds ``[sum, count]`` tensors (``pg_loss``, ``ratio``, ``clip_frac``, ``logp_diff``)
    so that micro-batches and DP ranks can be reduced exactly into token means.
    """
    import torch

    logp = -per_token_ce.float()
    mask = batch["loss_mask"]
    adv = batch["advantages"]
    log_ratio = (logp - batch["rollout_logprobs"]) * mask
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    loss_sum = (per_token * mask).sum()
    count = mask.sum()
    with torch.no_grad():
        clip_frac = ((ratio * adv > clipped * adv).float() * mask).sum()
        report = {
            "pg_loss": torch.stack([loss_sum.detach(), count]),
            "ratio": torch.stack([(ratio * mask).sum(), count]),
            "clip_frac": torch.stack([clip_frac, count]),
            "logp_diff": torch.stack([log_ratio.abs().sum(), count]),
        }
    return loss_sum, count.to(torch.int), report


def reduce_reports(reports: Sequence[dict[str, Any]], rows: int, *, group: Any, device: Any) -> dict[str, Any]:
    """The step's loss metrics: token means over every micro-batch of every rank of the DP ``group``.

    ``rows`` is this rank's row count. Returns ``loss``, ``ratio``, ``clip_frac``, ``abs_logp_diff`` (token
    means), ``loss_tokens`` and ``rows`` (sums over the DP group).
    """
    import torch
    import torch.distributed as dist

    sums = torch.zeros(2 * len(REPORT_KEYS) + 1, dtype=torch.float64, device=device)
    for r in reports:
        for j, k in enumerate(REPORT_KEYS):
            sums[2 * j: 2 * j + 2] += r[k].to(sums)
    sums[-1] = rows
    dist.all_reduce(sums, group=group)
    s = sums.tolist()
    tokens = max(s[1], 1.0)
    return {"loss": s[0] / tokens, "ratio": s[2] / tokens, "clip_frac": s[4] / tokens, "abs_logp_diff": s[6] / tokens,
            "loss_tokens": int(s[1]), "rows": int(s[-1])}
