"""The GPT backbone's part of an optimizer step, shared by the text and the multimodal step.

A step (``train.trainer.TextStep``, ``train.mm_trainer.MultimodalStep``) zeroes the gradients
(:func:`zero_grads`), runs Megatron-core's forward-backward schedule over its micro-batches
(:func:`schedule`, each forward through :func:`forward`: THD attention inputs for packed rows),
steps the Megatron optimizer, and reduces the loss reports into the step's metrics
(:func:`step_metrics`: token means over the DP group, the same keys for every kind of step).
Torch and megatron-core are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from schemas.plan import MicroBatch, MiniBatchPlan
from train.packing import block_causal_mask

if TYPE_CHECKING:
    from train.model import Built


def to_device(tensors: dict[str, Any], dev: Any) -> dict[str, Any]:
    """A packed micro-batch's tensors on ``dev`` (non-tensor values, e.g. a missing cu_seqlens, unchanged)."""
    import torch

    return {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in tensors.items()}


def thd_attention(cu_seqlens: Any, width: int, *, uses_te: bool) -> tuple[Any, Any]:
    """Attention inputs of a packed (THD) row: TE's ``PackedSeqParams`` (a model of the TransformerEngine
    spec, ``uses_te``), a block mask otherwise."""
    if uses_te:
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return None, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                     max_seqlen_q=longest, max_seqlen_kv=longest)
    return block_causal_mask(cu_seqlens.cpu(), width).to(cu_seqlens.device), None


def forward(built: Built, gpt: Any, batch: dict[str, Any], *, decoder_input: Any = None) -> Any:
    """Per-token cross entropy of ``batch``'s labels through ``gpt`` (the schedule's model chunk).

    ``decoder_input`` replaces the token embeddings (the multimodal step adds image features to them).
    """
    mask, packed_seq = None, None
    if batch["cu_seqlens"] is not None:
        mask, packed_seq = thd_attention(batch["cu_seqlens"], batch["tokens"].shape[1], uses_te=built.uses_te)
    return gpt(batch["tokens"], batch["position_ids"], mask, decoder_input=decoder_input, labels=batch["labels"],
               packed_seq_params=packed_seq)


def zero_grads(built: Built) -> None:
    """Clear the DDP gradient buffers and the optimizer's gradients before a step."""
    built.model.zero_grad_buffer()
    built.optimizer.zero_grad()


def schedule(built: Built, forward_step: Callable[[Iterator[Any], Any], tuple[Any, Any]], batches: Iterator[Any],
             num_microbatches: int, seq_length: int) -> list[dict[str, Any]]:
    """Megatron's forward-backward over ``num_microbatches`` micro-batches; the loss reports of each."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reports: list[dict[str, Any]] = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches, model=built.model, num_microbatches=num_microbatches,
        seq_length=seq_length, micro_batch_size=1, forward_only=False)
    return reports


def step_metrics(plan: MiniBatchPlan, micro: Sequence[MicroBatch], reports: Sequence[dict[str, Any]],
                 update: tuple[Any, ...]) -> dict[str, Any]:
    """The metrics every step reports: the plan's position, loss metrics (DP-reduced), the optimizer's update.

    ``update`` is what the Megatron optimizer's ``step()`` returned: ``(ok, grad_norm, zeros)``.
    Collective over the data-parallel group.
    """
    from megatron.core import parallel_state as ps

    from train.loss import reduce_reports
    from train.mcore_compat import device

    ok, grad_norm = update[0], update[1]
    loss = reduce_reports(reports, sum(m.rows for m in micro), group=ps.get_data_parallel_group(), device=device())
    return {"step": plan.step, "train_batch": plan.train_batch, "position": plan.position, **loss,
            "grad_norm": float(grad_norm or 0.0), "update_ok": bool(ok), "micro_batches": len(micro)}
