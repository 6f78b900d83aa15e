"""The tiny vision-language model (``connectors.tiny_vl``) on both sides: in the real engine, vLLM generates from an
image with the logprobs of a transformers forward, and weights moved through a store load into it, tower and
connector included; in the trainer, Megatron-core's ``LLaVAModel`` built from the folder (``train.vl_model``) has
the same logits and tower gradients, gives its weights back under the folder's names bit for bit, and with the
tower run once per distinct image of a mini-batch has the gradients of the plain model. Between them, weights the
trainer publishes load into vLLM, whose logprobs are then the trainer's.

Everything runs in subprocesses: the trainer's self-check as ``python -m train.vl_model FOLDER``, the rest as this
file run as a script (:data:`DRIVERS`), as the text model's weight test does.
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


@pytest.mark.slow
def test_megatron_llava_from_the_folder_scores_as_transformers_maps_its_weights_and_encodes_each_image_once(
        tiny_vl: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "train.vl_model", str(tiny_vl)], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout.strip().splitlines()[-1])
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
def test_vllm_generates_from_an_image_as_transformers_scores_it_and_takes_weights_from_the_store(
        store_nodes, tiny_vl: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    meta = json.loads((tiny_vl / "knittrans_tiny.json").read_text())
    assert meta["architecture"] == "idefics3" and meta["image_seq_len"] == 4
    (server,) = store_nodes(1)
    out = tmp_path / "vl.json"
    res = subprocess.run([sys.executable, __file__, "hf", str(tiny_vl), server.location, str(out)], cwd=ROOT,
                         env=child_env(), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    # the image became the processor's four image tokens between its markers, in vLLM as in transformers
    assert doc["prompt_ids"] == doc["hf_prompt_ids"]
    assert doc["prompt_ids"].count(doc["image_token_id"]) == 4
    assert doc["before_vs_hf"] < 1e-4
    # every tensor loaded (tower, connector, backbone), and the engine scores with the new ones only
    assert doc["tensors_loaded"] == doc["tensors_in_model"]
    assert {"vision", "connector", "text"} <= set(doc["parts"])
    assert doc["after_vs_hf_new"] < 1e-4
    assert doc["after_vs_hf_old"] > 1e-2
    # a second image after the reload is encoded with the new tower, not served from a stale encoding
    assert doc["other_image_vs_hf_new"] < 1e-4


@pytest.mark.vllm
@pytest.mark.slow
def test_weights_the_trainer_publishes_load_into_vllm_which_then_scores_as_the_trainer(
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
    assert doc["prompt_image_tokens"] == 4 and len(eng["response"]) == 8
    # the engine's logprob of every sampled token, image in context, is the trainer's
    assert doc["engine_vs_trainer"] < 1e-4
    assert doc["engine_vs_folder_weights"] > 1e-2  # and not what the folder's own weights give


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
    folder = vl_model.megatron_to_hf_vl(net)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(net.named_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    weights = vl_model.megatron_to_hf_vl(net)
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
    p, r = eng["prompt"], eng["response"]
    pixels = AutoProcessor.from_pretrained(model).image_processor([_image()], return_tensors="pt")["pixel_values"]

    def score(state: dict[str, Any]) -> float:
        vl_model.load_hf_vl_checkpoint_tensors(net, state)
        with torch.no_grad():
            logits = vl_model.vl_logits(net, p + r, pixels.reshape(-1, 3, 56, 56).float(), cfg["image_token_id"])
        lp = logits[0].double().log_softmax(-1)
        return float(np.abs(np.array([lp[len(p) - 1 + i, t].item() for i, t in enumerate(r)]) - eng["logprobs"]).max())

    Path(out).write_text(json.dumps({
        "differs_from_store": sorted(n for n, t in weights.items() if not torch.equal(t, stored[n])),
        "differs_from_folder": sum(not torch.equal(t, folder[n]) for n, t in weights.items()),
        "prompt_image_tokens": p.count(cfg["image_token_id"]),
        "engine_vs_trainer": score(weights), "engine_vs_folder_weights": score(folder),
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
    with StoreReader(location) as client, StoreWriter.sharing(client) as writer:
        version = client.get_version()
        loaded = load_weights_into_llm(llm, writer.get_weights(version))
    sp = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, flat_logprobs=True, seed=0, ignore_eos=True)
    o = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": _image()}}], sp, use_tqdm=False)[0]
    Path(out).write_text(json.dumps({
        "engine_version": version, "tensors_loaded": loaded, "prompt": list(o.prompt_token_ids),
        "response": list(o.outputs[0].token_ids), "logprobs": list(o.outputs[0].logprobs.logprobs)}))


def _driver(model: str, location: str, out: str) -> None:
    """vLLM on ``model``: generate from an image, score it in transformers; publish perturbed weights to the store
    at ``location``, fetch and load them into the engine; generate again from the same and from another image."""
    from connectors.engine import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration
    from vllm import LLM, SamplingParams

    from connectors.engine_weights import WORKER_EXTENSION, load_weights_into_llm
    from flight_store.publishing import StorePublisher
    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter
    from schemas.weights import from_tensors

    llm: Any = LLM(model=model, dtype="float32", max_model_len=256, seed=0, enforce_eager=True, max_num_seqs=4,
              distributed_executor_backend="uni", worker_extension_cls=WORKER_EXTENSION)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(2)]
    sp = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, flat_logprobs=True, seed=0)
    proc = AutoProcessor.from_pretrained(model)
    hf = Idefics3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32)

    def generate(image: Any) -> tuple[list[int], list[int], list[float]]:
        o = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}], sp, use_tqdm=False)[0]
        return list(o.prompt_token_ids), list(o.outputs[0].token_ids), list(o.outputs[0].logprobs.logprobs)

    def diff(state: dict[str, Any], image: Any, run: tuple[list[int], list[int], list[float]]) -> float:
        p, r, lp = run
        hf.load_state_dict(state)
        pix = proc(text=[PROMPT], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([p + r]), pixel_values=pix["pixel_values"],
                        pixel_attention_mask=pix["pixel_attention_mask"]).logits[0]
        want = torch.log_softmax(logits.double(), -1)
        return float(np.abs(np.array([want[len(p) - 1 + i, t].item() for i, t in enumerate(r)]) - lp).max())

    old = {k: v.clone() for k, v in hf.state_dict().items()}
    first = generate(images[0])
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    with StoreReader(location) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        publisher.put_weights(from_tensors(new.items(), torch), 1)
        publisher.publish_version(1)
        table = writer.get_weights(client.get_version())
    loaded = load_weights_into_llm(llm, table)
    again, other = generate(images[0]), generate(images[1])
    doc = {
        "prompt_ids": first[0], "hf_prompt_ids": proc(text=[PROMPT], images=[[images[0]]])["input_ids"][0],
        "image_token_id": hf.config.image_token_id, "before_vs_hf": diff(old, images[0], first),
        "tensors_loaded": loaded, "tensors_in_model": len(old),
        "parts": sorted({n.split(".")[1].split("_")[0] for n in table.column("name").to_pylist()}),
        "after_vs_hf_new": diff(new, images[0], again), "after_vs_hf_old": diff(old, images[0], again),
        "other_image_vs_hf_new": diff(new, images[1], other),
    }
    Path(out).write_text(json.dumps(doc))


DRIVERS: dict[str, Callable[..., None]] = {"hf": _driver, "trainer": _trainer, "engine": _engine}
"""This file as a script: ``python tests/test_tiny_vl.py MODE ARGS...``."""

if __name__ == "__main__":
    DRIVERS[sys.argv[1]](*sys.argv[2:])
