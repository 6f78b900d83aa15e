"""Check a Megatron checkpoint against its HF Llama view: ``python -m train.verify --nproc 2 --tp 2 ...``.

Per run (every rank participates, started by ``train.launch.run_ranks``; rank 0 writes ``--out``):

1. build the model at ``--tp`` and load ``--load-dir`` (a dist checkpoint, saved under any TP
   layout), or build it from ``--hf-checkpoint`` (an HF Llama folder: shape and weights), or keep a
   random init with randomised norm weights when no checkpoint is given;
2. gather the weights under HF Llama names (``train.hf_llama.megatron_to_hf_llama``);
3. with ``--store``: compare them bit for bit with the weights table published at ``--version``;
   with ``--hf-checkpoint``: with the checkpoint's own tensors (the load and the gather are inverses);
4. load them into a float32 ``transformers.LlamaForCausalLM`` and compare its logits with the
   Megatron forward (TP-gathered logits) on a random batch: the real check of the name and layout
   mapping (interleaved QKV per query group, fused gate/up, norm placement);
5. with ``--save-dir``: save a checkpoint, zero the weights, load it back, and compare.

Step 4 needs transformers (it comes with vLLM) and is skipped without it; never imports vLLM.

An ``--hf-checkpoint`` folder of the vision-language model (Idefics3, ``tiny-vl``) gets its own checks instead, on
one rank (``train.vl_check.self_check``: the weights there and back bit for bit, logits and tower gradients against
transformers, the deduplicated tower's gradients), and with ``--store`` the published version against the folder's
weights gathered from Megatron, bit for bit.
A developer tool: its few flags are its own (no config class).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Sequence
from typing import Any


def _check(args: argparse.Namespace) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from train import mcore_compat, model, vl_model
    from train.config import ModelConfig, ParallelConfig
    from train.hf_llama import megatron_to_hf_llama

    t0 = time.perf_counter()
    stages: dict[str, float] = {}

    def mark(name: str) -> None:
        stages[name] = round(time.perf_counter() - t0, 3)

    if args.hf_checkpoint and vl_model.is_vl_folder(args.hf_checkpoint):
        return _check_vl(args)
    env = mcore_compat.init_distributed(ParallelConfig(tensor_parallel=args.tp), seed=args.seed)
    cfg = ModelConfig(hf_checkpoint=args.hf_checkpoint) if args.hf_checkpoint else ModelConfig.preset(args.model)
    gpt, _ = model.build_gpt(cfg, tensor_parallel=args.tp)
    result: dict[str, Any] = {"env": env, "stages_s": stages}
    mark("built")
    if args.load_dir:
        model.load_checkpoint(gpt, args.load_dir)
        mark("loaded")
    elif not args.hf_checkpoint:  # random norms too, so that a swapped norm mapping cannot pass
        _randomise_norms(gpt)
    hf = megatron_to_hf_llama(gpt)
    result["hf_names"] = sorted(hf)
    mark("converted")
    if args.store:
        result["store_mismatch"] = _store_mismatch(args.store, args.version, hf)
    if args.hf_checkpoint:
        result["hf_checkpoint_mismatch"] = _checkpoint_mismatch(args.hf_checkpoint, hf, tied=cfg.tie_embeddings)
    logits, tokens = _megatron_logits(gpt, cfg.vocab_size)
    if env["rank"] == 0 and importlib.util.find_spec("transformers") is not None:
        result.update(_hf_logits_diff(cfg, hf, tokens, logits))
        mark("hf_compared")
    if args.save_dir:
        result["roundtrip_mismatch"] = _roundtrip(gpt, args.save_dir)
        mark("roundtrip")
    result["tp_size"] = ps.get_tensor_model_parallel_world_size()
    if env["rank"] == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    mcore_compat.shutdown()
    return result


def _check_vl(args: argparse.Namespace) -> dict[str, Any]:
    """The vision-language folder's checks (``train.vl_check.self_check``), one rank; with ``--store``, the
    folder's weights gathered from Megatron against the version published there, bit for bit."""
    from train import mcore_compat, vl_check, vl_model
    from train.config import ParallelConfig

    if args.tp != 1 or args.nproc != 1:
        msg = f"{args.hf_checkpoint}: the vision-language model is checked on one rank (got --tp {args.tp})"
        raise ValueError(msg)
    env = mcore_compat.init_distributed(ParallelConfig(backend="gloo"), seed=args.seed)
    result: dict[str, Any] = {"env": env, "model": "idefics3", **vl_check.self_check(args.hf_checkpoint)}
    if args.store:
        net = vl_model.build_vl_model(vl_model.read_config(args.hf_checkpoint))
        vl_model.load_hf_vl_checkpoint(net, args.hf_checkpoint)
        result["store_mismatch"] = _store_mismatch(args.store, args.version, vl_model.megatron_to_hf_vl(net))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    mcore_compat.shutdown()
    return result


def _randomise_norms(gpt: Any) -> None:
    import torch

    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if name.endswith("norm.weight") or "layer_norm" in name:
                p.copy_(1 + 0.5 * torch.rand(p.shape, generator=gen))


def _store_mismatch(location: str, version: int | None, hf: dict[str, Any]) -> list[str]:
    """Names whose published tensor (at ``version``) differs from ``hf``'s, or is on one side only."""
    import torch

    from flight_store.writing import StoreWriter
    from train.hf_llama import read_weights

    with StoreWriter(location) as client:
        stored = read_weights(client.get_weights(version))
    return sorted(k for k in set(stored) | set(hf)
                  if k not in stored or k not in hf or not torch.equal(stored[k], hf[k]))


def _checkpoint_mismatch(folder: str, hf: dict[str, Any], *, tied: bool) -> list[str]:
    """Names whose gathered tensor differs from the HF checkpoint's, or is on one side only (a tied
    ``lm_head.weight`` is the embedding, not a tensor of its own)."""
    import torch

    from train.hf_llama import read_hf_weights

    stored = {k: v for k, v in read_hf_weights(folder).items() if not (tied and k == "lm_head.weight")}
    return sorted(k for k in set(stored) | set(hf)
                  if k not in stored or k not in hf or not torch.equal(stored[k].to(hf[k].dtype), hf[k]))


def _megatron_logits(gpt: Any, vocab_size: int) -> tuple[Any, Any]:
    """TP-gathered logits ``[b, s, V]`` of a fixed random batch, and the batch."""
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab_size, (2, 24), generator=gen)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = gpt(tokens, positions, None)  # [b, s, V/tp]
        return gather_from_tensor_model_parallel_region(logits.contiguous()), tokens


def _hf_logits_diff(cfg: Any, hf: dict[str, Any], tokens: Any, logits: Any) -> dict[str, float]:
    """The HF ``LlamaForCausalLM`` with ``hf`` loaded: its largest logit difference from Megatron's, and scale."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from train.hf_llama import hf_llama_config

    fields = {k: v for k, v in hf_llama_config(cfg).items() if k not in ("architectures", "model_type")}
    fields["torch_dtype"] = "float32"
    ref = LlamaForCausalLM(LlamaConfig(**fields)).float().eval()
    missing, unexpected = ref.load_state_dict(hf, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_embeddings else set()):
        msg = f"HF Llama state dict mismatch: missing {missing}, unexpected {unexpected}"
        raise KeyError(msg)
    with torch.no_grad():
        ref_logits = ref(input_ids=tokens).logits
    return {"hf_logits_max_abs_diff": float((ref_logits - logits.float()).abs().max()),
            "logits_scale": float(ref_logits.abs().max())}


def _roundtrip(gpt: Any, save_dir: str) -> int:
    """Save, zero, load: the number of tensors that differ afterwards, summed over ranks."""
    import torch
    import torch.distributed as dist

    from train import model

    before = {k: v.clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}
    model.save_checkpoint(gpt, save_dir)
    with torch.no_grad():
        for p in gpt.parameters():
            p.zero_()
    model.load_checkpoint(gpt, save_dir)
    after = gpt.state_dict()
    flags = torch.tensor([sum(not torch.equal(after[k], v) for k, v in before.items())], dtype=torch.int64)
    dist.all_reduce(flags)
    return int(flags.item())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.verify", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--load-dir", default=None)
    p.add_argument("--hf-checkpoint", default=None, help="build the model from this HF Llama checkpoint folder")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--store", default=None, help="store location holding published weights to compare")
    p.add_argument("--version", type=int, default=None, help="weights version to compare (default: latest)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="JSON result (rank 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks in ``--nproc`` local ranks (or as one rank under torchrun)."""
    from train.launch import run_ranks

    args = _parser().parse_args(argv)
    run_ranks(_check, args, nproc=args.nproc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
