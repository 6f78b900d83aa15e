"""Weight sync, trainer -> store -> running vLLM engine: after a sync vLLM's logprobs equal the trainer's.

Two subprocesses (this file run as a script), one real store node in the test process:

1. ``megatron``: builds the trainer's GPT (``launcher.model.trainer_model``: the ``tiny-vllm`` preset with the
   tokenizer's vocabulary), moves every weight away from its init (so nothing can pass by chance,
   norms included), computes the trainer's own forward logprobs of a fixed prompt + response
   (``GPTModel(..., labels=...)`` = per-token cross entropy, exactly the loss path of
   ``train.trainer``), and publishes the weights with ``train.loop.publish_weights`` (HF Llama
   names, an Arrow table over Flight) as version 1;
2. ``vllm``: starts the rollout's engine (``connectors.engine.VllmEngine``) on the tiny Llama that
   ``knit run`` builds, scores the same tokens (prompt logprobs) before the sync, loads the published
   weights into the running engine (``engine.load_weights``: ``collective_rpc`` ``reload_weights``),
   and scores them again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flight_store.net import free_port

pytestmark = [pytest.mark.megatron, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64, 128, 5]
RESPONSE = [11, 300, 45, 8, 201, 77, 19, 402, 6, 33, 90, 2]


def _env(**extra: str) -> dict[str, str]:
    from launcher.children import child_env

    env = child_env()
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from launcher.model import prepare_model

    out = tmp_path_factory.mktemp("tiny") / "llama"
    prepare_model(out, seed=0)
    return out


def test_vllm_logprobs_equal_the_trainer_forward_after_sync(store_nodes, tiny_model: Path,  # type: ignore[no-untyped-def]
                                                           tmp_path: Path) -> None:
    (server,) = store_nodes(1)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    assert max(PROMPT + RESPONSE) < vocab
    trainer_out, vllm_out = tmp_path / "trainer.json", tmp_path / "vllm.json"
    megatron_env = _env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(free_port()))
    res = subprocess.run([sys.executable, __file__, "megatron", server.location, str(vocab), str(trainer_out)],
                         cwd=ROOT, env=megatron_env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = subprocess.run([sys.executable, __file__, "vllm", server.location, str(tiny_model), str(vllm_out)],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    trainer = json.loads(trainer_out.read_text())
    got = json.loads(vllm_out.read_text())

    assert trainer["tensors"] == got["tensors_loaded"] == 2 + 1 + 9 * 2  # every tensor of the model moved
    ref = np.array(trainer["logprobs"])
    before, after = np.array(got["before"]), np.array(got["after"])
    assert ref.shape == after.shape == (len(RESPONSE),)
    # before the sync the engine runs its own (different) weights ...
    assert np.abs(before - ref).max() > 1e-2
    # ... after it, vLLM's logprobs are the trainer's own forward logprobs (fp32 on both sides)
    np.testing.assert_allclose(after, ref, atol=1e-4, rtol=0)
    print(f"weight sync: max |vLLM - trainer| logprob before {np.abs(before - ref).max():.3g}, "
          f"after {np.abs(after - ref).max():.3g}")


# ---- the subprocesses -------------------------------------------------------------------------


def _megatron(location: str, vocab: str, out: str) -> None:
    import types

    import torch

    from flight_store.publishing import StorePublisher
    from flight_store.writing import StoreWriter
    from launcher.model import trainer_model
    from train import mcore_compat, model
    from train.config import ParallelConfig
    from train.loop import publish_weights

    env = mcore_compat.init_distributed(ParallelConfig(backend="gloo"), seed=1234)
    gpt, _ = model.build_gpt(trainer_model(int(vocab)), tensor_parallel=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.rand(p.shape, generator=gen))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    gpt.eval()
    tokens = torch.tensor([PROMPT + RESPONSE])
    labels = torch.tensor([[*PROMPT[1:], *RESPONSE, 0]])
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        ce = gpt(tokens, positions, None, labels=labels)  # the trainer's loss path: -logprob of each label
    logp = (-ce[0].double()).tolist()
    response_logprobs = [logp[len(PROMPT) - 1 + i] for i in range(len(RESPONSE))]
    with StorePublisher(location) as client, StoreWriter.sharing(client) as writer:
        publish_weights(types.SimpleNamespace(gpt=gpt), client, 1, env)
        client.publish_version(1)
        tensors = writer.get_weights(1).num_rows
    Path(out).write_text(json.dumps({"logprobs": response_logprobs, "tensors": tensors}))
    mcore_compat.shutdown()


def _vllm(location: str, model_dir: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from connectors.config import RolloutConfig
    from connectors.engine import VllmEngine
    from flight_store.writing import StoreWriter

    cfg = RolloutConfig(model=model_dir, stores=[location], max_model_len=512, max_num_seqs=4, dtype="float32")
    engine = VllmEngine(cfg)
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)

    def score() -> list[float]:
        o: Any = engine.llm.generate([TokensPrompt(prompt_token_ids=PROMPT + RESPONSE)], params, use_tqdm=False)[0]
        return [float(o.prompt_logprobs[len(PROMPT) + i][t].logprob) for i, t in enumerate(RESPONSE)]

    before = score()
    with StoreWriter(location) as client:
        table = client.get_weights(client.get_version())
    engine.load_weights(table)
    after = score()
    Path(out).write_text(json.dumps({"before": before, "after": after, "tensors_loaded": table.num_rows}))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mode, *rest = sys.argv[1:]
    {"megatron": _megatron, "vllm": _vllm}[mode](*rest)
