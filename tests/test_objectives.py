"""The policy objectives (train.objectives through train.loss.policy_loss) against references written out in numpy.

One fixed batch of six tokens (one left out by the mask) with stale and fresh tokens, positive and negative
advantages: each objective's loss sum, gradient and off-policy report equal the formulas computed here by hand,
independently of the torch code; the report's reduction (gloo, one rank) gives the step's means and maxima.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from admission.config import GrpoConfig
from train.config import ObjectiveConfig

torch = pytest.importorskip("torch")

GRPO = GrpoConfig(clip_low=0.2, clip_high=0.28)
CAP = 1.5
LOGP = np.array([-1.0, -0.7, -2.0, -0.5, -1.2, -0.9])  # pi_theta
ROLLOUT = np.array([-1.0, -1.5, -1.0, -0.5, -0.4, -3.0])  # pi_behaviour (the engine's)
PROX = np.array([-1.1, -0.8, -1.9, -0.5, -1.0, -0.95])  # pi_prox (the trainer's, before the step)
ADV = np.array([1.0, 1.0, -1.0, 2.0, -0.5, 1.5])
MASK = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
VERSIONS = np.array([7, 7, 5, 9, 6, 7])


def _batch(prox: bool) -> dict[str, Any]:
    out = {"rollout_logprobs": ROLLOUT, "advantages": ADV, "loss_mask": MASK, "token_versions": VERSIONS}
    if prox:
        out["prox_logprobs"] = PROX
    return {k: torch.tensor(v[None, :], dtype=torch.int64 if k == "token_versions" else torch.float32)
            for k, v in out.items()}


def _run(objective: str) -> tuple[float, np.ndarray, dict[str, Any]]:
    from train.loss import policy_loss

    ce = torch.tensor(-LOGP[None, :], dtype=torch.float32, requires_grad=True)
    loss_sum, count, report = policy_loss(ce, _batch(objective == "decoupled_ppo"), GRPO,
                                          ObjectiveConfig(objective=objective, is_cap=CAP))  # type: ignore[arg-type]
    assert int(count) == 5
    loss_sum.backward()
    return float(loss_sum.detach()), -ce.grad.numpy()[0], report  # the gradient with respect to logp


def _surrogate(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``-min(r A, clip(r) A)``, whether the clip won, and d/dlogp of the loss (r d/dr when unclipped)."""
    clipped = np.clip(r, 1 - GRPO.clip_low, 1 + GRPO.clip_high)
    won = r * ADV > clipped * ADV
    return -np.minimum(r * ADV, clipped * ADV), won, np.where(won, 0.0, -r * ADV)


def test_ppo_rollout_old_is_the_clip_of_pi_theta_over_pi_rollout() -> None:
    loss, grad, report = _run("ppo_rollout_old")
    r = np.exp(LOGP - ROLLOUT)
    per_token, won, d = _surrogate(r)
    assert loss == pytest.approx(float((per_token * MASK).sum()), rel=1e-5)
    np.testing.assert_allclose(grad, d * MASK, rtol=1e-5, atol=1e-7)
    assert report["clip_frac"].tolist() == pytest.approx([float((won * MASK).sum()), 5.0])
    assert won[1] and won[5] and not won[0]  # the stale tokens spent the clip


def test_decoupled_ppo_clips_around_pi_prox_and_weights_by_truncated_pi_prox_over_pi_rollout() -> None:
    loss, grad, report = _run("decoupled_ppo")
    r = np.exp(LOGP - PROX)
    w = np.minimum(np.exp(PROX - ROLLOUT), CAP)
    per_token, _, d = _surrogate(r)
    assert loss == pytest.approx(float((w * per_token * MASK).sum()), rel=1e-5)
    np.testing.assert_allclose(grad, w * d * MASK, rtol=1e-5, atol=1e-7)
    raw = np.exp(PROX - ROLLOUT) * MASK
    assert report["is_weight"].tolist() == pytest.approx([float(raw.sum()), 5.0], rel=1e-5)
    assert report["is_truncated"].tolist() == pytest.approx([float((raw > CAP).sum()), 5.0])
    assert float(report["is_weight_max"]) == pytest.approx(float(raw.max()), rel=1e-5)
    assert (raw > CAP).sum() == 2  # the two stale tokens are truncated, not dropped: w = CAP for them
    assert w[1] == w[5] == CAP


def test_tis_is_the_policy_gradient_times_the_truncated_weight() -> None:
    loss, grad, report = _run("tis")
    w = np.minimum(np.exp(LOGP - ROLLOUT), CAP)
    assert loss == pytest.approx(float((-w * LOGP * ADV * MASK).sum()), rel=1e-5)
    np.testing.assert_allclose(grad, -w * ADV * MASK, rtol=1e-5, atol=1e-7)  # the weight carries no gradient
    assert report["clip_frac"].tolist() == [0.0, 5.0]


def test_at_pi_prox_equal_to_pi_theta_decoupled_ppo_has_the_gradient_of_tis() -> None:
    """One optimizer step per mini-batch: the proximal pass runs on the weights the gradient is taken at."""
    from train.loss import policy_loss

    grads = []
    for objective in ("decoupled_ppo", "tis"):
        ce = torch.tensor(-LOGP[None, :], dtype=torch.float32, requires_grad=True)
        batch = _batch(False) | {"prox_logprobs": torch.tensor(LOGP[None, :], dtype=torch.float32)}
        policy_loss(ce, batch, GRPO, ObjectiveConfig(objective=objective, is_cap=CAP))[0].backward()  # type: ignore[arg-type]
        grads.append(ce.grad.numpy().copy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)


def test_the_report_reduces_to_the_step_s_off_policy_metrics() -> None:
    """KL(pi_rollout || pi_theta) by k3, weights' mean and max, token versions' mean and min, over two micro-batches
    (the second with one token), as the step's metrics."""
    import torch.distributed as dist

    from flight_store.net import free_port
    from train.loss import policy_loss, reduce_reports

    cfg = ObjectiveConfig(objective="ppo_rollout_old", is_cap=CAP)
    reports = [policy_loss(torch.tensor(-LOGP[None, :], dtype=torch.float32), _batch(False), GRPO, cfg)[2]]
    one = {k: v[:, :1] for k, v in _batch(False).items()} | {"token_versions": torch.tensor([[3]])}
    reports.append(policy_loss(torch.tensor([[-LOGP[0]]], dtype=torch.float32), one, GRPO, cfg)[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        got = reduce_reports(reports, 7, group=None, device="cpu")
    finally:
        dist.destroy_process_group()
    m = MASK > 0
    log_r = np.concatenate([(LOGP - ROLLOUT)[m], [LOGP[0] - ROLLOUT[0]]])
    r = np.exp(log_r)
    assert got["kl_behaviour_k3"] == pytest.approx(float(np.mean(r - 1 - log_r)), rel=1e-5)
    assert got["is_weight_mean"] == pytest.approx(float(r.mean()), rel=1e-5)
    assert got["is_weight_max"] == pytest.approx(float(r.max()), rel=1e-5)
    assert got["is_truncated_frac"] == pytest.approx(float(np.mean(r > CAP)))
    assert got["token_version_mean"] == pytest.approx(float(np.concatenate([VERSIONS[m], [3]]).mean()))
    assert got["token_version_min"] == 3 and got["loss_tokens"] == 6 and got["rows"] == 7


def test_an_objective_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'ppo' is not one of"):
        ObjectiveConfig(objective="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"is_cap=0\.5"):
        ObjectiveConfig(is_cap=0.5)
    from train.loss import policy_loss

    with pytest.raises(KeyError, match="prox_logprobs"):
        policy_loss(torch.zeros(1, 6), _batch(False), GRPO, ObjectiveConfig(objective="decoupled_ppo"))


@pytest.mark.parametrize("objective", ["ppo_rollout_old", "decoupled_ppo", "tis"])
def test_a_masked_token_contributes_no_gradient_whatever_its_values(objective: str) -> None:
    """A multi-turn row's tool tokens (mask 0) carry logprob 0, any advantage and any version: the loss and the
    gradient are those of the same row with other values there, bit for bit, and the masked token's gradient is 0."""
    from train.loss import policy_loss

    def run(rollout: float, prox: float, adv: float) -> tuple[Any, Any]:
        batch = _batch(True)
        batch["rollout_logprobs"][0, 3], batch["prox_logprobs"][0, 3], batch["advantages"][0, 3] = rollout, prox, adv
        ce = torch.tensor(-LOGP[None, :], dtype=torch.float32, requires_grad=True)
        loss_sum, count, _ = policy_loss(ce, batch, GRPO, ObjectiveConfig(objective=objective, is_cap=CAP))  # type: ignore[arg-type]
        loss_sum.backward()
        assert int(count) == 5
        return loss_sum.detach(), ce.grad

    loss, grad = run(0.0, 0.0, 0.0)  # what the agent loop writes at a tool token
    assert grad[0, 3].item() == 0.0 and bool((grad != 0).any())
    for values in ((-0.5, -0.5, 2.0), (-30.0, 5.0, -7.0)):
        other_loss, other_grad = run(*values)
        assert torch.equal(loss, other_loss) and torch.equal(grad, other_grad)


@pytest.mark.parametrize("objective", ["ppo_rollout_old", "decoupled_ppo", "tis"])
def test_a_single_turn_row_gives_the_loss_of_a_mask_of_ones(objective: str) -> None:
    """A single-turn row as the engine connector writes it: mask all ones, ``loss_tokens`` its length,
    ``num_turns`` 1; its loss and gradient are those of a mask of ones, bit for bit."""
    from connectors.fake_engine import FakeCompletion, FakeFlatLogprobs, FakeRequestOutput
    from connectors.vllm import group_to_batch
    from train.loss import policy_loss

    ids = list(range(6))
    out = FakeRequestOutput(request_id="g", prompt_token_ids=[1, 2], outputs=[FakeCompletion(
        index=0, token_ids=ids, logprobs=FakeFlatLogprobs.from_positions([[(t, float(lp))] for t, lp in
                                                                          zip(ids, ROLLOUT, strict=True)]),
        finish_reason="stop")])
    row = group_to_batch(out, group_id="g", policy_version=0, data_source="s").to_pylist()[0]
    assert row["num_turns"] == 1 and row["loss_tokens"] == 6 and row["loss_mask"] == [1] * 6
    results = []
    for mask in (torch.tensor([row["loss_mask"]], dtype=torch.float32), torch.ones(1, 6)):
        batch = _batch(True) | {"loss_mask": mask}
        ce = torch.tensor(-LOGP[None, :], dtype=torch.float32, requires_grad=True)
        loss_sum, _, _ = policy_loss(ce, batch, GRPO, ObjectiveConfig(objective=objective, is_cap=CAP))  # type: ignore[arg-type]
        loss_sum.backward()
        results.append((loss_sum.detach(), ce.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
