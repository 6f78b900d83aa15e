"""The tiny vision-language model (``connectors.tiny_vl``) on both sides. In the trainer, Megatron-core's
``LLaVAModel`` built from the folder (``train.vl_model``) has the logits and tower gradients of a transformers
forward, gives its weights back under the folder's names bit for bit, and with the tower run once per distinct image
of a mini-batch has the gradients of the plain model. Between trainer and engine, vLLM scores a sample drawn from an
image as the trainer does; the trainer's weights, published to a store, load into it (tower and connector included,
the cached image encoding dropped), and it then scores as the trainer does with them. In the main job,
``knit run --model tiny-vl`` trains ``LLaVAModel`` on the squares task: each group's image stored once, read and
encoded once per mini-batch by the rank its group went to, the engine on the trainer's weights.

Everything runs in subprocesses: the trainer's checks as ``python -m train.verify --hf-checkpoint FOLDER``, the
rest as this file run as a script (:data:`DRIVERS`), as the text model's weight test does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from launcher.children import child_env

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "<image>how many squares?"


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "vl"
    code = f"from connectors.tiny_vl import build_tiny_vl; build_tiny_vl({str(out)!r}, seed=0)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), check=True, timeout=180,
                   capture_output=True)
    return out


def test_the_builder_refuses_a_grid_the_connector_cannot_merge(tmp_path: Path) -> None:
    from connectors.tiny_vl import build_tiny_vl

    with pytest.raises(ValueError, match="even grid"):
        build_tiny_vl(tmp_path, image_size=42, patch=14)  # 3x3 patches: no 2x2 blocks


def test_image_positions_are_each_prompts_image_tokens_padded_or_packed() -> None:
    import torch

    from train.vl_model import image_positions

    img = 9
    # two rows, right-padded: row 0 has one image (2 tokens) and samples the image id in its response (stays text);
    # row 1 has two images
    rows = torch.tensor([[1, img, img, 5, img, 0, 0], [1, img, img, 3, img, img, 4]])
    got = image_positions(rows, img, [2, 4])
    assert got.tolist() == [[False, True, True, False, False, False, False],
                            [False, True, True, False, True, True, False]]
    # the same rows packed into one (THD): each sequence's own first image tokens
    packed = torch.tensor([[1, img, img, 5, img, 1, img, img, 3, img, img, 4]])
    got = image_positions(packed, img, [2, 4], torch.tensor([0, 5, 12]))
    assert got[0].nonzero().flatten().tolist() == [1, 2, 6, 7, 9, 10]
    with pytest.raises(ValueError, match="sequence 1 holds 4 image tokens where its images fill 6"):
        image_positions(rows, img, [2, 6])


def test_the_trainer_takes_its_backbone_shape_from_the_vision_language_folder(tiny_vl: Path) -> None:
    from admission.config import AdmissionConfig
    from train.config import ModelConfig, ObjectiveConfig, TrainConfig
    from train.hf_config import read_hf_config

    model = ModelConfig(hf_checkpoint=str(tiny_vl))
    text = read_hf_config(str(tiny_vl))["text_config"]
    assert model.vision_language and not ModelConfig().vision_language
    assert (model.vocab_size, model.hidden_size, model.num_layers) == (
        text["vocab_size"], text["hidden_size"], text["num_hidden_layers"])
    with pytest.raises(ValueError, match="decoupled_ppo"):
        TrainConfig(stores=["grpc://127.0.0.1:1"], admission=AdmissionConfig(train_batch_groups=4, group_size=2),
                    model=model, loss=ObjectiveConfig(objective="decoupled_ppo"))


def test_the_trainer_processes_each_image_as_the_engine_does_one_tile_each(tiny_vl: Path) -> None:
    import numpy as np
    import torch
    from transformers import AutoImageProcessor

    from schemas.images import group_images, table_to_images
    from train.vl_step import pixel_values

    processor = AutoImageProcessor.from_pretrained(str(tiny_vl))
    imgs = [np.random.default_rng(i).integers(0, 256, (56, 56, 3), dtype=np.uint8) for i in range(3)]
    table, rows = group_images(imgs, 2, per_row=True)  # row 1's copies carry a unit axis
    got = pixel_values(processor, table_to_images(table))
    assert len(got) == 6
    for row in rows:
        for img, key in zip(imgs, row, strict=True):
            alone = processor([img], return_tensors="pt")["pixel_values"]  # what the engine's processor makes
            assert got[key].shape == (3, 56, 56) and torch.equal(got[key], alone[0, 0].float())


@pytest.mark.slow
def test_megatron_llava_from_the_folder_scores_as_transformers_maps_its_weights_and_encodes_each_image_once(
        store_nodes, tiny_vl: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import pyarrow as pa
    from safetensors.numpy import load_file

    from flight_store.publishing import StorePublisher
    from flight_store.reading import StoreReader
    from schemas.weights import WEIGHTS_SCHEMA

    (server,) = store_nodes(1)
    tensors = load_file(str(tiny_vl / "model.safetensors"))
    names = sorted(tensors)
    table = pa.table({"name": names, "shape": [list(tensors[k].shape) for k in names],
                      "dtype": ["float32"] * len(names),
                      "data": [np.ascontiguousarray(tensors[k]).tobytes() for k in names]}, schema=WEIGHTS_SCHEMA)
    with StoreReader(server.location) as client, StorePublisher.sharing(client) as publisher:
        publisher.put_weights(table, 0)
        publisher.publish_version(0)
    out = tmp_path / "verify.json"
    res = subprocess.run([sys.executable, "-m", "train.verify", "--hf-checkpoint", str(tiny_vl), "--store",
                          server.location, "--version", "0", "--out", str(out)], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["model"] == "idefics3"
    # what the engine side holds (the published table) is the trainer's weights bit for bit
    assert doc["store_mismatch"] == []
    assert doc["images"] == 1 and doc["tokens"] == 20
    assert doc["logprob_max_abs_diff"] < 1e-4  # every position, image tokens included
    assert doc["tower_grad_max_rel_diff"] < 1e-4  # the loss reaches the patch convolution as in transformers
    assert doc["round_trip_names_equal"] and doc["round_trip_mismatched"] == [] and doc["tensors"] == 59
    # the tower once per distinct image of the mini-batch, its tokens feeding every micro-batch: the gradients of
    # every parameter (tower, projector, backbone) are those of the plain model, which encodes every reference
    dedup = doc["dedup"]
    assert (dedup["distinct_images"], dedup["references"]) == (3, 6)
    assert (dedup["encoder_images_dedup"], dedup["encoder_images_plain"]) == (3, 6)
    assert dedup["tower_params_with_grad"] > 0 and dedup["projector_params_with_grad"] == 1
    assert dedup["same_param_names"] and dedup["mismatched"] == []
    # the check can fail: with the upstream (causal) tower mask the logits are not transformers'
    assert doc["causal_tower"]["logprob_max_abs_diff"] > 0.1


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_scores_an_image_prompt_as_the_trainer_and_after_loading_the_weights_it_publishes_too(
        store_nodes, tiny_vl: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    published, engine, scored = tmp_path / "published.json", tmp_path / "engine.json", tmp_path / "scored.json"
    for mode, args in (("trainer", ["-", str(published)]), ("engine", [str(engine)]),
                       ("trainer", [str(engine), str(scored)])):
        res = subprocess.run([sys.executable, __file__, mode, str(tiny_vl), server.location, *args], cwd=ROOT,
                             env=child_env(), capture_output=True, text=True, timeout=400)
        assert res.returncode == 0, mode + res.stdout[-3000:] + res.stderr[-3000:]
    pub, eng, doc = (json.loads(f.read_text()) for f in (published, engine, scored))
    assert pub["published_tensors"] == 59 and eng["tensors_loaded"] == 59 and eng["engine_version"] == 1
    # the trainer that scores holds the weights the engine loaded, bit for bit (rebuilt from the same seed)
    assert doc["differs_from_store"] == [] and doc["differs_from_folder"] > 0
    # vLLM wrote the image as the processor's four image tokens between its markers
    assert doc["prompt_image_tokens"] == 4 and eng["prompt"] == doc["processor_prompt"]
    # on the folder's weights, the engine scores a sample from the image as the trainer does ...
    assert doc["before_vs_trainer_folder"] < 1e-4
    # ... and after loading the published weights, as the trainer does with them, the same image encoded anew
    assert doc["after_vs_trainer"] < 1e-4
    assert doc["after_vs_trainer_folder"] > 1e-2


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.slow
def test_knit_run_trains_llava_on_the_squares_task_each_image_stored_once_and_encoded_once_per_mini_batch(
        tiny_vl: Path, tmp_path: Path) -> None:
    b, g, k, batches = 4, 4, 2, 2
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "launcher", "run", "--plain", "--model", "tiny-vl", "--model-dir",
                          str(tiny_vl), "--out", str(out), "--train-batch-groups", str(b), "--group-size", str(g),
                          "--mini-batches", str(k), "--train-batches", str(batches), "--timeout-s", "300"],
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads((out / "summary.json").read_text())["policies"]["mini_batch"]
    groups, rows = batches * b, batches * b * g
    assert r["config"]["data_sources"] == {"squares": 1.0} and r["config"]["reward"] == "exact"
    assert r["steps"] == batches * k and r["rows_received"] == rows and r["duplicate_rows"] == 0
    assert r["ledger"]["exact"]
    # vLLM's Idefics3 sampled from the images with the trainer's published version-0 weights: Megatron's LLaVAModel
    # scores the engine's tokens as the engine did, image tokens merged in
    assert r["abs_logp_diff_first_step"] < 1e-4
    images = r["images"]
    # each group's image stored once and referenced by its G rows ...
    assert images["images_written"] == groups and images["image_refs"] == rows
    # ... read by the one rank its group went to, and through the tower once in its mini-batch
    assert images["distinct_images"] == groups and images["encoder_passes"] == groups
    assert images["encoder_passes_per_distinct_image"] == 1.0
    assert len(images["image_bytes_per_rank"]) == 2 and min(images["image_bytes_per_rank"].values()) > 0
    assert "images stored / referenced" in res.stdout


def _trainer(model: str, location: str, engine_json: str, out: str) -> None:
    """Megatron ``LLaVAModel`` from ``model`` with seeded noise on every weight. Without ``engine_json`` ("-"),
    publish its weights as version 1 to the store at ``location``; with it, score the engine's sample there."""
    import numpy as np
    import torch
    from transformers import AutoProcessor

    from flight_store.net import free_port
    from flight_store.publishing import StorePublisher
    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter
    from schemas.weights import from_tensors, to_tensors
    from train import mcore_compat, vl_model
    from train.config import ParallelConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    mcore_compat.init_distributed(ParallelConfig(backend="gloo", timeout_s=120.0), seed=0)
    cfg = vl_model.read_config(model)
    net = vl_model.build_vl_model(cfg)
    vl_model.load_hf_vl_checkpoint(net, model)
    folder = {k: v.clone() for k, v in vl_model.megatron_to_hf_vl(net).items()}  # views of the parameters
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(net.named_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    weights = {k: v.clone() for k, v in vl_model.megatron_to_hf_vl(net).items()}
    with StoreReader(location) as client:
        if engine_json == "-":
            with StorePublisher.sharing(client) as publisher:
                publisher.put_weights(from_tensors(weights.items(), torch), 1)
                publisher.publish_version(1)
            Path(out).write_text(json.dumps({"published_tensors": len(weights)}))
            return
        with StoreWriter.sharing(client) as writer:
            stored = to_tensors(writer.get_weights(1), torch)
    eng = json.loads(Path(engine_json).read_text())
    p = eng["prompt"]
    proc = AutoProcessor.from_pretrained(model)
    pixels = proc.image_processor([_image()], return_tensors="pt")["pixel_values"].reshape(-1, 3, 56, 56).float()

    def score(state: dict[str, Any], sample: dict[str, Any]) -> float:
        vl_model.load_hf_vl_checkpoint_tensors(net, state)
        r = sample["response"]
        with torch.no_grad():
            logits = vl_model.vl_logits(net, p + r, pixels, cfg["image_token_id"])
        lp = logits[0].double().log_softmax(-1)
        want = np.array([lp[len(p) - 1 + i, t].item() for i, t in enumerate(r)])
        return float(np.abs(want - sample["logprobs"]).max())

    Path(out).write_text(json.dumps({
        "differs_from_store": sorted(n for n, t in weights.items() if not torch.equal(t, stored[n])),
        "differs_from_folder": sum(not torch.equal(t, folder[n]) for n, t in weights.items()),
        "prompt_image_tokens": p.count(cfg["image_token_id"]),
        "processor_prompt": proc(text=[PROMPT], images=[[_image()]])["input_ids"][0],
        "before_vs_trainer_folder": score(folder, eng["before"]), "after_vs_trainer": score(weights, eng["after"]),
        "after_vs_trainer_folder": score(folder, eng["after"]),
    }))
    mcore_compat.shutdown()


def _image() -> Any:
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(7).integers(0, 256, (56, 56, 3), dtype=np.uint8))


def _engine(model: str, location: str, out: str) -> None:
    """vLLM on ``model``: load the version published at ``location``, then sample from a prompt with an image."""
    from connectors.engine import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from connectors.engine_weights import WORKER_EXTENSION, load_weights_into_llm
    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter

    llm: Any = LLM(model=model, dtype="float32", max_model_len=256, seed=0, enforce_eager=True, max_num_seqs=4,
                   distributed_executor_backend="uni", worker_extension_cls=WORKER_EXTENSION)
    sp = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, flat_logprobs=True, seed=0, ignore_eos=True)

    def sample() -> Any:
        return llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": _image()}}], sp, use_tqdm=False)[0]

    before = sample()  # the image's encoding is cached now: loading weights must drop it
    with StoreReader(location) as client, StoreWriter.sharing(client) as writer:
        version = client.get_version()
        loaded = load_weights_into_llm(llm, writer.get_weights(version))
    after = sample()
    Path(out).write_text(json.dumps({
        "engine_version": version, "tensors_loaded": loaded, "prompt": list(after.prompt_token_ids),
        **{name: {"response": list(o.outputs[0].token_ids), "logprobs": list(o.outputs[0].logprobs.logprobs)}
           for name, o in (("before", before), ("after", after))}}))


DRIVERS: dict[str, Callable[..., None]] = {"trainer": _trainer, "engine": _engine}
"""This file as a script: ``python tests/test_tiny_vl.py MODE ARGS...``."""

if __name__ == "__main__":
    DRIVERS[sys.argv[1]](*sys.argv[2:])
