"""Check a Megatron checkpoint against its HF Llama view: ``python -m train.verify --nproc 2 --tp 2 ...``.

Per run (every rank participates; rank 0 writes ``--out``):

1. build the model at ``--tp`` and load ``--load-dir`` (a dist checkpoint, saved under any TP
   layout), or keep a random init with randomised norm weights when no checkpoint is given;
2. gather the weights under HF Llama names (``train.weights.megatron_to_hf_llama``);
3. with ``--store``: compare them bit for bit with the weights table published at ``--version``;
4. load them into a float32 ``transformers.LlamaForCausalLM`` and compare its logits with the
   Megatron forward (TP-gathered logits) on a random batch: the real check of the name and layout
   mapping (interleaved QKV per query group, fused gate/up, norm placement);
5. with ``--save-dir``: save a checkpoint, zero the weights, load it back, and compare.

Step 4 needs transformers (it comes with vLLM) and is skipped without it; never imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any


def _check(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from train import mcore_compat, model
    from train.config import ModelConfig, ParallelConfig
    from train.weights import arrow_to_weights, hf_llama_config, megatron_to_hf_llama

    t0 = time.perf_counter()
    stages: dict[str, float] = {}

    def mark(name: str) -> None:
        stages[name] = round(time.perf_counter() - t0, 3)

    env = mcore_compat.init_distributed(ParallelConfig(tensor_parallel=args.tp), seed=args.seed)
    cfg = ModelConfig.preset(args.model)
    gpt, _ = model.build_gpt(cfg, tensor_parallel=args.tp)
    result: dict[str, Any] = {"env": env, "stages_s": stages}
    mark("built")
    if args.load_dir:
        model.load_checkpoint(gpt, args.load_dir)
        mark("loaded")
    else:  # random norms too, so that a swapped norm mapping cannot pass
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                if name.endswith("norm.weight") or "layer_norm" in name:
                    p.copy_(1 + 0.5 * torch.rand(p.shape, generator=gen))
    hf = megatron_to_hf_llama(gpt)
    result["hf_names"] = sorted(hf)
    mark("converted")

    if args.store:
        from flight_store.client import StoreClient

        with StoreClient(args.store) as client:
            stored = arrow_to_weights(client.get_weights(args.version))
        result["store_mismatch"] = sorted(k for k in set(stored) | set(hf)
                                          if k not in stored or k not in hf or not torch.equal(stored[k], hf[k]))

    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = gpt(tokens, positions, None)  # [b, s, V/tp]
        logits = gather_from_tensor_model_parallel_region(logits.contiguous())
    import importlib.util

    if env["rank"] == 0 and importlib.util.find_spec("transformers") is not None:
        from transformers import LlamaConfig, LlamaForCausalLM

        fields = {k: v for k, v in hf_llama_config(cfg).items() if k not in ("architectures", "model_type")}
        fields["torch_dtype"] = "float32"
        ref = LlamaForCausalLM(LlamaConfig(**fields)).float().eval()
        ref.load_state_dict(hf, strict=True)
        with torch.no_grad():
            ref_logits = ref(input_ids=tokens).logits
        result["hf_logits_max_abs_diff"] = float((ref_logits - logits.float()).abs().max())
        result["logits_scale"] = float(ref_logits.abs().max())
        mark("hf_compared")

    if args.save_dir:
        before = {k: v.clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}
        model.save_checkpoint(gpt, args.save_dir)
        with torch.no_grad():
            for p in gpt.parameters():
                p.zero_()
        model.load_checkpoint(gpt, args.save_dir)
        after = gpt.state_dict()
        bad = [k for k, v in before.items() if not torch.equal(after[k], v)]
        flags = torch.tensor([len(bad)], dtype=torch.int64)
        dist.all_reduce(flags)
        result["roundtrip_mismatch"] = int(flags.item())
        mark("roundtrip")
    result["tp_size"] = ps.get_tensor_model_parallel_world_size()
    if env["rank"] == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    mcore_compat.shutdown()
    return result


def _rank(local_rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _check(_parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.verify", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--load-dir", default=None)
    p.add_argument("--save-dir", default=None)
    p.add_argument("--store", default=None, help="store location holding published weights to compare")
    p.add_argument("--version", type=int, default=None, help="weights version to compare (default: latest)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="JSON result (rank 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks in ``--nproc`` local ranks (or as one rank under torchrun)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if "WORLD_SIZE" in os.environ:
        _check(args)
        return 0
    import torch.multiprocessing as mp

    from train.entry import _free_port

    mp.spawn(_rank, args=(args.nproc, _free_port(), argv), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
