"""The policy losses the trainer can minimise (``ObjectiveConfig.objective``), token by token.

Per response token, sampled by the rollout engine under the behaviour policy pi_b:

* ``logp``: log pi_theta of the token under the weights being trained (with grad);
* ``rollout``: log pi_b, the engine's logprob when it sampled the token (``response_logprobs``);
* ``prox``: log pi_prox, the trainer's own logprob of the token, recomputed without grad for the mini-batch
  before its optimizer step (``decoupled_ppo`` only: :func:`train.trainer.proximal_logprobs`);
* ``A``: the token's advantage; ``clip(r) = clamp(r, 1 - clip_low, 1 + clip_high)`` (``admission.GrpoConfig``);
  ``cap``: ``ObjectiveConfig.is_cap``.

``ppo_rollout_old``
    ``r = exp(logp - rollout)``; ``loss = -min(r A, clip(r) A)``. PPO with the engine as the "old" policy: every
    version of staleness and every engine-vs-trainer numeric difference lands in the clip. Kept for comparison.
``decoupled_ppo``
    ``r = exp(logp - prox)``; ``w = min(exp(prox - rollout), cap)`` (no grad);
    ``loss = -w min(r A, clip(r) A)``. AReaL's decoupled PPO (Fu et al. 2025; ``ppo_actor_loss_fn`` in
    inclusionAI/AReaL ``areal/utils/functional.py``: ``ratio = exp(logprobs - proximal_logprobs)``, the clipped
    surrogate, times ``behav_imp_weight = exp(proximal_logprobs - old_logprobs)``). AReaL *drops* the tokens whose
    behaviour weight exceeds its cap (``behav_imp_weight_cap``); here they are truncated to the cap, as TIS does, so
    a stale token still counts, at a bounded weight. The clip trust region is around pi_prox, so staleness is
    corrected by ``w`` and no longer spends the clip.
``tis``
    ``w = min(exp(logp - rollout), cap)`` (detached); ``loss = -w logp A``. verl's rollout correction in its
    bypass mode with token-level truncated importance sampling (volcengine/verl
    ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_with_rollout_correction``, ``L = -w log pi A``, the
    weights of ``rollout_corr_helper.compute_rollout_correction_weights``: ``exp(log_ratio)`` clamped at
    ``rollout_is_threshold`` and detached). No clip, no extra forward pass.

One optimizer step per mini-batch (this trainer's): pi_prox is then the very weights the gradient is taken at, so
``r = 1`` there, the clip is idle and ``decoupled_ppo``'s gradient is ``-w A grad logp`` with ``w`` of pi_prox:
the same as ``tis``'s up to the numerics of the two forward passes, for one forward pass more
(docs/design.md, Objectives). The clip only bites where one proximal pass serves several optimizer steps.

Every function takes ``[B, S]`` float tensors (zero at positions the mask leaves out) and returns the per-token
loss and, for the report, the per-token clip indicator and the importance weight before truncation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from admission.config import GrpoConfig
from train.config import ObjectiveConfig


class TokenLoss(NamedTuple):
    """One objective's per-token values (``[B, S]``), unmasked."""

    loss: Any
    """The loss of each token (with grad)."""
    ratio: Any
    """The ratio the objective clips (pi_theta over its "old" policy; ``tis``: pi_theta / pi_rollout)."""
    clipped: Any
    """1.0 where the clip took the token's gradient away, else 0.0 (``tis``: never)."""
    weight: Any
    """The importance weight of the behaviour policy before truncation (``decoupled_ppo``: pi_prox / pi_rollout;
    else pi_theta / pi_rollout), no grad."""


def _clipped_surrogate(ratio: Any, adv: Any, grpo: GrpoConfig) -> tuple[Any, Any]:
    import torch

    clipped = torch.clamp(ratio, 1.0 - grpo.clip_low, 1.0 + grpo.clip_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    return loss, (ratio * adv > clipped * adv).float()


def ppo_rollout_old(logp: Any, batch: dict[str, Any], grpo: GrpoConfig, cap: float) -> TokenLoss:
    """``-min(r A, clip(r) A)`` with ``r = pi_theta / pi_rollout``."""
    import torch

    ratio = torch.exp((logp - batch["rollout_logprobs"]) * batch["loss_mask"])
    loss, clipped = _clipped_surrogate(ratio, batch["advantages"], grpo)
    return TokenLoss(loss, ratio, clipped, ratio.detach())


def decoupled_ppo(logp: Any, batch: dict[str, Any], grpo: GrpoConfig, cap: float) -> TokenLoss:
    """``-min(exp(prox - rollout), cap) * min(r A, clip(r) A)`` with ``r = pi_theta / pi_prox``."""
    import torch

    if "prox_logprobs" not in batch:
        msg = "objective decoupled_ppo needs the batch's prox_logprobs (train.trainer.proximal_logprobs)"
        raise KeyError(msg)
    mask = batch["loss_mask"]
    prox = batch["prox_logprobs"].detach()
    ratio = torch.exp((logp - prox) * mask)
    surrogate, clipped = _clipped_surrogate(ratio, batch["advantages"], grpo)
    weight = torch.exp((prox - batch["rollout_logprobs"]) * mask)
    return TokenLoss(torch.clamp(weight, max=cap) * surrogate, ratio, clipped, weight)


def tis(logp: Any, batch: dict[str, Any], grpo: GrpoConfig, cap: float) -> TokenLoss:
    """``-min(pi_theta / pi_rollout, cap) * logp * A``, the weight detached."""
    import torch

    weight = torch.exp((logp.detach() - batch["rollout_logprobs"]) * batch["loss_mask"])
    loss = -torch.clamp(weight, max=cap) * logp * batch["advantages"]
    return TokenLoss(loss, weight, torch.zeros_like(weight), weight)


OBJECTIVE_FUNCTIONS = {"ppo_rollout_old": ppo_rollout_old, "decoupled_ppo": decoupled_ppo, "tis": tis}
"""Each ``ObjectiveConfig.objective`` by name."""


def token_loss(logp: Any, batch: dict[str, Any], grpo: GrpoConfig, objective: ObjectiveConfig) -> TokenLoss:
    """The per-token values of ``objective`` (see the module docstring)."""
    return OBJECTIVE_FUNCTIONS[objective.objective](logp, batch, grpo, objective.is_cap)


def needs_proximal(objective: ObjectiveConfig) -> bool:
    """Whether the step must recompute the proximal logprobs before its optimizer step."""
    return objective.objective == "decoupled_ppo"
