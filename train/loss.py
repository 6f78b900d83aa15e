"""GRPO/PPO clipped policy-gradient loss over Megatron's per-token cross-entropy.

``GPTModel(..., labels=labels)`` returns the per-token cross entropy, i.e. ``-logprob`` of each
label under the current policy (vocab-parallel under TP). With the rollout engine's logprobs
``old`` and the planner's advantage ``A`` at each response position:

    ratio = exp(logp - old)
    loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)

The function returns the masked *sum* and the token count; Megatron (``calculate_per_token_loss``)
divides the gradients by the token count of the whole mini-batch across DP ranks, so the result
is a token mean over the mini-batch.
"""

from __future__ import annotations

from typing import Any

from train.config import LossConfig


def policy_loss(per_token_ce: Any, batch: dict[str, Any], cfg: LossConfig) -> tuple[Any, Any, dict[str, Any]]:
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
