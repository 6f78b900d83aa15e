"""Your own engine, in full: trajectories from plain Hugging Face ``generate()`` written through ``StoreWriter``.

``python -m connectors.hf_generate --model DIR --stores grpc://HOST:PORT[,...] [--groups 4] [--group-size 4]``

An example of what any engine does to feed knittrans, with no vLLM and no knittrans engine code: transformers
samples G responses per prompt (``generate(do_sample=True, output_logits=True)``), the logprob of each sampled
token is read off the raw logits (``raw_logprobs``: before temperature and top-p, the trainer's own
forward), the built-in task scores each response, and each group goes to the stores as one record batch of
``schemas.records.TrajectoryRecord`` rows with ``StoreWriter.put_group`` (the node routing picks; a retry of
the same group is a no-op). The version written is the one the stores publish (0 before any). A trainer then
admits and trains these groups as it does the rollout's.

Needs torch and transformers (the ``vllm`` extra brings both).
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from connectors.tasks import REWARDS, mixed_prompts
from connectors.vllm import ENGINE_KEY, LOGPROBS_MODE_KEY
from flight_store.writing import StoreWriter
from schemas.records import TrajectoryRecord, records_to_batch


def sample_group(model: Any, tokenizer: Any, prompt_ids: list[int], n: int, max_tokens: int,
                 temperature: float = 1.0) -> list[tuple[list[int], list[float], str]]:
    """``n`` sampled responses to ``prompt_ids``: each one's token ids, the raw logprob of each sampled token,
    and its finish reason (``stop`` at the end-of-sequence token, else ``length``)."""
    import torch

    eos = tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids] * n), attention_mask=torch.ones(n, len(prompt_ids),
                                                                                         dtype=torch.long),
                             do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=eos)
    new = out.sequences[:, len(prompt_ids):]
    logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1).gather(-1, new[..., None])[..., 0]
    responses = []
    for ids, lps in zip(new.tolist(), logprobs.tolist(), strict=True):
        stopped = eos in ids
        end = ids.index(eos) + 1 if stopped else len(ids)  # through the end-of-sequence token, padding cut
        responses.append((ids[:end], lps[:end], "stop" if stopped else "length"))
    return responses


def write_groups(model_dir: str, stores: Sequence[str], *, groups: int, group_size: int, max_tokens: int,
                 seed: int = 0, reward: str = "digits", prefix: str = "hf") -> list[str]:
    """Generate ``groups`` prompt groups of ``group_size`` and write each to the stores; returns their ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    score = REWARDS[reward]
    written = []
    with StoreWriter(list(stores)) as client:
        version = int(client.get_version())
        for g, prompt in enumerate(itertools.islice(mixed_prompts({"add_small": 1.0}, seed=seed), groups)):
            prompt_ids = [int(t) for t in tokenizer.encode(prompt.text)]
            rows = [TrajectoryRecord(group_id=f"{prefix}-{g}", sample_idx=i, policy_version=version,
                                     data_source=prompt.data_source, prompt_ids=prompt_ids, response_ids=ids,
                                     response_logprobs=lps, finish_reason=finish,
                                     reward=score(prompt.text, str(tokenizer.decode(ids, skip_special_tokens=True)),
                                                  prompt.sample))
                    for i, (ids, lps, finish) in enumerate(sample_group(model, tokenizer, prompt_ids, group_size,
                                                                         max_tokens))]
            batch = records_to_batch(rows)
            batch = batch.replace_schema_metadata({LOGPROBS_MODE_KEY: b"raw_logprobs", ENGINE_KEY: b"hf-generate"})
            client.put_group(pa.Table.from_batches([batch]))
            written.append(f"{prefix}-{g}")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m connectors.hf_generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face causal LM folder (weights and tokenizer)")
    parser.add_argument("--stores", required=True, help="store locations, comma-separated")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix", default=f"hf{os.getpid()}", help="group id prefix (ids are unique per cluster)")
    args = parser.parse_args(argv)
    ids = write_groups(args.model, args.stores.split(","), groups=args.groups, group_size=args.group_size,
                       max_tokens=args.max_tokens, seed=args.seed, prefix=args.prefix)
    print(f"wrote {len(ids)} groups of {args.group_size}: {', '.join(ids)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
