"""Weight sync, trainer -> store -> running vLLM engine: after a sync vLLM's logprobs equal the trainer's, in
process and through a served vLLM's own weight-transfer API.

Two subprocesses (this file run as a script), one real store node in the test process, and a ``vllm serve``:

1. ``megatron``: builds the trainer's GPT (``launcher.model.trainer_model``: the ``tiny-vllm`` preset with the
   tokenizer's vocabulary), moves every weight away from its init (so nothing can pass by chance,
   norms included), computes the trainer's own forward logprobs of a fixed prompt + response
   (``GPTModel(..., labels=...)`` = per-token cross entropy, exactly the loss path of
   ``train.trainer``), and publishes the weights with ``train.loop.publish_weights`` (HF Llama
   names, an Arrow table over Flight) as version 1;
2. ``vllm``: starts the rollout's engine (``connectors.engine.VllmEngine``) on the tiny Llama that
   ``knit run`` builds, scores the same tokens (prompt logprobs) before the sync, loads the published
   weights into the running engine (``engine.load_weights``: ``collective_rpc`` ``reload_weights``),
   and scores them again;
3. the served engine: ``vllm serve`` of the same folder with ``--weight-transfer-config '{"backend":
   "knittrans"}'``, driven by ``connectors.served.ServedEngine`` from the test process (the server reads version 1
   from the store node itself); and a served tiny model with tied embeddings (SmolLM2's layout) against a
   transformers forward of the weights it loaded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
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


@pytest.fixture(scope="module")
def published(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    """A store node holding the trainer's weights as version 1 (published by the ``megatron`` subprocess), and the
    trainer's own logprobs of ``RESPONSE``."""
    from flight_store.config import ServerConfig
    from flight_store.server import StoreServer

    server = StoreServer(ServerConfig())
    try:
        vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
        assert max(PROMPT + RESPONSE) < vocab
        out = tmp_path_factory.mktemp("trainer") / "trainer.json"
        env = _env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        res = subprocess.run([sys.executable, __file__, "megatron", server.location, str(vocab), str(out)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        yield server.location, json.loads(out.read_text())
    finally:
        server.shutdown()


def test_vllm_logprobs_equal_the_trainer_forward_after_sync(published: tuple[str, dict[str, Any]], tiny_model: Path,
                                                           tmp_path: Path) -> None:
    location, trainer = published
    vllm_out = tmp_path / "vllm.json"
    res = subprocess.run([sys.executable, __file__, "vllm", location, str(tiny_model), str(vllm_out)],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
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


def test_served_vllm_takes_the_weights_through_its_rl_api_and_serves_token_in_token_out(
        published: tuple[str, dict[str, Any]], tiny_model: Path, tmp_path: Path) -> None:
    """A real ``vllm serve`` (the command ``knit run --engine vllm-server`` starts) with knittrans' weight-transfer
    engine, found through this distribution's ``vllm.general_plugins`` entry point: the served logprobs equal the
    trainer's after ``load_version``, a version that is not published fails and leaves the weights as they were, and
    the server answers groups and aborts as a ``ServedEngine``."""
    from connectors.config import RolloutConfig
    from connectors.served import SERVER_ENV, EngineServerError, ServedEngine, server_command

    location, trainer = published
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = RolloutConfig(model=str(tiny_model), stores=[location], engine="vllm-server", engine_url=url,
                        max_model_len=512, max_num_seqs=4, max_tokens=8)
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(server_command(cfg, port), cwd=ROOT, env=_env(**SERVER_ENV), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    engine = None
    try:
        engine = ServedEngine(cfg, url, start_timeout_s=240.0)

        def score() -> np.ndarray:
            doc = engine._post("/v1/completions", {"model": engine.model_name, "prompt": PROMPT + RESPONSE,
                                                   "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
            lps = doc["choices"][0]["prompt_logprobs"]
            return np.array([lps[len(PROMPT) + i][str(t)]["logprob"] for i, t in enumerate(RESPONSE)])

        ref = np.array(trainer["logprobs"])
        before = score()
        assert np.abs(before - ref).max() > 1e-2
        engine.load_version(1)
        after = score()
        np.testing.assert_allclose(after, ref, atol=1e-4, rtol=0)  # the trainer's own forward logprobs
        assert engine.weight_version() == "1"
        with pytest.raises(EngineServerError, match=f"POST {url}/update_weights: HTTP 500"):
            engine.load_version(7)  # never published
        np.testing.assert_allclose(score(), after, atol=0, rtol=0)  # still version 1's weights, serving
        assert engine.weight_version() == "1"

        vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
        engine.submit_tokens("long", PROMPT, 400, ())
        engine.abort(["long"])
        engine.submit_tokens("turn", PROMPT, 8, ())
        got: dict[str, Any] = {}
        deadline = time.monotonic() + 60
        while "turn" not in got and time.monotonic() < deadline:
            got.update({o.request_id: o for o in engine.step()})
        assert list(got) == ["turn"]  # nothing of the aborted request comes back
        (c,) = got["turn"].outputs
        assert 1 <= len(c.token_ids) <= 8 and all(0 <= t < vocab for t in c.token_ids)
        assert len(c.logprobs.logprobs) == len(c.token_ids) and max(c.logprobs.logprobs) <= 0.0
        assert c.finish_reason in ("stop", "length")
    finally:
        if engine is not None:
            engine.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


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


def test_served_vllm_of_a_tied_embedding_model_serves_the_loaded_weights(tmp_path: Path) -> None:
    """A model whose output layer is its embedding (SmolLM2's layout: no ``lm_head.weight`` travels): after the
    served engine loads a version, its logprobs are a transformers forward of that version's weights, so the
    output layer follows the embedding inside the server."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from connectors.config import RolloutConfig
    from connectors.served import SERVER_ENV, ServedEngine, server_command
    from connectors.tiny_model import build_tiny_llama
    from flight_store.config import ServerConfig
    from flight_store.publishing import StorePublisher
    from flight_store.server import StoreServer
    from schemas import weights

    model_dir = build_tiny_llama(tmp_path / "tied", layers=2, hidden=64, heads=2, kv_heads=1, tie_embeddings=True)
    start = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in start
    gen = torch.Generator().manual_seed(1)
    new = {k: (v + 0.1 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in start.items()}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.load_state_dict(new, strict=False)
    hf.tie_weights()
    ids = PROMPT + RESPONSE
    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    ref = np.array([float(logp[i - 1, ids[i]]) for i in range(1, len(ids))])

    store = StoreServer(ServerConfig())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = RolloutConfig(model=str(model_dir), stores=[store.location], engine="vllm-server", engine_url=url,
                        max_model_len=256, max_num_seqs=4)
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(server_command(cfg, port), cwd=ROOT, env=_env(**SERVER_ENV), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    engine = None
    try:
        with StorePublisher(store.location) as publisher:
            publisher.put_weights(weights.encode([weights.WeightTensor(
                name=k, shape=tuple(v.shape), dtype="float32", data=v.numpy().tobytes()) for k, v in new.items()]), 1)
            publisher.publish_version(1)
        engine = ServedEngine(cfg, url, start_timeout_s=240.0)

        def score() -> np.ndarray:
            doc = engine._post("/v1/completions", {"model": engine.model_name, "prompt": ids, "max_tokens": 1,
                                                   "prompt_logprobs": 0})
            lps = doc["choices"][0]["prompt_logprobs"]
            return np.array([lps[i][str(ids[i])]["logprob"] for i in range(1, len(ids))])

        assert np.abs(score() - ref).max() > 1e-2  # the folder's own weights first
        engine.load_version(1)
        np.testing.assert_allclose(score(), ref, atol=1e-4, rtol=0)
    finally:
        if engine is not None:
            engine.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        store.shutdown()
